"""The models of the llama, firstcall and doge suites: a 4-layer transformers Llama, and a 4-layer
transformers Doge (the seeds' model family, with its dynamic mask), both with random weights.

Its attention has the llm suite's shape (H=16, Hkv=4, D=128), so a layer's attention is one of
that suite's problems, without mask or bias. The vocabulary is the real 32000: at S=16K the
LM loss's logits (``[1, 16K, 32000]`` bf16, plus their float32 copies in the loss and its
backward) take about 6 GiB, which the H100 holds, and the head's share of a step stays that of
a real model. transformers is imported only when a model is built.
"""

from __future__ import annotations

import torch

from flash_dma.benchmark.suites import BATCH_CACHE_BLOCKS, BATCH_NEW_TOKENS, BATCH_PROMPT_LENGTHS, GENERATE_NEW_TOKENS

LLAMA_CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
}
# Doge as the per-query-mask issue measures it: its attention keeps each query's top 1024 keys.
DOGE_CONFIG = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 4096,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
    "keep_window_size": 1024,
    "is_moe": False,
}
MODEL_DTYPE = torch.bfloat16
WEIGHT_SEED = 0  # both attention implementations get the same weights


def describe_llama() -> str:
    c = LLAMA_CONFIG
    return (
        f"transformers Llama, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} K/V), intermediate "
        f"{c['intermediate_size']}, vocab {c['vocab_size']}, random weights"
    )


def describe_doge() -> str:
    c = DOGE_CONFIG
    return (
        f"transformers Doge, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
        f"({c['num_key_value_heads']} K/V), keep_window_size {c['keep_window_size']}, vocab {c['vocab_size']}, random weights"
    )


def build_llama(attn_implementation: str, device: torch.device | str, family: str = "llama") -> torch.nn.Module:
    """The model (``family`` "llama" or "doge") in bf16 on ``device``, initialised there (a CPU init
    of its 0.3 B weights takes seconds).

    ``attn_implementation="flash_dma"`` is registered first (``flash_dma.integrations.transformers``).
    """
    from transformers import AutoModelForCausalLM, DogeConfig, LlamaConfig

    from flash_dma.integrations.transformers import ATTENTION_NAME, register

    if attn_implementation == ATTENTION_NAME:
        register()
    config = LlamaConfig(**LLAMA_CONFIG) if family == "llama" else DogeConfig(**DOGE_CONFIG)
    torch.manual_seed(WEIGHT_SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        if family == "doge":
            for layer in model.model.layers:  # away from Doge's A = 0, where every key's score ties
                torch.nn.init.normal_(layer.self_attn.A)
    return model.to(MODEL_DTYPE)


def train_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The LM loss over every position of ``input_ids`` ``[B, S]``: the forward of a train step.

    ``use_cache=False``: otherwise the forward would also fill a KV cache, as generation does.
    """
    return model(input_ids, labels=input_ids, use_cache=False).loss


def generate_batch(model: torch.nn.Module, input_ids: torch.Tensor) -> dict:
    """Continuous batching (``generate_batch``, transformers' paged cache and scheduler, its default
    configuration but for :data:`BATCH_CACHE_BLOCKS`) of one request per row of ``input_ids``
    ``[len(BATCH_PROMPT_LENGTHS), S]``, row ``i`` cut to ``BATCH_PROMPT_LENGTHS[i]`` tokens; greedy,
    exactly :data:`BATCH_NEW_TOKENS` each."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts = [row[:length].tolist() for row, length in zip(input_ids, BATCH_PROMPT_LENGTHS, strict=True)]
    # No end token (-1 is never produced), so every request generates all its tokens.
    config = GenerationConfig(max_new_tokens=BATCH_NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = None if BATCH_CACHE_BLOCKS is None else ContinuousBatchingConfig(num_blocks=BATCH_CACHE_BLOCKS)
    results = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=batching, warmup=False)
    errors = sorted({r.error for r in results.values() if r.error})
    if errors:
        raise RuntimeError(f"generate_batch: {len(errors)} distinct request errors, first: {errors[0]}")
    return results


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
