import math
from dataclasses import replace

import pytest

from flash_dma.benchmark.plots import LINE_SPAN, broken_at_gaps, figure, panels, plot_results
from tests.benchmark.fakes import case, passing_results, row


def _window_sweep(windows=(32, 64, 128, 1024)):
    """Seed window-sweep rows at ``windows`` (a gap between 128 and 1024), forward and fwd+bwd."""
    rows = []
    for w in windows:
        sweep = replace(case("seed", "window", 32768, w / 32768), window=w)
        rows += [row(sweep, "flash-dma", mode, ms=0.1 * w ** 0.5) for mode in ("fwd", "fwdbwd")]
    return rows


def _data_lines(ax):
    """The measured lines of an axes (the ceiling's horizontal line has no markers)."""
    return [line for line in ax.get_lines() if line.get_marker() not in (None, "None", "")]


def _spans(line) -> list[tuple[float, float]]:
    """The (x, next x) pairs a drawn line joins: consecutive points, neither of them NaN."""
    xs = [float(x) for x in line.get_xdata()]
    return [(a, b) for a, b in zip(xs, xs[1:]) if not (math.isnan(a) or math.isnan(b))]


def test_plot_has_a_panel_per_headline_the_run_has(tmp_path):
    everything = passing_results()
    assert [p.title.split(":")[0] for p in panels(everything)] == [
        "llm B=1 H=16 Hkv=4 D=128, keep 1/8", "llm B=1 H=16 Hkv=4 D=128, keep 1/8", "llm S=16384",
        "seed decode (Sq=1, CUDA graphs)",
    ]
    assert plot_results(tmp_path / "results.png", everything)
    data = (tmp_path / "results.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    seed_only = [r for r in everything if r.case.suite == "seed"]
    assert [p.title for p in panels(seed_only)] == ["seed decode (Sq=1, CUDA graphs): K/V bandwidth"]
    # Nothing to plot (a host-only run): no file, and no earlier run's plot left behind.
    host_only = [r for r in everything if r.case.suite == "host"]
    assert panels(host_only) == [] and figure(host_only) is None
    assert not plot_results(tmp_path / "results.png", host_only)
    assert not (tmp_path / "results.png").exists()


@pytest.mark.parametrize(
    "kinds, count",
    [((("seed", "decode"),), 1), ((("llm", "prefill"),), 3), ((("llm", "prefill"), ("seed", "decode")), 4),
     ((("llm", "prefill"), ("seed", "decode"), ("seed", "window")), 5)],
    ids=["1-panel", "3-panels-llm-suite", "4-panels", "5-panels"],
)
def test_every_axes_of_the_figure_is_a_panel_with_data(kinds, count):
    everything = passing_results() + _window_sweep()
    results = [r for r in everything if (r.case.suite, r.case.kind) in kinds]
    drawn = figure(results)
    assert len(panels(results)) == count
    assert len(drawn.axes) == count  # no empty or hidden axes beside the panels
    for ax in drawn.axes:
        assert ax.get_visible() and _data_lines(ax)
        assert all(any(math.isfinite(x) for x in line.get_xdata()) for line in _data_lines(ax))
    # Panels of one row share it: nothing overlaps, and a shorter last row sits in the middle.
    boxes = sorted((ax.get_subplotspec().rowspan.start, ax.get_subplotspec().colspan.start,
                    ax.get_subplotspec().colspan.stop) for ax in drawn.axes)
    for (row_a, _, stop_a), (row_b, start_b, _) in zip(boxes, boxes[1:]):
        assert row_a != row_b or stop_a <= start_b
    width = drawn.axes[0].get_subplotspec().get_gridspec().ncols
    last_row = [b for b in boxes if b[0] == boxes[-1][0]]
    assert last_row[0][1] == width - last_row[-1][2]


def test_no_line_crosses_an_x_that_was_not_measured():
    # The llm rows are at 4K, 8K, 16K, 32K and 128K: nothing at 64K. The window sweep skips 256 and 512.
    drawn = figure(passing_results() + _window_sweep())
    measured = {4096, 8192, 16384, 32768, 131072}
    forward = next(line for line in _data_lines(drawn.axes[0]) if line.get_label() == "flash-dma")
    assert {x for x in forward.get_xdata() if math.isfinite(x)} == measured  # a marker at every point
    assert (32768.0, 131072.0) not in _spans(forward)
    for ax in drawn.axes:
        for line in _data_lines(ax):
            assert all(b <= a * LINE_SPAN for a, b in _spans(line)), (ax.get_title(), line.get_label())
    window = drawn.axes[-1]
    assert window.get_title().startswith("seed window sweep")
    assert [_spans(line) for line in _data_lines(window)] == [[(32.0, 64.0), (64.0, 128.0)]] * 2


def test_broken_at_gaps_puts_nan_between_points_more_than_a_doubling_apart():
    xs, ys = broken_at_gaps([1, 2, 8, 16, 64], [5.0, 6.0, 7.0, 8.0, 9.0])
    assert xs[:2] == [1, 2] and math.isnan(xs[2]) and xs[3:5] == [8, 16] and math.isnan(xs[5]) and xs[6] == 64
    assert [y for y in ys if not math.isnan(y)] == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert broken_at_gaps([4096], [1.0]) == ([4096], [1.0])
    assert broken_at_gaps([1 / 32, 1 / 16, 1 / 8], [1, 2, 3]) == ([1 / 32, 1 / 16, 1 / 8], [1, 2, 3])
