"""What a fuzz run found: counts, failures with their reproduction, coverage, and the report files."""

from __future__ import annotations

import json
import platform
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from flash_dma.backends.triton.dispatch import TOPK_PACKED, topk_plan
from tests.fuzz.check import Outcome
from tests.fuzz.configs import INDICES, INTERVALS, Trial

MARKDOWN_FAILURES = 50  # failures listed in the Markdown report (the JSON has them all)
_RESULT_COLUMNS = ("trials", "ok", "mismatches", "crashes", "stopped", "seconds", "trials_per_second")


def repro_command(trial: Trial) -> str:
    """One line that runs ``trial`` again, alone and verbosely."""
    return f"python -m tests.fuzz.run --config '{trial.to_json()}'"


def topk_packed_passes(trial: Trial) -> int:
    """Passes of a top-k trial that the Triton backend runs as the packed mask (0 to 2). Its lists may
    repeat keys (no unique_indices), so the mask needs a bias plane, per query head for a bias per
    query head with GQA."""
    bias_heads = trial.bias.split(",")[2 if trial.bias.count(",") == 3 else 1] if trial.bias else "1"
    plane_heads = trial.heads if bias_heads == "H" and trial.heads != trial.kv_heads else trial.kv_heads
    window = (trial.window[0], 0) if trial.causal else trial.window
    plan = topk_plan(trial.batch, trial.seqlen_q, trial.seqlen_k, trial.heads, trial.kv_heads, trial.head_dim, trial.width,
                     window, plane_heads, trial.deterministic, needs_grad=True)
    return sum(walk == TOPK_PACKED for walk in plan)


def features(trial: Trial, outcome: Outcome) -> list[str]:
    """The properties of a trial that the coverage table counts."""
    tags = [trial.dtype, f"D={trial.head_dim}", f"H/Hkv={trial.heads // trial.kv_heads}", f"walk={trial.walk}"]
    tags.append(f"mask[{trial.mask}] {trial.mask_dtype}" if trial.mask else "no mask")
    if trial.walk == INDICES:
        tags.append("top-k run as the packed mask" if topk_packed_passes(trial) else "top-k index kernels")
    if trial.walk == INTERVALS:
        tags.append(f"key intervals of a {'causal top-k' if trial.intervals['kind'] == 'topk' else 'random runs'}")
    tags.append(f"bias[{trial.bias}]" + (" fp32" if trial.bias_fp32 else "") if trial.bias else "no bias")
    if trial.mask:
        tags.append(f"mask pattern {trial.mask_pattern}")
    left, right = trial.window
    conditions = {
        "MQA (Hkv=1, H>1)": trial.kv_heads == 1 < trial.heads,
        "Sq=1": trial.seqlen_q == 1,
        "Sk=1": trial.seqlen_k == 1,
        "Sq>Sk": trial.seqlen_q > trial.seqlen_k,
        "Sq<Sk": trial.seqlen_q < trial.seqlen_k,
        "Sk%16!=0": trial.seqlen_k % 16 != 0,
        "Sk>512 (split-KV)": trial.seqlen_k > 512,
        "causal": trial.causal,
        "window left only": left >= 0 and (right < 0 and not trial.causal),
        "window right only": right >= 0 and left < 0,
        "window both sides": left >= 0 and (right >= 0 or trial.causal),
        "window wider than Sk": max(left, right) > trial.seqlen_k,
        "softcap": trial.softcap > 0,
        "softmax_scale given": trial.softmax_scale is not None,
        "-inf in bias": trial.bias is not None and trial.bias_neg_inf > 0,
        "deterministic": trial.deterministic,
        "padded layout": trial.padded,
        "bias gradient only": not trial.grad_qkv,
        "dK/dV query chunks forced": trial.query_chunks > 1 and not trial.counted,
        "dK/dV query chunks counted by the kernel": trial.query_chunks > 1 and trial.counted,
        "top-k backward over unions forced": trial.union_share == 1.0,
        "top-k per query block": bool(trial.topk and trial.topk["per_query"]),
        "rows with no visible key": outcome.empty_rows,
        "backward twice (bitwise)": trial.repeat_backward,
        "inputs checked unchanged": trial.check_inputs,
    }
    return tags + [name for name, hit in conditions.items() if hit]


