"""Compile the kernels for a GPU target on any machine (no GPU needed) and report their resources.

Catches Triton front-end errors before a device run, and shows what the compiler made of each
variant: whether wgmma is used, shared memory, registers and spills (from ptxas).

    python tools/compile_report.py            # sm90, a representative set of variants
    python tools/compile_report.py --arch 80
    python tools/compile_report.py --only hopper --ptx-dir /tmp/before   # keep each variant's PTX
    python tools/compile_report.py --shard 2/4   # every 4th variant from the 2nd: 4 processes share the list
    python tools/compile_report.py --kernels first    # the first variant of each kernel (one case a family)
    python tools/compile_report.py --no-registers     # compile only: no second ptxas run for the counts
    python tools/compile_report.py --no-ptxas         # to PTX only: the front end and LLVM, no ptxas at all

Each variant is also checked for a hand-over of shared memory that the PTX memory model leaves
unordered (:func:`unordered_handovers`); the command exits 1 if one has any.

``--same-as DIR`` says, per variant, whether its PTX holds the same instructions as the one in
DIR (registers renumbered, parameters renamed, the order and debug lines ignored): a refactor
that should change nothing for the forms a GPU verified can be checked so without a GPU.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
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


def stop_at_ptx() -> None:
    """Make this process's compilations end at PTX: Triton's stage hook gives each an empty binary
    in place of ptxas's (about a third of a compilation's time). Their cache is a temporary folder
    of this process, so that no GPU process ever loads those binaries."""
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="compile-report-ptx-")

    def without_ptxas(*args):
        if not args:  # asked for its cache key (newer Triton releases)
            return "compile-report-no-ptxas", "no-ptxas"
        stages = args[1]
        stages["cubin"] = lambda src, metadata: b""

    triton.knobs.runtime.add_stages_inspection_hook = without_ptxas


def compile_kernel(kernel, signature: dict, constexprs: dict, options: dict, arch: int = 90, attrs: dict | None = None):
    """``kernel`` (Triton or Gluon) compiled for ``arch`` with no GPU: ``signature`` maps every
    parameter to its type, ``constexprs`` the constexpr ones (by name) to their values."""
    source = (GluonASTSource if kernel.is_gluon() else ASTSource)(
        kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs,
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_variant(variant: Variant, arch: int, dtype: str):
    """``(compiled, seconds)``: ``variant`` compiled for ``arch`` with inputs of ``dtype``."""
    start = time.time()
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    if variant.maxnreg is not None:
        options["maxnreg"] = variant.maxnreg
    compiled = compile_kernel(variant.kernel, variant.signature(dtype), variant.constexprs, options, arch, variant.attributes())
    return compiled, time.time() - start


def report(compiled, seconds: float, arch: int, registers: bool = True) -> str:
    """A compiled variant's line: compile time, whether it uses the tensor cores, shared memory, and
    ptxas's counts of registers and spills (a second ptxas run, unless ``registers`` is False)."""
    mma = "wgmma" if "wgmma" in compiled.asm["ptx"] else "mma" if "mma.sync" in compiled.asm["ptx"] else "no-mma"
    counts = _ptxas_report(compiled, arch) if registers else "regs=- spill_stores=-"
    return f"{seconds:5.1f}s {mma:6} smem={compiled.metadata.shared:6d} {counts}"


_SKIPPED = ("//", ".loc", ".file", "$L__", ".b8", ".b16", ".b32", ".b64", ".param", "{", "}")


def instructions(ptx: str) -> Counter:
    """The instructions of a kernel's PTX as a multiset: registers renumbered and parameters renamed
    away, labels, declarations and debug sections left out."""
    body = ptx.split(".section")[0]
    lines = (line.strip() for line in body.splitlines())
    return Counter(
        re.sub(r"_param_\d+", "_param", re.sub(r"%([a-z]+)\d+", r"%\1", line))
        for line in lines if line and not line.startswith(_SKIPPED)
    )


