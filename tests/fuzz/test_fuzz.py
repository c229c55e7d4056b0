"""A short fuzz run (kernels under the interpreter on the CPU), and checks that the harness itself
catches what it is meant to catch."""

import dataclasses
import json

import pytest
import torch

import flash_dma
from flash_dma import KeyIntervals
from tests.fuzz import run
from tests.fuzz.check import make_inputs, run_trial
from tests.fuzz.configs import INTERVALS, Space, Trial, family_pool, sample_trial
from tests.fuzz.report import repro_command
from tests.helpers import DEVICE, DTYPE_IDS, KERNEL_DTYPES

# Small enough for the interpreter: about 0.3 s a trial on one core.
CI_SPACE = Space(
    dtypes=(*(DTYPE_IDS[d] for d in KERNEL_DTYPES), "fp8"), head_dims=(16, 32), families=12,
    max_seqlen=40, max_seqlen_k_long=0, max_heads=4,
)
CI_TRIALS = 64


def test_fuzz_trials_match_the_reference():
    failures = []
    for index in range(CI_TRIALS):
        trial = sample_trial(CI_SPACE, 0, index)
        outcome = run_trial(trial, DEVICE)
        if outcome.status != "ok":
            failures.append(f"{outcome.status} {trial}: {outcome.problems}\n  {repro_command(trial)}")
    assert not failures, "\n".join(failures)


def test_trials_are_reproducible_and_keep_to_their_family():
    space = dataclasses.replace(CI_SPACE, extra_head_dims=(72,))
    pool = family_pool(space, 7)
    assert len(pool) == space.families + 1 and pool[0].head_dim == 72
    for index in range(200):
        trial = sample_trial(space, 7, index)
        assert trial == sample_trial(space, 7, index) == Trial.from_json(trial.to_json())
        family = pool[trial.family]
        # Everything the kernels are compiled for comes from the family.
        compiled_for = ("dtype", "head_dim", "batch", "kv_heads", "mask", "mask_dtype", "bias", "bias_fp32", "walk",
                        "block_size", "deterministic", "padded")
        assert all(getattr(trial, name) == getattr(family, name) for name in compiled_for)
        assert (trial.heads, trial.softcap > 0) == (family.kv_heads * family.group, family.softcap)
        for length, (lo, hi, aligned) in ((trial.seqlen_q, family.seqlen_q), (trial.seqlen_k, family.seqlen_k)):
            assert lo <= length <= hi and (length % 16 == 0) == aligned
    assert sample_trial(space, 7, 0) != sample_trial(space, 8, 0)
    trial = sample_trial(space, 7, 3)
    first, _, dout = make_inputs(trial, DEVICE)
    again, _, dout_again = make_inputs(trial, DEVICE)
    assert torch.equal(dout, dout_again)
    for name, t in first.items():
        other = again[name]
        if isinstance(t, KeyIntervals):  # its rows
            assert torch.equal(t.end, other.end) and (t.start is None or torch.equal(t.start, other.start)), name
            continue
        assert (t is None and other is None) or torch.equal(t, other), name


def _plain_trial(**changes) -> Trial:
    """A trial where every row sees keys, so that any wrong result shows."""
    trial = Trial(
        index=-1, family=0, data_seed=5, dtype=CI_SPACE.dtypes[0], head_dim=16, batch=2, seqlen_q=19, seqlen_k=23,
        heads=4, kv_heads=2, mask="B,Hkv,Sq,Sk", mask_dtype="bool", mask_pattern="random", mask_density=0.7,
        bias="1,H,1,Sk", bias_fp32=False, bias_scale=1.0, bias_neg_inf=0.0, walk="summary", block_size=(16, 16),
        topk=None, causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None, deterministic=True, padded=True,
        query_chunks=1, grad_qkv=True, repeat_backward=False, check_inputs=False,
    )
    return dataclasses.replace(trial, **changes)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, factor):
        ctx.factor = factor
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _NoisyGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        # Large enough to change bits in bf16 too (its unit of least precision is 2^-8 relative).
        return grad * (1 + 0.05 * torch.rand_like(grad))


