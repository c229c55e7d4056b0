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
from triton.experimental.gluon._runtime import GluonASTSource

from flash_dma.backends.triton.variants import VARIANTS, Variant


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


def compile_variant(variant: Variant, arch: int, dtype: str) -> str:
    kernel = variant.kernel
    source = (GluonASTSource if kernel.is_gluon() else ASTSource)(
        kernel,
        variant.signature(dtype),
        constexprs={(kernel.arg_names.index(k),): v for k, v in variant.constexprs.items()},
        attrs=variant.attributes(),
    )
    start = time.time()
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    if variant.maxnreg is not None:
        options["maxnreg"] = variant.maxnreg
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    seconds = time.time() - start
    mma = "wgmma" if "wgmma" in compiled.asm["ptx"] else "mma" if "mma.sync" in compiled.asm["ptx"] else "no-mma"
    return f"{seconds:5.1f}s {mma:6} smem={compiled.metadata.shared:6d} {_ptxas_report(compiled, arch)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    for variant in VARIANTS:
        print(f"{variant.name:24s} {compile_variant(variant, args.arch, 'bf16')}", flush=True)


if __name__ == "__main__":
    main()
