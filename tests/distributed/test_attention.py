"""Context-parallel attention against single-process ``flash_dma_func`` on the whole sequence.

On the CPU the ranks are processes joined by gloo, running the reference backend and the Triton
kernels under the interpreter in float32; on a machine with CUDA GPUs, one GPU a rank over NCCL,
the Triton kernels in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import workers
from tests.distributed.pool import Failure
from tests.helpers import ON_GPU, Case

pytestmark = pytest.mark.xdist_group("distributed")

BACKENDS = ("triton",) if ON_GPU else ("reference", "triton")
DTYPE = "bfloat16" if ON_GPU else "float32"

# Lengths that the layouts cut unevenly (53 = 4 x 13 + 1; 67 over 8 chunks), GQA and MQA, every
# sharded form of mask and bias, causal and not, windows that cross chunks, softcap.
CASES = (
    Case(batch=2, seqlen_q=53, seqlen_k=53, heads=4, kv_heads=2, mask="1,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True),
    Case(batch=1, seqlen_q=67, seqlen_k=67, heads=4, kv_heads=1, mask="1,Hkv,1,Sk", bias="1,H,1,Sk"),
    Case(batch=2, seqlen_q=53, seqlen_k=53, mask="1,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True, extra={"empty": ((0, 20),)}),
    Case(batch=1, seqlen_q=40, seqlen_k=40, mask="B,H,Sq,Sk", bias="B,Hkv,Sq,Sk", causal=True),
    Case(batch=1, seqlen_q=40, seqlen_k=40, mask="B,1,Sq,1", mask_kind="rows", bias="1,1,Sq,1"),
    Case(batch=2, seqlen_q=45, seqlen_k=45, bias="1,1,1,1", causal=True, window=(6, -1)),
    Case(batch=1, seqlen_q=61, seqlen_k=61, mask="1,Hkv,1,Sk", bias="B,Hkv,1,Sk", window=(9, 4), softcap=5.0),
    Case(batch=1, seqlen_q=4, seqlen_k=4, causal=True),  # fewer tokens than zigzag chunks: empty shards
)
# Per-key masks that empty whole kept-key blocks are sent compacted: on the GPU blocks of the
# kernels' 128 keys; on the CPU of 16 (kept_block), so that 275 tokens hold them (zigzag chunks of
# 69 keys: two empty blocks between kept ones in the second chunk, one leading the fourth).
BLOCK_CASES = (
    Case(batch=1, seqlen_q=1100, seqlen_k=1100, heads=2, kv_heads=1, head_dim=16, mask="1,Hkv,1,Sk",
         bias="1,Hkv,1,Sk", causal=True, extra={"empty": ((256, 512), (768, 1024))})
    if ON_GPU else
    Case(batch=1, seqlen_q=275, seqlen_k=275, heads=2, kv_heads=1, head_dim=16, mask="1,Hkv,1,Sk",
         bias="1,Hkv,1,Sk", causal=True, extra={"empty": ((85, 117), (200, 223)), "kept_block": 16}),
)


def _ids(case):
    return str(case) + "".join(f"-{name}{value}" for name, value in case.extra.items()).replace(" ", "")


# The ring's schedule for a world size is the same code for every backend: on the CPU, the kernels
# (under the interpreter, the slowest) run at 2 ranks and the reference at 2 and 4.
WORLD_BACKENDS = [pytest.param(w, b, id=f"{w}-{b}") for b in BACKENDS for w in (2, 4) if ON_GPU or b == "reference" or w == 2]


@pytest.mark.parametrize("layout", ("zigzag", "contiguous"))
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("world, backend", WORLD_BACKENDS)
def test_matches_single_process(pools, world, backend, case, layout):
    pools(world).run_ok(workers.matches_single_process, case, layout, backend, DTYPE)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=_ids)
@pytest.mark.parametrize("world", (2,))
def test_compacted_blocks_match(pools, world, case):
    pools(world).run_ok(workers.matches_single_process, case, "zigzag", BACKENDS[-1], DTYPE)


# Calls with a plan: every form that travels (per-key mask and bias) or stays (per-row and
# pairwise forms), windows, and per-key masks that empty whole key blocks (sent compacted, as the
# plan decided once). Host reads are counted with the reference backend on the CPU (the
# interpreter reads tensors on the host by design) and with the kernels on a GPU, where any wait
# for the GPU raises; on the CPU one case runs the kernels too, for the ring's merge kernel.
COUNTED = "triton" if ON_GPU else "reference"


def _planned(world: int, backend: str, case: Case):
    return pytest.param(world, backend, case, id=f"{world}-{backend}-{_ids(case)}")


PLANNED = (
    *(_planned(world, COUNTED, case) for world in (2, 4) for case in (CASES[0], CASES[3], CASES[6])),
    _planned(2, COUNTED, BLOCK_CASES[0]),
    *(() if ON_GPU else (_planned(2, "triton", CASES[0]),)),
)


@pytest.mark.parametrize("world, backend, case", PLANNED)
def test_plan_serves_calls_without_host_round_trips(pools, world, backend, case):
    pools(world).run_ok(workers.matches_single_process, case, "zigzag", backend, DTYPE, True)


@pytest.mark.parametrize("world", (4,))
def test_half_precision_rows_of_many_calls(pools, world):
    """Under zigzag causal attention on 4 ranks the last chunk's rows take a result from every
    step: in half precision they keep a float32 running result (ring.EXACT_MERGES)."""
    pools(world).run_ok(workers.matches_single_process, CASES[0], "zigzag", "triton", "bfloat16" if ON_GPU else "float16", True)


def test_group_of_one_is_single_process(pools):
    pools(1).run_ok(workers.matches_single_process, CASES[0], "zigzag", BACKENDS[-1], DTYPE)


def _same_error_everywhere(results, kind: str, *phrases: str) -> None:
    assert all(isinstance(r, Failure) for r in results), results
    assert {r.message for r in results} == {results[0].message}, [r.message for r in results]
    assert results[0].kind == kind and all(p in results[0].message for p in phrases), results[0].message


@pytest.mark.parametrize(
    "per_rank, kind, phrases",
    [
        pytest.param([{"length": 10}, {"length": 7}], "ValueError", ("[10, 7]", "[9, 8]"), id="shard-lengths"),
        pytest.param([{"length": 8}, {"length": 8, "dtype": "float16"}], "ValueError", ("query: dtype", "rank 1"),
                     id="dtypes"),
        pytest.param([{"length": 8}, {"length": 8, "bias": (1, 1, 3, 8)}], "ValueError", ("rank 1: attn_bias",),
                     id="one-rank-bias-shape"),
        pytest.param([{"length": 8}, {"length": 8, "causal": False}], "ValueError", ("window",), id="settings"),
    ],
)
def test_bad_input_raises_on_every_rank(pools, per_rank, kind, phrases):
    _same_error_everywhere(pools(2).run(workers.call_with, per_rank), kind, *phrases)


@pytest.mark.parametrize(
    "called, call_keywords, kind, phrases",
    [
        pytest.param({"length": 8, "causal": False}, {}, "ValueError", ("plan: (softmax_scale, window",), id="settings"),
        pytest.param({"length": 6}, {}, "ValueError", ("plan: query: the shard length", "expected 8", "got 6"),
                     id="length"),
        pytest.param({"length": 8, "dtype": "float16"}, {}, "ValueError", ("plan: query: dtype",), id="dtype"),
        pytest.param({"length": 8, "bias": (1, 1, 1, 8)}, {}, "ValueError", ("plan: attn_bias",), id="bias"),
        pytest.param({"length": 8}, {"layout": "contiguous"}, "ValueError", ("plan: (softmax_scale", "contiguous"),
                     id="layout"),
        pytest.param({"length": 8}, {"plan": "zigzag"}, "TypeError", ("plan: expected a ContextParallelPlan",),
                     id="not-a-plan"),
    ],
)
def test_call_that_differs_from_its_plan_raises(pools, called, call_keywords, kind, phrases):
    """Every rank makes the same mistake here; each finds it on its own, with no exchange."""
    _same_error_everywhere(pools(2).run(workers.call_with_plan, {"length": 8}, called, call_keywords), kind, *phrases)


@pytest.mark.parametrize(
    "layer_kwargs",
    [
        pytest.param({"window_size": 16}, id="tokens16"),
        pytest.param({"window_size": 32, "block_size": 16, "sink_blocks": 1}, id="blocks16-sink1"),
        pytest.param({"window_size": None}, id="dense"),
    ],
)
def test_layer_matches_single_process(pools, layer_kwargs):
    pools(2).run_ok(workers.layer_matches_single_process, layer_kwargs, 70, BACKENDS[-1], DTYPE)
