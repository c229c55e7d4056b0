"""The top-k cost model's fit (``benchmark/topk_fit.py``): a topkfit run made up from known
constants gives them back, and the plan table ranks the plans of its rows."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flash_dma.backends.triton.dispatch import TOPK_COST_KEYS, TopkCosts, topk_work
from flash_dma.benchmark import topk_fit
from flash_dma.benchmark.suites import build_cases

KNOWN = TopkCosts(
    walk_forward=90.0, walk_backward_overlapping=150.0, walk_backward_random=320.0, walk_backward_deterministic=1200.0,
    walk_backward_growth=0.6, packed_forward=1.1, packed_backward=3.0, packed_backward_deterministic=3.3,
    bits_entry=3.0, bits_pair=0.2, plane_forward=12.0, plane_backward=6.0,
)


def _ms(case, method: str, mode: str, costs: TopkCosts) -> float:
    """The time ``costs`` predicts for a row (ps -> ms), the index backward per the case's selection."""
    work = topk_work(case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.kv_heads, case.head_dim, case.window,
                     (-1, 0), case.kv_heads if method == "flash-dma-topk-plane" else 0)
    per_entry = costs.walk_backward_overlapping if case.mask == "query-index-overlap" else costs.walk_backward_random
    bits = work.bit_rows * (work.width * costs.bits_entry + work.seqlen_k * costs.bits_pair)
    passes = {
        "flash-dma-topk-indices": (work.entries * costs.walk_forward,
                                   work.entries * per_entry * (case.seqlen_k / TOPK_COST_KEYS) ** costs.walk_backward_growth),
        "flash-dma": (work.pairs * costs.packed_forward, work.pairs * costs.packed_backward),
    }
    passes["flash-dma-topk-packed"] = (bits + passes["flash-dma"][0], passes["flash-dma"][1])
    passes["flash-dma-topk-plane"] = (passes["flash-dma-topk-packed"][0] + work.plane * costs.plane_forward,
                                      passes["flash-dma"][1] + work.plane * costs.plane_backward)
    passes["flash-dma-topk"] = passes["flash-dma-topk-packed"]
    forward, backward = passes[method]
    return (forward + (backward if mode == "fwdbwd" else 0.0)) / topk_fit.PICOSECONDS_PER_MS


def _results(costs: TopkCosts) -> list[dict]:
    return [
        {"case": dataclasses.asdict(case), "method": method, "mode": mode, "status": "ok", "ms": _ms(case, method, mode, costs)}
        for case in build_cases("topkfit")
        for method in case.methods
        for mode in case.modes
    ]


def test_a_run_made_from_known_costs_fits_them_back():
    fitted = topk_fit.fit(_results(KNOWN), current=KNOWN._replace(walk_forward=1.0, bits_entry=0.0, plane_forward=0.0))
    for name, value in KNOWN._asdict().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name


def test_the_plan_table_ranks_each_case_s_plans():
    lines = topk_fit.plan_table(_results(KNOWN), KNOWN)
    rows = [line.split(" | ") for line in lines[2:]]
    # Every LLM length and selection and the wide group, in both modes; the plane case has no handed-over mask.
    assert len(rows) == 2 * (2 * 4 + 1)
    assert {row[3] for row in rows} == {"fwd", "fwdbwd"}
    # A forward alone costs what the model says whatever the selection: its pick is the fastest.
    assert all(row[6] == "1.00x" for row in rows if row[3] == "fwd")
    # With the backward, the picks differ by selection only where the two selections' plans do.
    assert all(float(row[6].rstrip("x")) < 1.5 for row in rows)


def test_main_fits_several_runs_together(tmp_path, capsys):
    rows = _results(KNOWN)
    short = [row for row in rows if row["case"]["seqlen_k"] < 131072]
    paths = []
    for name, part in (("short", short), ("long", [row for row in rows if row not in short])):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"results": part}))
    assert topk_fit.main([str(p) for p in paths]) == 0
    printed = capsys.readouterr().out
    # Both files' rows count: the fit is the known one, and the second file's 128K rows are tabled.
    assert f"walk_backward_growth={KNOWN.walk_backward_growth:.4g}," in printed
    assert "| 131072 | 16 | query-index-overlap | fwdbwd |" in printed