def versions(device: torch.device) -> dict:
    """Versions of what ran, and the GPU (or the interpreter)."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }


@dataclass
class Report:
    """Accumulates trial outcomes; ``to_dict`` gives the JSON report."""

    command: str
    options: dict
    versions: dict
    counts: Counter = field(default_factory=Counter)
    failures: list[dict] = field(default_factory=list)
    families: dict = field(default_factory=dict)  # family index -> {"trials": n, "failures": n}
    coverage: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)  # failures by what went wrong
    trial_seconds: float = 0.0
    stopped: str = "done"
    fatal: str | None = None

    def add(self, trial: Trial, outcome: Outcome) -> dict | None:
        """Record one trial; returns its failure record, if it failed."""
        self.counts[outcome.status] += 1
        self.trial_seconds += outcome.seconds
        family = self.families.setdefault(trial.family, {"trials": 0, "failures": 0})
        family["trials"] += 1
        self.coverage.update(features(trial, outcome))
        if outcome.status == "ok":
            return None
        family["failures"] += 1
        # A crash's kind is its exception and stage; a mismatch's, each result found wrong.
        problems = outcome.problems[:1] if outcome.status == "crash" else outcome.problems
        self.kinds.update({f"{outcome.status}: {p.split(':')[0]}" for p in problems})
        failure = {
            "index": trial.index, "family": trial.family, "status": outcome.status, "stage": outcome.stage,
            "problems": outcome.problems, "description": str(trial), "trial": json.loads(trial.to_json()),
            "repro": repro_command(trial),
        }
        self.failures.append(failure)
        return failure

    @property
    def trials(self) -> int:
        return sum(self.counts.values())

    def to_dict(self, seconds: float, compiles: dict) -> dict:
        return {
            "command": self.command,
            "options": self.options,
            "versions": self.versions,
            "result": {
                "trials": self.trials,
                "ok": self.counts["ok"],
                "mismatches": self.counts["mismatch"],
                "crashes": self.counts["crash"],
                "stopped": self.stopped,
                "fatal": self.fatal,
                "seconds": round(seconds, 1),
                "seconds_in_trials": round(self.trial_seconds, 1),
                "trials_per_second": round(self.trials / seconds, 2) if seconds else None,
            },
            "compile": compiles,
            "failure_kinds": dict(self.kinds.most_common()),
            "families": {str(k): v for k, v in sorted(self.families.items())},
            "coverage": dict(sorted(self.coverage.items())),
            "failures": self.failures,
        }


def summary(report: dict) -> str:
    """The terminal summary: a few lines."""
    r, c, v = report["result"], report["compile"], report["versions"]
    lines = [
        f"fuzz: {r['trials']} trials, {r['mismatches']} mismatches, {r['crashes']} crashes in {r['seconds']} s "
        f"({r['trials_per_second']} trials/s), stopped: {r['stopped']}",
        f"compiled: {c['kernels']} kernels in {c['seconds']} s, {c['from_disk_cache']} loaded from Triton's disk cache",
        f"on {v['device']}: torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, python {v['python']}, "
        f"commit {v['commit']}",
    ]
    lines += [f"  {n:6d} x {kind}" for kind, n in report["failure_kinds"].items()]
    if r["fatal"]:
        lines.append(f"FATAL: {r['fatal']}")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    r, c = report["result"], report["compile"]
    lines = [
        "# flash-dma fuzz report",
        "",
        f"`{report['command']}`",
        "",
        "| trials | ok | mismatches | crashes | stopped | seconds | trials/s |",
        "|---|---|---|---|---|---|---|",
        "| " + " | ".join(str(r[k]) for k in _RESULT_COLUMNS) + " |",
        "",
    ]
    if r["fatal"]:
        lines += [f"**Fatal:** {r['fatal']}", ""]
    lines += ["## Versions", ""] + [f"- {k}: {v}" for k, v in report["versions"].items()]
    lines += ["", "## Options", ""] + [f"- {k}: {v}" for k, v in report["options"].items()]
    lines += [
        "", "## Compilation", "",
        f"{c['kernels']} kernels compiled in {c['seconds']} s; {c['from_disk_cache']} loaded from Triton's disk cache.", "",
    ]
    lines += [f"- {name}: {n}" for name, n in c["per_kernel"].items()]
    failures = report["failures"]
    lines += ["", f"## Failures ({len(failures)})", ""]
    lines += [f"- {n} x {kind}" for kind, n in report["failure_kinds"].items()] + [""]
    for f in failures[:MARKDOWN_FAILURES]:
        stage = f" in {f['stage']}" if f["stage"] else ""
        lines += [f"### #{f['index']} {f['status']}{stage}", "", f"`{f['description']}`", ""]
        lines += ["```", *f["problems"], "```", "", f"`{f['repro']}`", ""]
    if len(failures) > MARKDOWN_FAILURES:
        lines += [f"({len(failures) - MARKDOWN_FAILURES} more in report.json)", ""]
    lines += ["## Families", "", "| # | family | trials | failures |", "|---|---|---|---|"]
    lines += [f"| {k} | {v.get('family', '')} | {v['trials']} | {v['failures']} |" for k, v in report["families"].items()]
    lines += ["", "## Coverage (trials with each property)", "", "| property | trials |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in report["coverage"].items()]
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "report.md").write_text(markdown(report))
