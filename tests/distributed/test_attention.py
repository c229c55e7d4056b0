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
# Long enough for key blocks of 128: per-key masks that empty whole blocks are sent compacted.
BLOCK_CASES = (
    Case(batch=1, seqlen_q=1100, seqlen_k=1100, heads=2, kv_heads=1, head_dim=16, mask="1,Hkv,1,Sk",
         bias="1,Hkv,1,Sk", causal=True, extra={"empty": ((256, 512), (768, 1024))}),
)


def _ids(case):
    return str(case) + "".join(f"-{name}{value}" for name, value in case.extra.items()).replace(" ", "")


@pytest.mark.parametrize("layout", ("zigzag", "contiguous"))
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", (2, 4))
def test_matches_single_process(pools, world, backend, case, layout):
    pools(world).run_ok(workers.matches_single_process, case, layout, backend, DTYPE)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=_ids)
@pytest.mark.parametrize("world", (2,))
def test_compacted_blocks_match(pools, world, case):
    pools(world).run_ok(workers.matches_single_process, case, "zigzag", BACKENDS[-1], DTYPE)


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
    "layer_kwargs",
    [
        pytest.param({"window_size": 16}, id="tokens16"),
        pytest.param({"window_size": 32, "block_size": 16, "sink_blocks": 1}, id="blocks16-sink1"),
        pytest.param({"window_size": None}, id="dense"),
    ],
)
def test_layer_matches_single_process(pools, layer_kwargs):
    pools(2).run_ok(workers.layer_matches_single_process, layer_kwargs, 70, BACKENDS[-1], DTYPE)