def _wrong(change):
    """``flash_dma_func`` with ``change(out, lse, kwargs) -> (out, lse)`` applied to its results."""
    real = flash_dma.flash_dma_func

    def attention(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return change(out, lse, kwargs)

    return attention


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda out, lse, kw: (out * 1.05, lse), ["out: max error"]),
        (lambda out, lse, kw: (out, lse + 0.1), ["lse: max error"]),
        # An element left unwritten is NaN (new tensors are poisoned).
        (lambda out, lse, kw: (torch.cat([out[..., 1:], torch.empty_like(out[..., :1])], -1), lse), ["out: NaN in result"]),
        # The bias gradient too, although its check first clears the output's rounding.
        (lambda out, lse, kw: (_ScaleGradient.apply(out, 1.05), lse), ["query: max error", "attn_bias: max error"]),
    ],
    ids=["out", "lse", "unwritten", "gradients"],
)
def test_wrong_results_are_mismatches(monkeypatch, change, expected):
    monkeypatch.setattr(flash_dma, "flash_dma_func", _wrong(change))
    outcome = run_trial(_plain_trial(), DEVICE)
    assert outcome.status == "mismatch", outcome.problems
    for prefix in expected:
        assert any(p.startswith(prefix) for p in outcome.problems), outcome.problems


def test_rows_without_keys_must_be_exactly_zero(monkeypatch):
    def offset(out, lse, kwargs):
        return out + 1e-6, lse  # within tolerance, but not 0 where no key is visible

    monkeypatch.setattr(flash_dma, "flash_dma_func", _wrong(offset))
    outcome = run_trial(_plain_trial(mask_pattern="rows"), DEVICE)
    assert outcome.status == "mismatch" and outcome.empty_rows
    assert any(p.startswith("out (rows with no visible key)") for p in outcome.problems), outcome.problems


def test_irreproducible_gradients_and_modified_inputs_are_reported(monkeypatch):
    def noisy_and_modifying(out, lse, kwargs):
        kwargs["query"].data[0, 0, 0, 0] += 1
        return _NoisyGradient.apply(out), lse

    monkeypatch.setattr(flash_dma, "flash_dma_func", _wrong(noisy_and_modifying))
    outcome = run_trial(_plain_trial(mask_pattern="all", repeat_backward=True, check_inputs=True), DEVICE)
    assert "query gradient: a second backward gave different bits" in outcome.problems
    assert "query: input modified by the call" in outcome.problems


def test_exceptions_are_crashes(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(flash_dma, "flash_dma_func", boom)
    outcome = run_trial(_plain_trial(), DEVICE)
    assert (outcome.status, outcome.stage) == ("crash", "forward")
    assert outcome.problems[0] == "RuntimeError in forward: boom"


@pytest.mark.parametrize(
    "changes",
    [
        dict(intervals={"kind": "topk", "keep": 5, "ties": True, "start": True, "aligned": False}, mask="B,Hkv,Sq,Sk", causal=True),
        dict(intervals={"kind": "topk", "keep": 9, "ties": False, "start": True, "aligned": False}, mask="1,H,Sq,Sk", seqlen_q=30,
             seqlen_k=12),
        dict(intervals={"kind": "runs", "keep": 0, "ties": False, "start": True, "aligned": False}, mask="B,1,Sq,Sk", check_inputs=True),
        dict(intervals={"kind": "runs", "keep": 0, "ties": False, "start": False, "aligned": False}, mask="1,Hkv,Sq,Sk", causal=True,
             padded=False),
        dict(intervals={"kind": "runs", "keep": 0, "ties": False, "start": True, "aligned": True}, mask="B,Hkv,Sq,Sk", seqlen_q=300,
             seqlen_k=260),
    ],
    ids=["topk-ties-causal", "topk-Sq>Sk", "runs", "runs-from-row-0-causal", "runs-aligned"],
)
def test_key_interval_trials_match_the_reference(changes):
    """The intervals walk on every kind of contents (seed 0's CI families hold none)."""
    trial = _plain_trial(walk=INTERVALS, mask_dtype="int32", mask_pattern="random", block_size=(16, 32), **changes)
    outcome = run_trial(trial, DEVICE)
    assert outcome.status == "ok", outcome.problems


def test_command_line_writes_the_report(tmp_path, capsys):
    options = ["--dtypes", CI_SPACE.dtypes[0], "--head-dims", "16", "--max-seqlen", "24", "--families", "2"]
    assert run.main(["--trials", "3", "--out", str(tmp_path), *options]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["result"]["trials"] == 3 and report["result"]["mismatches"] == report["result"]["crashes"] == 0
    assert "# flash-dma fuzz report" in (tmp_path / "report.md").read_text()
    assert run.main(["--config", _plain_trial().to_json()]) == 0
    assert "ok in" in capsys.readouterr().out
