"""``flash-dma bench-cp``: context-parallel attention on N GPUs against one GPU.

The llm shape (B=1, H=16, Hkv=4, D=128, bf16, causal) with a per-key mask keeping 1/8 of the
128-key blocks of each K/V head (the llm suite's ``block_topk_mask`` of random scores over the
whole sequence, block 0 always), or no mask (keep 1, bias only), and a trainable per-key bias ``[1, 4, 1, S]``.

Weak scaling: S tokens on N GPUs (S/N a GPU, zigzag layout) against S/N tokens on one GPU.
Attention work grows with the square of the length, so the efficiency compares work per second
per GPU: ``(pairs(S) / (N * t_N)) / (pairs(S/N) / t_1)``, over the (query, key) pairs that the
mask and the causal rule leave (``metrics.active_pairs``; FLOPs per pair cancel out). Times are the slowest rank's; memory is each GPU's peak in forward+backward.

The parallel calls take a plan made before timing (``plan_context_parallel``, as a model makes one
for all its layers), so that the times are those of the steady path, with no host round trip.
:data:`TARGETS` are the issues' goals for the efficiency; a run prints each as PASS or MISS.

Writes ``results.json`` and ``results.md`` to ``--out``. The arguments are declared in
:func:`flash_dma.benchmark.cli.add_context_parallel_arguments`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_dma import flash_dma_func
from flash_dma.argument_types import NO_CUDA_EXIT_CODE
from flash_dma.benchmark.inputs import block_topk_mask
from flash_dma.benchmark.metrics import active_pairs
from flash_dma.benchmark.report import checks_markdown
from flash_dma.benchmark.targets import MODE_LABELS, Check, format_amount
from flash_dma.distributed import context_parallel_attention, plan_context_parallel, shard_sequence
from flash_dma.distributed.layout import shard_length

SHAPE = {"heads": 16, "kv_heads": 4, "head_dim": 128}


class EfficiencyTarget(NamedTuple):
    """The efficiency of one row and pass must be at least ``limit``."""

    total: int
    keep: float
    mode: str  # "fwd" or "fwdbwd"
    limit: float


# Issue 30: context parallelism's fixed cost (measured on 2 GPUs).
TARGETS = (EfficiencyTarget(262144, 0.125, "fwd", 0.9), EfficiencyTarget(262144, 0.125, "fwdbwd", 0.9))


def block_mask_keys(total: int, keep: float, seed: int) -> torch.Tensor | None:
    """``[1, Hkv, 1, total]`` bool: the llm suite's block top-k of random per-key scores, or None for keep 1."""
    if keep >= 1:
        return None
    scores = torch.rand(1, SHAPE["kv_heads"], 1, total, generator=torch.Generator().manual_seed(seed))
    return block_topk_mask(scores, keep)


