"""Compile the kernels for a GPU target on any machine (no GPU needed) and report their resources.

Catches Triton front-end errors before a device run, and shows what the compiler made of each
variant: whether wgmma is used, shared memory, registers and spills (from ptxas).

    python tools/compile_report.py            # sm90, a representative set of variants
    python tools/compile_report.py --arch 80
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flash_dma.backends.triton.backward import _dkdv_kernel, _dq_kernel
from flash_dma.backends.triton.forward import _attn_fwd_kernel

_POINTER_TYPES = {"Mask": "*u8", "Lists": "*i32", "Lse": "*fp32", "Delta": "*fp32", "DBias": "*fp32"}
_FLOAT_SCALARS = ("scale", "softcap_log2", "scale_log2", "scale_over_cap")


def _signature(kernel, constexprs: dict, dtype: str, out_fp32: bool) -> dict:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "Out" and out_fp32:
            signature[name] = "*fp32"
        elif name in _POINTER_TYPES:
            signature[name] = _POINTER_TYPES[name]
        elif name[0].isupper():
            signature[name] = f"*{dtype}"
        elif name in _FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def _ptxas_report(kernel, arch: int) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        result = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}", ptx.name, "-o", "/dev/null"],
            capture_output=True, text=True,
        )
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    return f"regs={registers.group(1) if registers else '?'} spill_stores={spills.group(1) if spills else '?'}"


def compile_variant(kernel, arch: int, dtype: str, warps: int, stages: int, **constexprs) -> str:
    source = ASTSource(
        kernel,
        _signature(kernel, constexprs, dtype, constexprs.get("SPLIT", False)),
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    start = time.time()
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    seconds = time.time() - start
    mma = "wgmma" if "wgmma" in compiled.asm["ptx"] else "mma" if "mma.sync" in compiled.asm["ptx"] else "no-mma"
    return f"{seconds:5.1f}s {mma:6} smem={compiled.metadata.shared:6d} {_ptxas_report(compiled, arch)}"


_BASE = dict(HAS_MASK=True, HAS_BIAS=True, HAS_LISTS=True, MASK_PER_KEY=True, BIAS_PER_KEY=True, SOFTCAP=False, DOT_PRECISION="tf32")
_DENSE = dict(_BASE, HAS_MASK=False, HAS_LISTS=False, MASK_PER_KEY=False, BIAS_PER_KEY=False, SOFTCAP=True)
_FULL_MASK = dict(_BASE, MASK_PER_KEY=False, BIAS_PER_KEY=False)
_FORWARD = dict(PACK_GQA=False, SPLIT=False, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128)
_DKDV = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, DBIAS_HEAD_SHARED=True)
_DQ = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=128)
# (name, kernel, warps, stages, constexprs): one per code path that matters.
VARIANTS = [
    ("forward-per-key", _attn_fwd_kernel, 8, 3, {**_BASE, **_FORWARD}),
    ("forward-full-mask", _attn_fwd_kernel, 8, 3, {**_FULL_MASK, **_FORWARD}),
    ("forward-dense-softcap", _attn_fwd_kernel, 8, 3, {**_DENSE, **_FORWARD}),
    ("forward-decode", _attn_fwd_kernel, 4, 3, {**_BASE, **_FORWARD, "PACK_GQA": True, "SPLIT": True, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_D": 64}),
    ("forward-d256", _attn_fwd_kernel, 8, 2, {**_BASE, **_FORWARD, "BLOCK_N": 32, "BLOCK_D": 256}),
    ("dkdv-per-key", _dkdv_kernel, 8, 2, {**_BASE, **_DKDV, "DBIAS": 1, "DBIAS_ATOMIC": False}),
    ("dkdv-full-bias-atomic", _dkdv_kernel, 8, 2, {**_FULL_MASK, **_DKDV, "DBIAS": 2, "DBIAS_ATOMIC": True}),
    ("dkdv-dense-softcap", _dkdv_kernel, 8, 2, {**_DENSE, **_DKDV, "DBIAS": 0, "DBIAS_ATOMIC": False}),
    ("dq-per-key", _dq_kernel, 8, 2, {**_BASE, **_DQ}),
    ("dq-full-mask", _dq_kernel, 8, 2, {**_FULL_MASK, **_DQ}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    for name, kernel, warps, stages, constexprs in VARIANTS:
        print(f"{name:24s} {compile_variant(kernel, args.arch, 'bf16', warps, stages, **constexprs)}", flush=True)


if __name__ == "__main__":
    main()
