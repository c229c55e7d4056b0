"""The demo: its task, model and schedule, and a smoke run of the command as CI runs it."""

import json
import threading
from dataclasses import replace

import pytest
import torch

from flash_dma import cli
from flash_dma.demo import cli as demo_cli
from flash_dma.demo.cli import SMOKE_CONFIG, train_models, with_steps
from flash_dma.demo.model import PositiveBiasAttention, RecallTransformer
from flash_dma.demo.report import Check
from flash_dma.demo.task import IGNORE_INDEX, RecallTask
from flash_dma.demo.train import TrainConfig, learning_rate_at, train
from flash_dma.modules import DynamicMaskAttention


def test_every_query_is_answered_by_the_value_after_its_key():
    task = RecallTask(seqlen=64, num_pairs=5)
    batch = task.sample(32, torch.Generator().manual_seed(0))
    context = task.seqlen - 1 - task.num_pairs
    assert batch.tokens.shape == batch.targets.shape == (32, 64)
    assert (batch.tokens[:, context] == RecallTask.SEPARATOR).all()
    assert torch.equal(batch.answers, batch.targets != IGNORE_INDEX)
    assert (batch.answers.sum(-1) == task.num_pairs).all() and not batch.answers[:, : context + 1].any()
    for tokens, targets in zip(batch.tokens.tolist(), batch.targets.tolist()):
        pairs = {tokens[i]: tokens[i + 1] for i in range(context) if task.first_key <= tokens[i] < task.first_value}
        assert len(pairs) == task.num_pairs, "keys must be distinct and appear once in the context"
        assert all(task.first_value <= v < task.vocab_size for v in pairs.values())
        for position in range(context + 1, task.seqlen):
            assert targets[position] == pairs[tokens[position]]


def test_samples_depend_only_on_the_generator():
    task = RecallTask()
    first, second = (task.sample(4, torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.targets, second.targets)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(num_pairs=17), r"num_pairs: at most num_keys = 16"), (dict(seqlen=20, num_pairs=7), r"seqlen: 20 tokens")],
    ids=["pairs", "seqlen"],
)
def test_impossible_tasks_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecallTask(**kwargs)


def test_model_returns_logits_and_one_selection_per_layer():
    task = RecallTask(seqlen=40, num_pairs=3)
    model = RecallTransformer(task.vocab_size, 32, 2, num_heads=4, num_kv_heads=2, window_size=6, rope_base=None)
    tokens = task.sample(3, torch.Generator().manual_seed(1)).tokens
    logits, selections = model(tokens)
    assert logits.shape == (3, 40, task.vocab_size)
    assert len(selections) == 2
    assert all(s["attn_mask"].shape == (3, 2, 1, 40) and s["block_mask"] is None for s in selections)


def test_learning_rate_warms_up_then_decays_to_zero():
    config = TrainConfig(steps=100, learning_rate=1.0, warmup_steps=10)
    rates = [learning_rate_at(step, config) for step in range(101)]
    assert rates[0] == pytest.approx(0.1, rel=0.01) and max(rates) == pytest.approx(rates[9])
    assert all(a >= b for a, b in zip(rates[9:], rates[10:])) and rates[100] == pytest.approx(0.0, abs=1e-12)


def test_checks_compare_in_the_stated_direction():
    assert Check("recall", 0.95, ">=", 0.9).passed and not Check("recall", 0.85, ">=", 0.9).passed
    assert Check("attended", 0.2, "<=", 0.25).passed and Check("attended", 0.3, "<=", 0.25).line().startswith("MISS")


