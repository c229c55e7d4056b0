"""The hand-over probe: a minimal Gluon kernel with the Hopper kernels' hand-over of shared memory.

The Hopper kernels' loader warp writes small shared arrays with plain stores (a tile's number, its
key scores, a Q slot's LSE and delta rows: ``hopper/common.py``, ``load_partition``) and hands
them to the two math warpgroups with an mbarrier, which one of its lanes arrives on; the math
warpgroups read them and hand the slot back the same way (each warpgroup's lanes meet first, in
Triton's lowering of a plain arrive). This kernel does only that, with the same three partitions,
over a ring of ``SLOTS`` slots, so that what compute-sanitizer's racecheck reports on the hand-over can be
told apart from what it reports on the attention kernels (docs/reliability.md, "Racecheck and the
mbarrier hand-over"):

- ``SYNCED``: the loader's lanes meet at a barrier (``common.cta_barrier``, a ``bar.warp.sync``
  for one warp, which orders memory among them) before its lane arrives, as the Hopper kernels'
  loader does (``common.expect_after_stores``);
- without it, the other lanes' stores are not ordered before the arrive by anything the PTX
  memory model names: a race, which the probe keeps as a control.

    python tools/sanitize_driver.py --case handoff-synced --case handoff-unsynced

:func:`ptx` compiles it for sm90 on any machine: ``tools/compile_report.unordered_handovers``
finds the control's unordered hand-over there and none in the synced form.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from flash_dma.backends.triton.hopper.common import LOADER_REGISTERS, MATH_REGISTERS, PLAIN, cta_barrier, get, put


@gluon.jit
def _consume(values, rows, ready, empty, Out, rounds, N: gl.constexpr, SLOTS: gl.constexpr, HALF: gl.constexpr):
    """A math warpgroup: each round, wait for its slot, read the value and the row, hand the slot
    back, and write ``value + row`` to ``Out[HALF, round]``."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offsets = gl.arange(0, N, layout)  # [N]
    for r in range(rounds):
        slot = r % SLOTS
        mbarrier.wait(ready.index(slot), (r // SLOTS) & 1)
        got = get(values.index(slot)) + rows.index(slot).load(layout)  # [N]
        mbarrier.arrive(empty.index(slot), count=1)
        gl.store(Out + (HALF * rounds + r) * N + offsets, got)


@gluon.jit
def _load(values, rows, ready, empty, rounds, N: gl.constexpr, SLOTS: gl.constexpr, SYNCED: gl.constexpr):
    """The loader (1 warp): each round, wait for a free slot, write ``round`` to its value and
    ``offsets * rounds + round`` to its row, and hand it over."""
    layout: gl.constexpr = gl.BlockedLayout([N // 32], [32], [1], [0])
    offsets = gl.arange(0, N, layout)  # [N]
    for r in range(rounds):
        slot = r % SLOTS
        mbarrier.wait(empty.index(slot), (r // SLOTS) & 1 ^ 1)
        put(values.index(slot), r)
        rows.index(slot).store(offsets * rounds + r)
        if SYNCED:
            cta_barrier()
        # As the Hopper loader hands over a slot with its copies: an arrive that also expects their
        # bytes (none here). Triton's lowering puts no barrier of the lanes before it (its plain
        # arrive has one).
        mbarrier.expect(ready.index(slot), 0)


@gluon.jit
def _consume_upper(values, rows, ready, empty, Out, rounds, N: gl.constexpr, SLOTS: gl.constexpr):
    _consume(values, rows, ready, empty, Out, rounds, N, SLOTS, 1)


@gluon.jit
def _handoff_kernel(Out, rounds, N: gl.constexpr, SLOTS: gl.constexpr, SYNCED: gl.constexpr):
    barrier: gl.constexpr = mbarrier.MBarrierLayout()
    values = gl.allocate_shared_memory(gl.int32, [SLOTS, 1], PLAIN)
    rows = gl.allocate_shared_memory(gl.int32, [SLOTS, N], PLAIN)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], barrier)
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], barrier)
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize(
        [(_consume, (values, rows, ready, empty, Out, rounds, N, SLOTS, 0)),
         (_consume_upper, (values, rows, ready, empty, Out, rounds, N, SLOTS)),
         (_load, (values, rows, ready, empty, rounds, N, SLOTS, SYNCED))],
        [4, 1], [MATH_REGISTERS, LOADER_REGISTERS],
    )


def handoff(rounds: int, synced: bool, n: int = 128, slots: int = 2) -> torch.Tensor:
    """``Out`` ``[2, rounds, n]`` int32 of the probe, a plane per math warpgroup: ``Out[h, r, i] =
    2 r + i * rounds`` when every hand-over held."""
    out = torch.empty(2, rounds, n, dtype=torch.int32, device="cuda")
    _handoff_kernel[(1,)](out, rounds, n, slots, synced, num_warps=4)
    return out


def expected(rounds: int, n: int = 128) -> torch.Tensor:
    """What :func:`handoff` gives when every hand-over held."""
    r = torch.arange(rounds, dtype=torch.int32)[:, None]
    return (2 * r + torch.arange(n, dtype=torch.int32)[None, :] * rounds).expand(2, rounds, n)


def ptx(synced: bool, n: int = 128, slots: int = 2) -> str:
    """The probe's PTX for sm90 (no GPU needed; outside the Triton interpreter)."""
    from tools.compile_report import compile_kernel

    signature = {"Out": "*i32", "rounds": "i32", "N": "constexpr", "SLOTS": "constexpr", "SYNCED": "constexpr"}
    constexprs = {"N": n, "SLOTS": slots, "SYNCED": synced}
    return compile_kernel(_handoff_kernel, signature, constexprs, {"num_warps": 4}).asm["ptx"]
