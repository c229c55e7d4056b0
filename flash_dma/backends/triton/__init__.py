"""The Triton backend: forward and backward kernels behind ``torch.library`` custom ops."""

from __future__ import annotations

from flash_dma.backends.triton.ops import attention_op
from flash_dma.block_mask import build_block_mask


def attention(problem):
    """Backend entry point: ``(out, lse)`` for a validated :class:`~flash_dma.inputs.AttentionProblem`."""
    block_mask = problem.block_mask
    if block_mask is None and problem.attn_mask is not None:
        block_mask = build_block_mask(problem.attn_mask)
    kv_lists = q_lists = None
    list_block_q = list_block_k = 0
    mask = None
    if block_mask is not None:
        kv_lists, q_lists = block_mask.kv_lists, block_mask.q_lists
        # An axis of one summary block spans the whole axis (broadcast or short): size 0 says so.
        list_block_q = block_mask.block_size[0] if block_mask.state.shape[2] > 1 else 0
        list_block_k = block_mask.block_size[1] if block_mask.state.shape[3] > 1 else 0
        # Without PARTIAL blocks the element-wise mask is never read.
        mask = problem.attn_mask if block_mask.needs_mask else None
    left, right = problem.window
    return attention_op(
        problem.query, problem.key, problem.value, mask, problem.attn_bias, kv_lists, q_lists,
        list_block_q, list_block_k, problem.softmax_scale, left, right, problem.softcap, problem.deterministic,
    )