def test_smoke_run_writes_plot_and_summary(tmp_path, capsys):
    assert cli.main(["demo", "--smoke", "--quiet", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "recall accuracy of the sparse model" in printed and ("PASS" in printed or "MISS" in printed)
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert set(summary["runs"]) == {"sparse", "dense"}
    sparse, dense = summary["runs"]["sparse"], summary["runs"]["dense"]
    steps = summary["configuration"]["train"]["steps"]
    assert sparse["curves"]["step"] == dense["curves"]["step"] and sparse["curves"]["step"][-1] == steps
    assert 0 < sparse["final"]["attended"] < 1 and dense["final"]["attended"] == 1.0
    assert [c["name"] for c in summary["checks"]][:2] == [
        "recall accuracy of the sparse model",
        "fraction of causal (q, k) pairs it attends",
    ]
    assert (tmp_path / "demo.png").read_bytes().startswith(b"\x89PNG")


def test_per_query_smoke_run_selects_keys_per_query_at_an_eighth_of_the_pairs(tmp_path, capsys):
    assert cli.main(["demo", "--smoke", "--quiet", "--selection", "query", "--out", str(tmp_path)]) == 0
    assert "'indexer_heads': 4" in capsys.readouterr().out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["configuration"]["selection"] == {"window_size": 3, "indexer_heads": 4, "indexer_dim": 8}
    attended = summary["checks"][1]
    assert (attended["comparison"], attended["threshold"], attended["passed"]) == ("<=", 1 / 8, True)


def test_per_query_configurations_keep_an_eighth_of_the_causal_pairs():
    for config in demo_cli.CONFIGS["query"].values():
        seqlen, width = config.task.seqlen, config.selection["window_size"]
        kept = sum(min(width, i + 1) for i in range(seqlen)) / (seqlen * (seqlen + 1) / 2)
        assert kept <= config.attended_limit == 1 / 8


def test_missing_cuda_is_reported_not_raised(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cli.main(["demo", "--device", "cuda", "--smoke", "--quiet"]) == 2
    assert "--device cuda needs a CUDA device" in capsys.readouterr().err


def test_positive_bias_ranks_keys_by_dt_from_the_first_step():
    task = RecallTask(seqlen=40, num_pairs=3)
    torch.manual_seed(0)
    model = RecallTransformer(task.vocab_size, 32, 1, num_heads=4, window_size=6, rope_base=None, bias_scale=0.1)
    layer = model.attention_layers[0]
    assert isinstance(layer, PositiveBiasAttention) and torch.equal(layer.A, torch.zeros(4))
    value = torch.randn(2, 40, 4, 8)
    dt = layer.dt_proj(value.reshape(2, 40, 32)).transpose(1, 2).unsqueeze(2)
    bias = layer.key_importance(value)
    torch.testing.assert_close(bias, 0.1 * torch.nn.functional.softplus(dt))
    assert (bias > 0).all()
    # No ties at A = 0: the selection keeps the keys with the largest dt, not the earliest keys.
    kept = layer.select(bias, None)["attn_mask"]
    assert torch.equal(kept.sum(-1), torch.full((2, 4, 1), 6))
    assert torch.equal(kept, dt >= dt.topk(6, dim=-1).values[..., -1:])
    with torch.no_grad():
        layer.A.fill_(-3.0)  # the factor exp(A) stays positive, so the ranking does not flip
    assert torch.equal(layer.select(layer.key_importance(value), None)["attn_mask"], kept)


def test_the_library_bias_is_the_default():
    model = RecallTransformer(20, 32, 2, num_heads=4, window_size=6, rope_base=None)
    assert all(type(layer) is DynamicMaskAttention for layer in model.attention_layers)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(bias_scale=0.0), r"bias_scale: expected a float > 0"), (dict(bias_scale=0.1, importance="exp"), r"importance:")],
    ids=["zero", "exp"],
)
def test_bad_bias_scales_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecallTransformer(20, 32, 1, num_heads=4, window_size=6, rope_base=None, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(short_steps=-1), r"short_steps: expected an int >= 0"), (dict(short_steps=5), r"short_seqlen:")],
    ids=["negative", "no-length"],
)
def test_bad_warm_up_phases_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_the_length_curriculum_trains_short_then_long_and_evaluates_long():
    task = RecallTask(seqlen=48, num_pairs=3)
    torch.manual_seed(0)
    model = RecallTransformer(task.vocab_size, 32, 2, num_heads=4, window_size=8, rope_base=None)
    seen = []  # (training?, sequence length) per forward
    model.register_forward_pre_hook(lambda m, args: seen.append((m.training, args[0].shape[1])))
    config = TrainConfig(steps=4, batch_size=2, eval_every=10, eval_batch_size=2, short_steps=3, short_seqlen=32)
    result = train("sparse", model, task, config, seed=0, device=torch.device("cpu"), show_progress=False)
    assert [length for training, length in seen if training] == [32, 32, 32, 48]
    # Evaluations (before the first step and after the last) use the task's length.
    assert [length for training, length in seen if not training] == [48, 48]
    assert 0 < result.final["attended"] < 1


def test_fewer_steps_keep_the_share_of_short_sequences():
    config = replace(SMOKE_CONFIG, train=replace(SMOKE_CONFIG.train, steps=3000, short_steps=1000, short_seqlen=32))
    assert (with_steps(config, 300).train.steps, with_steps(config, 300).train.short_steps) == (300, 100)
    assert with_steps(SMOKE_CONFIG, 10).train == replace(SMOKE_CONFIG.train, steps=10)


def test_cpu_models_train_at_once_one_thread_each_and_the_thread_count_comes_back():
    task = RecallTask(seqlen=40, num_pairs=3)
    models = [(name, RecallTransformer(task.vocab_size, 32, 1, num_heads=4, window_size=window, rope_base=None))
              for name, window in (("sparse", 6), ("dense", None))]
    seen = {}  # model name -> (thread, torch threads) of its training forwards
    for name, model in models:
        model.register_forward_pre_hook(
            lambda m, args, name=name: seen.setdefault(name, set()).add((threading.get_ident(), torch.get_num_threads()))
            if m.training else None
        )
    threads = torch.get_num_threads()
    config = TrainConfig(steps=3, batch_size=2, eval_every=10, eval_batch_size=2)
    results = train_models(models, config, task, 0, torch.device("cpu"), show_progress=False)
    assert [r.name for r in results] == ["sparse", "dense"] and torch.get_num_threads() == threads
    (sparse,), (dense,) = seen["sparse"], seen["dense"]
    assert sparse[0] != dense[0] and threading.get_ident() not in (sparse[0], dense[0])
    assert sparse[1] == dense[1] == 1
