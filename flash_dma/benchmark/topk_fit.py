"""The top-k cost model's constants (``dispatch.TOPK_COSTS``) fitted to a topkfit run.

    flash-dma bench --suite topkfit --out benchmarks/topkfit
    python -m flash_dma.benchmark.topk_fit benchmarks/topkfit/results.json

(or the suite's lengths in several runs, ``--lengths``, each to its own ``--out``, their
``results.json`` files named together),

prints the fitted :class:`~flash_dma.backends.triton.dispatch.TopkCosts`, to paste into
``dispatch.py``, then per case the time of each plan as its measured passes add up, the plan the
fitted model picks, its ratio to the fastest, and the ratio of the row the run's own model chose
(``flash-dma-topk``). Each constant is a time per unit of :func:`~flash_dma.backends.triton.dispatch.topk_work`:

- ``walk_forward``, ``packed_forward``, ``packed_backward``: the median over the cases of the
  index walk's forward and the handed-over mask's (``flash-dma``) forward and backward per unit;
- the index backward: per case and selection its time per entry; the growth is the slope of the
  log of the two selections' geometric mean against ``log(Sk / TOPK_COST_KEYS)``, and each
  selection's constant the mean of its values brought back to ``TOPK_COST_KEYS`` by it;
- the BitMask build (the packed rows less the handed-over mask's forward): least squares over the
  cases in its two units (entries and keys per row); the plane (``flash-dma-topk-plane`` less
  ``flash-dma-topk-packed``) per element, in each pass.

The deterministic constants are not swept: they keep their ratio to the plain ones.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from flash_dma.backends.triton import dispatch
from flash_dma.backends.triton.dispatch import TOPK_COST_KEYS, TopkCosts, TopkPlan, topk_plan_costs, topk_work

PICOSECONDS_PER_MS = 1e9
# The suite's causal band, with is_causal folded in as flash_dma_topk_func folds it.
CAUSAL = (-1, 0)
SELECTIONS = ("query-index", "query-index-overlap")


def _key(case: dict) -> tuple:
    return case["seqlen_k"], case["heads"], case["mask"]


def _times(results: list[dict]) -> dict[tuple, dict[tuple[str, str], float]]:
    """Per case (Sk, H, selection): ``{(method, mode): ms}`` of its rows that ran."""
    times: dict[tuple, dict] = {}
    for row in results:
        if row["status"] == "ok" and row["case"]["suite"] == "topkfit":
            times.setdefault(_key(row["case"]), {})[row["method"], row["mode"]] = row["ms"]
    return times


def _cases(results: list[dict]) -> dict[tuple, dict]:
    return {_key(row["case"]): row["case"] for row in results if row["case"]["suite"] == "topkfit"}


def _work(case: dict, plane: bool = False) -> dispatch.TopkWork:
    return topk_work(
        case["batch"], case["seqlen_q"], case["seqlen_k"], case["heads"], case["kv_heads"], case["head_dim"], case["window"],
        CAUSAL, case["kv_heads"] if plane else 0,
    )


def _passes(t: dict, method: str) -> tuple[float, float] | None:
    """``(forward, backward)`` ms of ``method``'s rows, or None if either is missing."""
    if (method, "fwd") not in t or (method, "fwdbwd") not in t:
        return None
    return t[method, "fwd"], t[method, "fwdbwd"] - t[method, "fwd"]


