"""The demo's outputs: target checks, a PNG of the curves and a JSON summary."""

from __future__ import annotations

import json
import operator
from dataclasses import asdict, dataclass
from pathlib import Path

from flash_dma.demo.train import RunResult


@dataclass(frozen=True)
class Check:
    """One target: ``measured <comparison> threshold``."""

    name: str
    measured: float
    comparison: str  # ">=" or "<="
    threshold: float

    @property
    def passed(self) -> bool:
        return {">=": operator.ge, "<=": operator.le}[self.comparison](self.measured, self.threshold)

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'MISS'}  {self.name}: {self.measured:.3f} {self.comparison} {self.threshold:g}"


def target_checks(sparse: RunResult, seconds: float, time_limit: float | None, attended_limit: float) -> list[Check]:
    """The issues' targets for the sparse model: recall >= 0.9 with at most ``attended_limit`` of the
    causal pairs attended (1/4 for per-key selection, 1/8 per query), and the whole demo within
    ``time_limit`` seconds (when the configuration sets one)."""
    checks = [
        Check("recall accuracy of the sparse model", sparse.final["recall"], ">=", 0.9),
        Check("fraction of causal (q, k) pairs it attends", sparse.final["attended"], "<=", attended_limit),
    ]
    if time_limit is not None:
        checks.append(Check("wall time of the demo, seconds", seconds, "<=", time_limit))
    return checks


def write_plot(results: list[RunResult], path: Path, title: str) -> None:
    """Recall accuracy and evaluation loss against training steps, one line per model."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    figure, (recall_axis, loss_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        label = f"{result.name} (attends {result.final['attended']:.0%} of causal pairs)"
        recall_axis.plot(result.curves.step, result.curves.recall, marker="o", markersize=3, label=label)
        loss_axis.plot(result.curves.step, result.curves.loss, marker="o", markersize=3, label=result.name)
    recall_axis.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    recall_axis.set(xlabel="step", ylabel="recall accuracy", ylim=(0, 1.02), title="recall")
    loss_axis.set(xlabel="step", ylabel="cross-entropy at the queries", yscale="log", title="loss")
    recall_axis.legend(loc="lower right")
    loss_axis.legend(loc="upper right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_summary(path: Path, configuration: dict, results: list[RunResult], checks: list[Check], seconds: float) -> None:
    """The configuration, each model's final numbers and curves, the checks, and the wall time, as JSON."""
    summary = {
        "configuration": configuration,
        "seconds": seconds,
        "runs": {r.name: {"final": r.final, "seconds": r.seconds, "curves": asdict(r.curves)} for r in results},
        "checks": [{**asdict(c), "passed": c.passed} for c in checks],
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")
