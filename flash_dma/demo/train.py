"""Training and evaluation of one demo model, with the curves the report plots."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from flash_dma.demo.model import RecallTransformer
from flash_dma.demo.task import RecallBatch, RecallTask
from flash_dma.masks import attended_fraction


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation: AdamW, linear warm-up then cosine decay to 0, gradient clipping at 1.

    Attributes:
        steps: optimiser steps.
        batch_size: fresh sequences per step.
        learning_rate: peak learning rate.
        warmup_steps: steps of linear warm-up.
        weight_decay: AdamW weight decay.
        eval_every: steps between evaluations (and the last step).
        eval_batch_size: sequences in the fixed evaluation batch.
        short_steps, short_seqlen: the first ``short_steps`` steps train on sequences of
            ``short_seqlen`` tokens (a length curriculum; the model has no positional encoding, so
            what it learns carries over); evaluations always use the task's length. 0 for none.
    """

    steps: int = 500
    batch_size: int = 16
    learning_rate: float = 1e-2
    warmup_steps: int = 30
    weight_decay: float = 0.01
    eval_every: int = 50
    eval_batch_size: int = 256
    short_steps: int = 0
    short_seqlen: int | None = None

    def __post_init__(self):
        if isinstance(self.short_steps, bool) or not isinstance(self.short_steps, int) or self.short_steps < 0:
            raise ValueError(f"short_steps: expected an int >= 0, got {self.short_steps!r}")
        if self.short_steps and self.short_seqlen is None:
            raise ValueError("short_seqlen: short_steps > 0 needs the length of the short sequences")


@dataclass
class Curves:
    """Evaluation results over training, one entry per evaluation."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    recall: list[float] = field(default_factory=list)
    attended: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    """One trained model: its name, curves and wall time (training and evaluations)."""

    name: str
    curves: Curves
    seconds: float

    @property
    def final(self) -> dict:
        return {"loss": self.curves.loss[-1], "recall": self.curves.recall[-1], "attended": self.curves.attended[-1]}


def learning_rate_at(step: int, config: TrainConfig) -> float:
    warmup = min(1.0, (step + 1) / config.warmup_steps)
    return config.learning_rate * warmup * 0.5 * (1.0 + math.cos(math.pi * step / config.steps))


@torch.no_grad()
def evaluate(model: RecallTransformer, batch: RecallBatch, seqlen: int) -> tuple[float, float, float]:
    """``(loss, recall accuracy, attended fraction)`` on ``batch``.

    The attended fraction is the share of causal (query, key) pairs that the layers' masks let
    through, averaged over layers (and, inside :func:`attended_fraction`, over batch and heads).
    """
    model.eval()
    logits, selections = model(batch.tokens)
    model.train()
    loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).item()
    answers = batch.answers
    recall = (logits.argmax(dim=-1)[answers] == batch.targets[answers]).float().mean().item()
    attended = sum(attended_fraction(seqlen, seqlen, **selection, is_causal=True) for selection in selections)
    return loss, recall, attended / len(selections)


def train(
    name: str,
    model: RecallTransformer,
    task: RecallTask,
    config: TrainConfig,
    seed: int,
    device: torch.device,
    show_progress: bool = True,
    position: int = 0,
) -> RunResult:
    """Train ``model`` in place on fresh batches of ``task``, evaluating on one fixed batch.

    The data depend only on ``seed``, so two models trained with the same seed see the same
    batches and are evaluated on the same sequences. With ``config.short_steps``, the first
    steps train on shorter sequences (see :class:`TrainConfig`). ``position``: the line of the
    progress bar, for models trained at once.
    """
    short_task = replace(task, seqlen=config.short_seqlen) if config.short_steps else task
    train_data = torch.Generator().manual_seed(seed)
    eval_batch = task.sample(config.eval_batch_size, torch.Generator().manual_seed(seed + 1))
    eval_batch = RecallBatch(eval_batch.tokens.to(device), eval_batch.targets.to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    curves = Curves()
    started = time.perf_counter()
    progress = tqdm(range(config.steps), desc=f"{name:>6}", disable=not show_progress, position=position)

    def record(step: int) -> None:
        loss, recall, attended = evaluate(model, eval_batch, task.seqlen)
        for values, value in ((curves.step, step), (curves.loss, loss), (curves.recall, recall), (curves.attended, attended)):
            values.append(value)
        progress.set_postfix(loss=f"{loss:.3f}", recall=f"{recall:.3f}", attended=f"{attended:.3f}")

    for step in progress:
        if step % config.eval_every == 0:
            record(step)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, config)
        batch = (short_task if step < config.short_steps else task).sample(config.batch_size, train_data)
        logits, _ = model(batch.tokens.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.to(device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    record(config.steps)
    progress.close()
    return RunResult(name=name, curves=curves, seconds=time.perf_counter() - started)
