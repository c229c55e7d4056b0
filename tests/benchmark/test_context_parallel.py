"""``flash-dma bench-cp``'s targets on made-up rows (the benchmark itself needs GPUs)."""

from flash_dma.benchmark.context_parallel import TARGETS, _efficiency, evaluate
from flash_dma.benchmark.report import checks_markdown


def _row(total: int, keep: float, single_ms: tuple[float, float], parallel_ms: tuple[float, float]) -> dict:
    """A 2-GPU row whose pairs grow 4x from S/2 to S tokens (causal): efficiency 2 t_1 / t_2."""
    row = {
        "total": total, "gpus": 2, "keep": keep,
        "single": {"fwd_s": single_ms[0] / 1e3, "fwdbwd_s": single_ms[1] / 1e3, "pairs": 1},
        "parallel": {"fwd_s": parallel_ms[0] / 1e3, "fwdbwd_s": parallel_ms[1] / 1e3, "pairs": 4},
    }
    return {**row, "efficiency": _efficiency(row, 2)}


def test_targets_pass_or_miss_on_their_rows_only():
    rows = [_row(262144, 0.125, (14.0, 60.0), (30.0, 140.0)), _row(262144, 1.0, (50.0, 200.0), (200.0, 900.0))]
    checks = evaluate(rows, 2)
    assert [c.status for c in checks] == ["PASS", "MISS"]  # 2 x 14 / 30 = 93 %; 2 x 60 / 140 = 86 %
    assert len(checks) == len(TARGETS)
    assert abs(checks[0].value - 100 * 28 / 30) < 1e-9
    table = checks_markdown(checks)
    assert "**PASS**" in table and "**MISS**" in table and ">= 90 %" in table
    assert evaluate([_row(1048576, 0.125, (1.0, 1.0), (2.0, 2.0))], 2) == []  # no target at 1M
