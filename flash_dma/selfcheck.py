"""A short end-to-end check: attention with a mask and a trainable bias on every available backend."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")


def main(args) -> int:
    return 0 if run(args.device) else 1


def run(device: str | None = None, seed: int = 0) -> bool:
    # Imported here: `flash-dma selfcheck --help` declares the arguments without importing torch.
    import torch

    from flash_dma import build_block_mask, flash_dma_func, get_available_backends
    from flash_dma.backends.reference import reference_attention

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    batch, seqlen, heads, kv_heads, head_dim = 2, 256, 4, 2, 64
    q, k, v = (
        torch.randn(batch, seqlen, h, head_dim, generator=gen).to(device) for h in (heads, kv_heads, kv_heads)
    )
    bias = torch.randn(batch, kv_heads, 1, seqlen, generator=gen).to(device).requires_grad_()
    # Keep the 64 keys with the largest bias: a per-key dynamic mask, broadcast over queries.
    mask = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, bias.topk(64, dim=-1).indices, True)
    expected, _ = reference_attention(
        *(t.double() for t in (q, k, v)), mask, bias.detach().double(), window=(-1, 0), compute_dtype=torch.float64
    )
    print(f"flash-dma self-check on {device}: B={batch} S={seqlen} H={heads} Hkv={kv_heads} D={head_dim}, causal,")
    print(f"  per-key mask keeping 64 of {seqlen} keys ({build_block_mask(mask)}), random bias")
    ok = True
    for backend in get_available_backends(device):
        bias.grad = None
        out = flash_dma_func(q, k, v, mask, bias, is_causal=True, backend=backend)
        out.square().sum().backward()
        error = ((out.double() - expected).norm() / expected.norm()).item()
        grad_ok = bias.grad is not None and bias.grad.shape == bias.shape and bool(bias.grad.isfinite().all())
        passed = error < 1e-3 and grad_ok
        ok &= passed
        print(
            f"  {backend:>9}: relative error {error:.2e} vs float64, bias grad {tuple(bias.grad.shape)} "
            f"|g|={bias.grad.norm():.3e}  {'ok' if passed else 'FAILED'}"
        )
    return ok
