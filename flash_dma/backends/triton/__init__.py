"""The Triton backend: forward and backward kernels behind ``torch.library`` custom ops.

How the kernels walk a mask's sparsity is chosen here, from shapes alone (no host sync):

- a per-key mask (``[., 1|Hkv, 1, Sk]``, and a per-key block summary if one is given): a key
  list, so that tiles hold only kept keys, however scattered (``key_list.py``);
- any other mask or summary: the block summary's lists, built here when not given;
- no mask: every tile inside the causal/window band.
"""

from __future__ import annotations

from flash_dma.backends.triton.ops import attention_op, key_list
from flash_dma.block_mask import build_block_mask


def _per_key(problem) -> bool:
    """Whether one set of keys serves every query (and every query head of a GQA group)."""
    mask, block_mask = problem.attn_mask, problem.block_mask
    if mask is None and block_mask is None:
        return False
    _, _, _, num_heads, num_kv_heads, _ = problem.shape
    shapes = [t.shape for t in (mask, None if block_mask is None else block_mask.state) if t is not None]
    heads = max(s[1] for s in shapes)
    return all(s[2] == 1 for s in shapes) and (heads in (1, num_kv_heads) or num_heads == num_kv_heads)


def attention(problem):
    """Backend entry point: ``(out, lse)`` for a validated :class:`~flash_dma.inputs.AttentionProblem`."""
    mask, block_mask = problem.attn_mask, problem.block_mask
    seqlen_k = problem.key.shape[1]
    kv_lists = q_lists = keys = None
    list_block_q = list_block_k = 0
    if _per_key(problem):
        state = None
        if block_mask is not None:
            state = block_mask.state
            list_block_k = block_mask.block_size[1] if state.shape[3] > 1 else 0
        keys = key_list(mask, seqlen_k, state, list_block_k)
        mask, list_block_k = None, 0
    elif mask is not None or block_mask is not None:
        if block_mask is None:
            block_mask = build_block_mask(mask)
        kv_lists, q_lists = block_mask.kv_lists, block_mask.q_lists
        # An axis of one summary block spans the whole axis (broadcast or short): size 0 says so.
        list_block_q = block_mask.block_size[0] if block_mask.state.shape[2] > 1 else 0
        list_block_k = block_mask.block_size[1] if block_mask.state.shape[3] > 1 else 0
        # Without PARTIAL blocks the element-wise mask is never read.
        mask = mask if block_mask.needs_mask else None
    left, right = problem.window
    return attention_op(
        problem.query, problem.key, problem.value, mask, problem.attn_bias, kv_lists, q_lists, keys,
        list_block_q, list_block_k, problem.softmax_scale, left, right, problem.softcap, problem.deterministic,
    )