def _inputs(length: int, mask: torch.Tensor | None, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, length, SHAPE["heads"], SHAPE["head_dim"], device=device, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, length, SHAPE["kv_heads"], SHAPE["head_dim"], device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bias = torch.randn(1, SHAPE["kv_heads"], 1, length, device=device, generator=gen, dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    return leaves, None if mask is None else mask.to(device)


def _timed(fn, reps: int, group_wide: bool) -> float:
    """Seconds per call, after a warm-up; with ``group_wide``, the slowest rank's."""
    fn()
    torch.cuda.synchronize()
    if group_wide:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / reps], device="cuda")
    if group_wide:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _measure(attend, leaves, reps: int, group_wide: bool) -> dict:
    """Forward and forward+backward seconds, and the peak memory of forward+backward."""
    dout = torch.randn_like(leaves[0])

    def forward():
        with torch.no_grad():
            attend()

    def forward_backward():
        attend().backward(dout)
        for t in leaves:
            t.grad = None

    fwd = _timed(forward, reps, group_wide)
    torch.cuda.reset_peak_memory_stats()
    fwdbwd = _timed(forward_backward, reps, group_wide)
    return {"fwd_s": fwd, "fwdbwd_s": fwdbwd, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def _run_rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    rows = []
    for total in args.lengths:
        for keep in args.keeps:
            local = total // world
            row = {"total": total, "gpus": world, "keep": keep, "tokens_per_gpu": local}
            # One GPU, S/N tokens: rank 0 measures while the others wait.
            if rank == 0:
                mask = block_mask_keys(local, keep, seed=1)
                leaves, device_mask = _inputs(local, mask, "cuda", seed=1)
                single = _measure(
                    lambda: flash_dma_func(*leaves[:3], device_mask, leaves[3], is_causal=True), leaves, args.reps, False
                )
                row["single"] = {**single, "pairs": active_pairs(local, local, 1, SHAPE["heads"], mask)}
                del leaves, device_mask
                torch.cuda.empty_cache()
            dist.barrier()
            mask = block_mask_keys(total, keep, seed=2)
            shard_mask = None if mask is None else shard_sequence(mask, dim=3)
            leaves, device_mask = _inputs(shard_length(total, world, rank, "zigzag"), shard_mask, "cuda", seed=3 + rank)
            plan = plan_context_parallel(*leaves[:3], device_mask, leaves[3], is_causal=True)
            parallel = _measure(
                lambda: context_parallel_attention(*leaves[:3], device_mask, leaves[3], is_causal=True, plan=plan),
                leaves, args.reps, True,
            )
            peaks = [None] * world
            dist.all_gather_object(peaks, parallel.pop("peak_gib"))
            row["parallel"] = {**parallel, "peak_gib_per_gpu": peaks, "pairs": active_pairs(total, total, 1, SHAPE["heads"], mask)}
            del leaves, device_mask, plan
            torch.cuda.empty_cache()
            if rank == 0:
                row["efficiency"] = _efficiency(row, world)
                rows.append(row)
                print(json.dumps(row), flush=True)
                _write(args, rows, world)
    dist.destroy_process_group()


def _efficiency(row: dict, world: int) -> dict:
    single, parallel = row["single"], row["parallel"]
    return {
        mode: (parallel["pairs"] / (world * parallel[f"{mode}_s"])) / (single["pairs"] / single[f"{mode}_s"])
        for mode in ("fwd", "fwdbwd")
    }


def evaluate(rows: list[dict], world: int) -> list[Check]:
    """The checks of :data:`TARGETS` whose rows the run made."""
    checks = []
    for target in TARGETS:
        for row in rows:
            if (row["total"], row["keep"]) != (target.total, target.keep):
                continue
            value = 100 * row["efficiency"][target.mode]
            times = row["single"][f"{target.mode}_s"], row["parallel"][f"{target.mode}_s"]
            checks.append(Check(
                name=f"{world} GPUs, {target.total // 1024}K keep {target.keep:g} {MODE_LABELS[target.mode]}: "
                     "per-GPU speed / 1 GPU's",
                target=f">= {format_amount(100 * target.limit, '%')}",
                value=value,
                status="PASS" if value >= 100 * target.limit else "MISS",
                detail=f"1 GPU, S/{world} tokens {1e3 * times[0]:.1f} ms; {world} GPUs, S tokens {1e3 * times[1]:.1f} ms",
                unit="%",
            ))
    return checks


def _environment(world: int) -> dict:
    import triton

    return {
        "gpus": [torch.cuda.get_device_name(i) for i in range(world)],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(sys.argv),
    }


def _write(args: argparse.Namespace, rows: list[dict], world: int) -> None:
    env = _environment(world)
    args.out.mkdir(parents=True, exist_ok=True)
    checks = evaluate(rows, world)
    (args.out / "results.json").write_text(
        json.dumps({"environment": env, "rows": rows, "checks": [dataclasses.asdict(c) for c in checks]}, indent=2)
    )
    lines = [
        f"# Context parallelism: {world} x {env['gpus'][0]}",
        "",
        f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, NCCL {env['nccl']}; {env['date']}",
        f"`{env['command']}`",
        "",
        "| tokens | keep | mode | 1 GPU, S/N tokens (ms) | N GPUs, S tokens (ms) | efficiency | peak GiB per GPU (N GPUs / 1 GPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for mode in ("fwd", "fwdbwd"):
            peaks = "" if mode == "fwd" else (
                " / ".join(f"{p:.1f}" for p in row["parallel"]["peak_gib_per_gpu"]) + f" ({row['single']['peak_gib']:.1f})"
            )
            lines.append(
                f"| {row['total'] // 1024}K | {row['keep']:g} | {MODE_LABELS[mode]} | {1e3 * row['single'][f'{mode}_s']:.1f} | "
                f"{1e3 * row['parallel'][f'{mode}_s']:.1f} | {100 * row['efficiency'][mode]:.0f}% | {peaks} |"
            )
    (args.out / "results.md").write_text("\n".join(lines) + "\n\n" + checks_markdown(checks) + "\n")


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("flash-dma bench-cp: no CUDA GPU is available; context parallelism is timed on GPUs.", file=sys.stderr)
        return NO_CUDA_EXIT_CODE
    world = args.gpus or torch.cuda.device_count()
    mp.spawn(_run_rank, args=(world, args, 29400 + os.getpid() % 1000), nprocs=world)
    print((args.out / "results.md").read_text())
    return 0
