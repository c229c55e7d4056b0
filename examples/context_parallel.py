"""Context-parallel attention with a per-key mask and a trainable bias, checked against one process and float64.

    python examples/context_parallel.py               # 2 processes: NCCL on 2 GPUs, else gloo on the CPU
    python examples/context_parallel.py --world 4     # any number of processes (GPUs, if on CUDA)
    torchrun --nproc-per-node 2 examples/context_parallel.py   # the same, started by torchrun

Every rank builds the whole sequence from one seed (a real job would load its shard), takes
its zigzag shard, attends over the whole sequence, and checks its rows and gradients.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_dma import flash_dma_func
from flash_dma.backends.reference import reference_attention
from flash_dma.distributed import context_parallel_attention, shard_sequence
from flash_dma.masks import create_mask


def main() -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch, seqlen, heads, kv_heads, head_dim = 1, 1000, 4, 2, 64

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, seqlen, kv_heads, head_dim, generator=gen).to(device, dtype)
    bias = torch.randn(batch, kv_heads, 1, seqlen, generator=gen).to(device, dtype)  # per key
    mask = create_mask(bias, None, batch, seqlen, seqlen, window_size=256)  # top 256 keys per head

    # This rank's shard: tokens along dim 1, per-key mask and bias along their key axis (dim 3).
    q_r, k_r, v_r = (shard_sequence(t, dim=1).requires_grad_() for t in (q, k, v))
    mask_r = shard_sequence(mask, dim=3)
    bias_r = shard_sequence(bias, dim=3).requires_grad_()
    out_r = context_parallel_attention(q_r, k_r, v_r, mask_r, bias_r, is_causal=True)
    out_r.double().square().sum().backward()
    mine = (out_r, q_r.grad, k_r.grad, v_r.grad, bias_r.grad)

    # The same on the whole sequence in one process, and in float64 (the reference backend).
    one, _ = whole_sequence(partial(flash_dma_func, is_causal=True, return_lse=True), q, k, v, mask, bias)
    exact, lse = whole_sequence(
        partial(reference_attention, window=(-1, 0), compute_dtype=torch.float64),  # causal: no key after the query
        *(t.double() for t in (q, k, v)), mask, bias.double(),
    )

    # Neither the ring nor one process is exact: both round, in different orders (the ring adds
    # each rank's keys apart, then merges the partial results by their log-sum-exp). So both are
    # held to float64: the ring's error may be twice one process's, plus what its merges round.
    # A merge weighs a partial by exp(its lse - the merged lse), a difference of float32 values of
    # size |lse|: |lse| float32 ulps of relative error, and a few more in the weighted sum, per
    # merged partial (at most two per ring step: a zigzag shard is two chunks), then one rounding
    # to the output's dtype.
    merges = 2 * dist.get_world_size()
    lse_magnitude = lse[lse.isfinite()].abs().max().item()  # -inf: rows that see no key
    rounding = merges * (lse_magnitude + 4) * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps
    for name, ours, theirs, truth, dim in zip(("out", "dq", "dk", "dv", "dbias"), mine, one, exact, (1, 1, 1, 1, 3)):
        theirs, truth = (shard_sequence(t, dim=dim).double() for t in (theirs, truth))
        error = (ours.double() - truth).abs().max().item()
        own = (theirs - truth).abs().max().item()
        allowed = 2 * own + rounding * truth.abs().max().item()
        assert error <= allowed, (
            f"rank {rank}: {name} is {error:.2e} from float64, one process {own:.2e} (allowed {allowed:.2e})"
        )
    print(f"rank {rank}: {q_r.shape[1]} of {seqlen} tokens; out and gradients match one process (against float64)")


def whole_sequence(attend, q, k, v, mask, bias) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([out, dq, dk, dv, dbias], lse)`` of the example's loss, ``attend`` (returning ``out`` and
    ``lse``) on the whole sequence. ``lse`` is ``[B, H, S]``, the others shaped as their inputs."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, lse = attend(*leaves[:3], mask, leaves[3])
    out.double().square().sum().backward()
    return [out.detach(), *(t.grad for t in leaves)], lse.detach()


def _run(rank: int, world: int, init_method: str) -> None:
    # One GPU a rank; with fewer GPUs than ranks, the CPU (gloo).
    backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        main()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--port", type=int, default=29500 + os.getpid() % 1000)
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun, which set up the rendezvous
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    else:
        mp.spawn(_run, args=(args.world, f"tcp://127.0.0.1:{args.port}"), nprocs=args.world)