def _least_squares(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(a, b)`` >= 0 minimising the squared error of ``y = a x1 + b x2`` over ``(x1, x2, y)``."""
    s11 = sum(x1 * x1 for x1, _, _ in rows)
    s12 = sum(x1 * x2 for x1, x2, _ in rows)
    s22 = sum(x2 * x2 for _, x2, _ in rows)
    s1y = sum(x1 * y for x1, _, y in rows)
    s2y = sum(x2 * y for _, x2, y in rows)
    det = s11 * s22 - s12 * s12
    if det <= 0:
        return max(0.0, s1y / s11) if s11 else 0.0, 0.0
    a, b = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
    if a < 0:
        return 0.0, max(0.0, s2y / s22)
    if b < 0:
        return max(0.0, s1y / s11), 0.0
    return a, b


def fit(results: list[dict], current: TopkCosts = dispatch.TOPK_COSTS) -> TopkCosts:
    """The constants that fit a topkfit run's ``results`` (``results.json``'s rows); those the run
    cannot tell (too few rows) stay at ``current``'s."""
    times, cases = _times(results), _cases(results)
    llm = [k for k in times if k[1] // cases[k]["kv_heads"] < dispatch.WIDE_GROUP]
    walk_forward, packed_forward, packed_backward, bits_rows = [], [], [], []
    backward: dict[str, dict[int, float]] = {selection: {} for selection in SELECTIONS}
    for key in llm:
        t, work = times[key], _work(cases[key])
        walk, packed, built = _passes(t, "flash-dma-topk-indices"), _passes(t, "flash-dma"), t.get(("flash-dma-topk-packed", "fwd"))
        if walk is not None:
            walk_forward.append(walk[0] * PICOSECONDS_PER_MS / work.entries)
            if key[2] in backward:
                backward[key[2]][key[0]] = walk[1] * PICOSECONDS_PER_MS / work.entries
        if packed is not None:
            packed_forward.append(packed[0] * PICOSECONDS_PER_MS / work.pairs)
            packed_backward.append(packed[1] * PICOSECONDS_PER_MS / work.pairs)
            if built is not None:
                rows = work.bit_rows
                bits_rows.append((rows * work.width, rows * work.seqlen_k, (built - packed[0]) * PICOSECONDS_PER_MS))
    costs = current._replace(
        walk_forward=statistics.median(walk_forward) if walk_forward else current.walk_forward,
        packed_forward=statistics.median(packed_forward) if packed_forward else current.packed_forward,
        packed_backward=statistics.median(packed_backward) if packed_backward else current.packed_backward,
    )
    costs = costs._replace(packed_backward_deterministic=current.packed_backward_deterministic * costs.packed_backward / current.packed_backward)
    both = sorted(set(backward[SELECTIONS[0]]) & set(backward[SELECTIONS[1]]))
    if len(both) >= 2:
        xs = [math.log(length / TOPK_COST_KEYS) for length in both]
        ys = [0.5 * sum(math.log(backward[s][length]) for s in SELECTIONS) for length in both]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        growth = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)

        def at_cost_keys(selection: str) -> float:
            return math.exp(statistics.fmean(math.log(backward[selection][n]) - growth * x for n, x in zip(both, xs)))

        random, overlapping = at_cost_keys("query-index"), at_cost_keys("query-index-overlap")
        costs = costs._replace(
            walk_backward_growth=growth, walk_backward_random=random, walk_backward_overlapping=overlapping,
            walk_backward_deterministic=current.walk_backward_deterministic * random / current.walk_backward_random,
        )
    if bits_rows:
        bits_entry, bits_pair = _least_squares(bits_rows)
        costs = costs._replace(bits_entry=bits_entry, bits_pair=bits_pair)
    for key in times:
        t = times[key]
        plane, packed = _passes(t, "flash-dma-topk-plane"), _passes(t, "flash-dma-topk-packed")
        if plane is not None and packed is not None:
            elements = _work(cases[key], plane=True).plane
            costs = costs._replace(
                plane_forward=max(0.0, (plane[0] - packed[0]) * PICOSECONDS_PER_MS / elements),
                plane_backward=max(0.0, (plane[1] - packed[1]) * PICOSECONDS_PER_MS / elements),
            )
    return costs


def plan_table(results: list[dict], costs: TopkCosts) -> list[str]:
    """Per case with both walks measured and each mode: every plan's time as its measured passes add
    up, the plan ``costs`` picks, its ratio to the fastest, and the chosen row's (``flash-dma-topk``)."""
    times, cases = _times(results), _cases(results)
    lines = ["| Sk | H | selection | mode | plans (ms) | picked | picked / best | flash-dma-topk / best |", "|---|---|---|---|---|---|---|---|"]
    for key in sorted(times):
        t = times[key]
        walk, packed, built = _passes(t, "flash-dma-topk-indices"), _passes(t, "flash-dma"), t.get(("flash-dma-topk-packed", "fwd"))
        if walk is None or packed is None or built is None:
            continue
        bits = built - packed[0]
        measured = {
            ("indices", "indices"): walk[0] + walk[1], ("packed", "packed"): bits + packed[0] + packed[1],
            ("packed", "indices"): bits + packed[0] + walk[1], ("indices", "packed"): walk[0] + bits + packed[1],
        }
        for mode, needs_grad in (("fwd", False), ("fwdbwd", True)):
            plans = {TopkPlan(*p): ms for p, ms in measured.items()} if needs_grad else {
                TopkPlan("indices", "indices"): walk[0], TopkPlan("packed", "packed"): bits + packed[0]}
            predicted = topk_plan_costs(_work(cases[key]), costs, False, needs_grad)
            picked = min(predicted, key=predicted.get)
            best = min(plans.values())
            chosen = t.get(("flash-dma-topk", mode))
            text = ", ".join(f"{p.forward}/{p.backward} {ms:.1f}" for p, ms in plans.items())
            lines.append(
                f"| {key[0]} | {key[1]} | {key[2]} | {mode} | {text} | {picked.forward}/{picked.backward} | "
                f"{plans[picked] / best:.2f}x | {'' if chosen is None else f'{chosen / best:.2f}x'} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="results.json of `flash-dma bench --suite topkfit` runs")
    args = parser.parse_args(argv)
    results = [row for path in args.results for row in json.loads(path.read_text())["results"]]
    costs = fit(results)
    fields = ", ".join(f"{name}={value:.4g}" for name, value in costs._asdict().items())
    print(f"TOPK_COSTS = TopkCosts({fields})\n")
    print("\n".join(plan_table(results, costs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
