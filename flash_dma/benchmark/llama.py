"""The model of the llama and firstcall suites: a 4-layer transformers Llama with random weights.

Its attention has the llm suite's shape (H=16, Hkv=4, D=128), so a layer's attention is one of
that suite's problems, without mask or bias. The vocabulary is the real 32000: at S=16K the
LM loss's logits (``[1, 16K, 32000]`` bf16, plus their float32 copies in the loss and its
backward) take about 6 GiB, which the H100 holds, and the head's share of a step stays that of
a real model. transformers is imported only when a model is built.
"""

from __future__ import annotations

import torch

LLAMA_CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
}
MODEL_DTYPE = torch.bfloat16
WEIGHT_SEED = 0  # both attention implementations get the same weights
GENERATE_NEW_TOKENS = 8


def describe_llama() -> str:
    c = LLAMA_CONFIG
    return (
        f"transformers Llama, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} K/V), intermediate "
        f"{c['intermediate_size']}, vocab {c['vocab_size']}, random weights"
    )


def build_llama(attn_implementation: str, device: torch.device | str) -> torch.nn.Module:
    """The model in bf16 on ``device``, initialised there (a CPU init of its 0.3 B weights takes seconds).

    ``attn_implementation="flash_dma"`` is registered first (``flash_dma.integrations.transformers``).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    from flash_dma.integrations.transformers import ATTENTION_NAME, register

    if attn_implementation == ATTENTION_NAME:
        register()
    torch.manual_seed(WEIGHT_SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_CONFIG), attn_implementation=attn_implementation)
    return model.to(MODEL_DTYPE)


def train_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The LM loss over every position of ``input_ids`` ``[B, S]``: the forward of a train step.

    ``use_cache=False``: otherwise the forward would also fill a KV cache, as generation does.
    """
    return model(input_ids, labels=input_ids, use_cache=False).loss


def generate(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    """Greedy generation of exactly :data:`GENERATE_NEW_TOKENS` tokens after ``prompt`` ``[B, S]``."""
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=GENERATE_NEW_TOKENS,
        min_new_tokens=GENERATE_NEW_TOKENS,  # a random model may produce its end token early
        do_sample=False,
        pad_token_id=0,
    )
