"""Error of the FP8 forward on FlashAttention-3's test distribution, next to 16-bit inputs.

FlashAttention-3 (arXiv 2407.08608, section 4.3) draws Q, K and V from N(0, 1) plus, for 0.1% of
the entries, N(0, 100), and reports the RMSE of the output against float64. Here the same inputs
are quantized to e4m3 per (batch, key/value head) as ``flash-dma bench``'s ``flash-dma-fp8`` rows
quantize them (``flash_dma.benchmark.methods.quantized_fp8``), and every row's RMSE is taken
against float64 on the unquantized inputs:

- 16-bit inputs and FP8 inputs through ``flash_dma_func`` (on a GPU the kernels the routing table
  picks; on the CPU the reference backend, float32 math);
- an emulation of the Hopper FP8 forward: the dequantized inputs in float32 with the probabilities
  rounded to e4m3 before ``P V`` and the scores to the FP8 accumulator's precision
  (``reference_attention(..., fp8_tensor_cores=True)``).

    python3 tools/fp8_error.py                       # the GPU if there is one, else the CPU
    python3 tools/fp8_error.py --device cpu --seqlen 1024
"""

from __future__ import annotations

import argparse

import torch

from flash_dma import flash_dma_func
from flash_dma.backends.reference import reference_attention
from flash_dma.benchmark.methods import quantized_fp8
from flash_dma.inputs import FP8_OUT_DTYPE, dequantize

WINDOWS = {"full": (-1, -1), "causal": (-1, 0)}


def draw(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """FlashAttention-3's test inputs, float64 on the CPU: N(0, 1) + N(0, 100) * Bernoulli(0.001)."""
    normal = torch.randn(shape, generator=gen, dtype=torch.float64)
    outliers = torch.randn(shape, generator=gen, dtype=torch.float64) * 10 * (torch.rand(shape, generator=gen) < 0.001)
    return normal + outliers


def errors(batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int, window, device: torch.device) -> dict:
    """``{row: RMSE}`` of one problem (module doc), and ``"rms(O)"``."""
    gen = torch.Generator().manual_seed(0)
    q = draw((batch, seqlen, heads, head_dim), gen)
    k, v = (draw((batch, seqlen, kv_heads, head_dim), gen) for _ in range(2))
    exact, _ = reference_attention(q, k, v, window=window, compute_dtype=torch.float64)

    def rmse(out: torch.Tensor) -> float:
        return (out.cpu().double() - exact).pow(2).mean().sqrt().item()

    def call(*tensors, **kwargs) -> torch.Tensor:
        causal = window == WINDOWS["causal"]
        return flash_dma_func(*(t.to(device) for t in tensors), is_causal=causal, **{n: d.to(device) for n, d in kwargs.items()})

    rows = {f"{name} inputs": rmse(call(*(t.to(dtype) for t in (q, k, v)))) for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16))}
    (q8, qd), (k8, kd), (v8, vd) = (quantized_fp8(t.float(), kv_heads) for t in (q, k, v))
    rows["FP8 inputs"] = rmse(call(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
    dequantized = [dequantize(t, d) for t, d in ((q8, qd), (k8, kd), (v8, vd))]
    emulated, _ = reference_attention(*dequantized, window=window, fp8_tensor_cores=True)
    rows["FP8, the Hopper forward emulated"] = rmse(emulated.to(FP8_OUT_DTYPE))
    rows["rms(O)"] = exact.pow(2).mean().sqrt().item()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"B={args.batch} S={args.seqlen} H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else " (reference backend)"))
    for name, window in WINDOWS.items():
        rows = errors(args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim, window, device)
        print(f"{name}: " + "; ".join(f"{row} {value:.2e}" for row, value in rows.items()))


if __name__ == "__main__":
    main()