def unordered_handovers(ptx: str) -> int:
    """How many ``mbarrier.arrive.expect_tx`` of ``ptx`` follow stores to shared memory with no barrier
    of the threads between (``bar.warp.sync``, ``bar.sync``, ``barrier.sync``), in the order of the
    text. Triton lowers ``mbarrier.expect`` to one lane's arrive, which releases only that lane's
    stores: the others' reach the waiting threads unordered (docs/reliability.md, "Racecheck and
    the mbarrier hand-over"). A store in a branch that the text places before an arrive it never
    reaches counts too: the check errs on the side of a barrier."""
    stored, count = False, 0
    for line in ptx.splitlines():
        instruction = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        if instruction.startswith("st.shared"):
            stored = True
        elif instruction.startswith(("bar.warp.sync", "bar.sync", "barrier.sync")):
            stored = False
        elif instruction.startswith("mbarrier.arrive.expect_tx"):
            count += stored
            stored = False
    return count


def chosen_variants(kernels: str) -> list[Variant]:
    """:data:`VARIANTS` in order: all, the first variant of each kernel, or all but those."""
    if kernels == "all":
        return list(VARIANTS)
    firsts = {}
    for variant in VARIANTS:
        firsts.setdefault(variant.kernel.__name__, variant)
    first = list(firsts.values())
    return first if kernels == "first" else [v for v in VARIANTS if all(v is not f for f in first)]


def _shard(text: str) -> tuple[int, int]:
    """``I/N`` -> ``(I, N)``, ``1 <= I <= N``."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N, got {text!r}")
    return int(index), int(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("all", "first", "others"), default="all",
                        help="each kernel's first variant only, or all but those (default: every variant)")
    parser.add_argument("--shard", type=_shard, default=(1, 1), metavar="I/N",
                        help="every N-th variant from the I-th, so that N processes share the list (default: all)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--only", action="append", help="variants whose name holds this (repeatable); default: all")
    parser.add_argument("--ptx-dir", type=Path, help="write each variant's PTX to DIR/<name>.ptx")
    parser.add_argument("--same-as", type=Path, help="compare each variant's instructions with DIR/<name>.ptx")
    parser.add_argument("--no-registers", action="store_true",
                        help="leave out the registers and spills (each a second ptxas run, about a quarter of the time)")
    parser.add_argument("--no-ptxas", action="store_true",
                        help="compile to PTX only, without registers and spills (ptxas takes about a third of the time)")
    args = parser.parse_args()
    if args.no_ptxas:
        stop_at_ptx()
    if args.ptx_dir:
        args.ptx_dir.mkdir(parents=True, exist_ok=True)
    index, count = args.shard
    unordered = []
    for variant in chosen_variants(args.kernels)[index - 1 :: count]:
        if args.only and not any(part in variant.name for part in args.only):
            continue
        compiled, seconds = compile_variant(variant, args.arch, "bf16")
        line = f"{variant.name:24s} {report(compiled, seconds, args.arch, not (args.no_registers or args.no_ptxas))}"
        ptx = compiled.asm["ptx"]
        if handovers := unordered_handovers(ptx):
            line += f" UNORDERED hand-overs={handovers}"
            unordered.append(variant.name)
        if args.ptx_dir:
            (args.ptx_dir / f"{variant.name}.ptx").write_text(ptx)
        if args.same_as:
            before = args.same_as / f"{variant.name}.ptx"
            if not before.exists():
                line += " new"
            else:
                old, new = instructions(before.read_text()), instructions(ptx)
                line += " same" if old == new else f" differs: -{sum((old - new).values())} +{sum((new - old).values())} instructions"
        print(line, flush=True)
    if unordered:
        sys.exit(f"unordered hand-overs of shared memory (stores before an arrive.expect_tx, no barrier between): {unordered}")


if __name__ == "__main__":
    main()
