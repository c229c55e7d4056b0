"""The ring schedule of context-parallel attention: N steps, forward and backward.

At step t, rank r attends the keys of rank ``r - t`` and sends its own to rank ``r + t``
(mod N; step 0 is its own shard). Keys go straight from their owner, not rank to rank, so a
transfer that no pair needs is simply not made. The next step's transfers are posted before the
current step computes, so they overlap it.

- Forward: every call returns ``(out, lse)`` for some rows; each is merged by log-sum-exp into
  the rows' running result as it comes, in one pass (the backend's ``merge_partial``).
- Backward: the keys travel again; each call's dQ adds to the rank's own, and its dK, dV and
  per-key dbias (float32) go back to the keys' owner, which adds them to its gradients.

A :class:`Ring` is built once per plan (``attention.py``) and serves every call made with it:
:meth:`Ring.prepare` computes the steps, the index tensors and the merge runs up front, so that
a call only reads them and launches work, with no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from flash_dma.distributed.exchange import Transfers
from flash_dma.distributed.layout import Chunk
from flash_dma.distributed.plan import Band, Call, Run, Step, output_runs, plan_step, uncovered_rows
from flash_dma.inputs import AttentionProblem

# How a mask or bias is sharded (see attention.py): its key axis is 1, this rank's keys (it
# travels with them), or the whole sequence (it stays with its query rows).
KEY_AXIS_NONE, KEY_AXIS_SHARD, KEY_AXIS_GLOBAL = "none", "keys", "all"
# Two results merged in float32 registers and rounded once are exactly what a float32 accumulator
# gives once rounded at the end; rows that more calls cover keep a float32 running result.
EXACT_MERGES = 2


def _running_in_float32(run: Run, dtype: torch.dtype) -> bool:
    return run.count > EXACT_MERGES and dtype != torch.float32


@dataclass(frozen=True)
class Ring:
    """The schedule of context-parallel attention calls, agreed by every rank of the group."""

    group: object
    rank: int
    world: int
    backend: object  # a backend module with partial_forward(), partial_backward() and merge_partial()
    chunks: list[list[Chunk]]  # per rank
    kept: list[list[list[bool] | None]]  # per rank, per chunk: plan.kept_blocks of its per-key mask
    band: Band
    mask_axis: str
    bias_axis: str
    softmax_scale: float
    softcap: float
    deterministic: bool
    _steps: dict = field(default_factory=dict, compare=False, repr=False)
    _indices: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- the plan -------------------------------------------------------------------------

    def prepare(self, device: torch.device) -> None:
        """Compute every step, index tensor and merge run that this rank's calls read."""
        for t in range(self.world):
            self.step(self.rank, self._source(t))
            sent = self.step(self._target(t), self.rank)
            if sent.calls:
                self._index(sent, device)
        self._call_runs, self._uncovered  # cached properties: computed now rather than on the first call

    def _own_steps(self) -> list[Step]:
        """This rank's steps in the order it runs them."""
        return [self.step(self.rank, self._source(t)) for t in range(self.world)]

    @cached_property
    def _call_runs(self) -> list[list[tuple[Run, ...]]]:
        """Per step, per call: the runs of its rows (:func:`output_runs`)."""
        steps = self._own_steps()
        runs = iter(output_runs([call.rows for step in steps for call in step.calls]))
        return [[next(runs) for _ in step.calls] for step in steps]

    @cached_property
    def _uncovered(self) -> list[tuple[int, int]]:
        """The rows of this rank that no call covers."""
        rows = [call.rows for step in self._own_steps() for call in step.calls]
        return uncovered_rows(rows, sum(c.length for c in self.chunks[self.rank]))

    def step(self, receiver: int, source: int) -> Step:
        """What ``receiver`` attends of ``source``'s keys (every rank plans it alike)."""
        if (receiver, source) not in self._steps:
            self._steps[receiver, source] = plan_step(
                self.chunks[receiver], self.chunks[source], self.band, self.kept[source],
                same_rank=receiver == source, compact=True,
            )
        return self._steps[receiver, source]

    def _source(self, t: int) -> int:
        return (self.rank - t) % self.world

    def _target(self, t: int) -> int:
        return (self.rank + t) % self.world

    def _index(self, step: Step, device) -> torch.Tensor | None:
        """The shard rows of a step's buffer, or None when they are one run (a slice serves)."""
        if len(step.segments) == 1:
            return None
        if step not in self._indices:
            self._indices[step] = step.shard_index().to(device)
        return self._indices[step]

    def _take(self, t: torch.Tensor, step: Step, dim: int) -> torch.Tensor:
        index = self._index(step, t.device)
        return t.narrow(dim, step.segments[0].offset, step.length) if index is None else t.index_select(dim, index)

    def _put(self, total: torch.Tensor, part: torch.Tensor, step: Step, dim: int) -> None:
        index = self._index(step, total.device)
        if index is None:
            total.narrow(dim, step.segments[0].offset, step.length).add_(part)
        else:
            total.index_add_(dim, index, part)

    # ---- keys on the move -----------------------------------------------------------------

    def _post_keys(self, t: int, k, v, mask, bias) -> Transfers:
        """Step t's keys: ours to ``_target(t)``, ``_source(t)``'s to us."""
        sends, receives = [], []
        target, source = self._target(t), self._source(t)
        out_step, in_step = self.step(target, self.rank), self.step(self.rank, source)
        travelling = [(k, 1), (v, 1)]
        travelling += [(t_, 3) for t_, axis in ((mask, self.mask_axis), (bias, self.bias_axis)) if axis == KEY_AXIS_SHARD]
        if out_step.calls:
            sends = [(self._take(x, out_step, dim), target) for x, dim in travelling]
        if in_step.calls:
            for x, dim in travelling:
                shape = list(x.shape)
                shape[dim] = in_step.length
                receives.append((x.new_empty(shape), source))
        return Transfers(self.group, sends, receives)

    def _keys(self, t: int, pending: Transfers | None, k, v, mask, bias) -> tuple:
        """``(k, v, mask, bias)`` of step t's buffer, mask and bias only where they travel; None
        when the step attends nothing."""
        if t == 0:
            return k, v, mask, bias
        received = iter(pending.wait())
        if not pending.received:
            return None
        k, v = next(received), next(received)
        mask = next(received) if self.mask_axis == KEY_AXIS_SHARD else None
        bias = next(received) if self.bias_axis == KEY_AXIS_SHARD else None
        return k, v, mask, bias

    # ---- one call -------------------------------------------------------------------------

    @staticmethod
    def _piece(local, travelled, axis: str, call: Call, step: Step):
        """The mask or bias of a call: ``[., ., rows or 1, keys or 1]``."""
        if local is None:
            return None
        first, last = call.keys
        if axis == KEY_AXIS_SHARD:
            return travelled[..., first:last]
        rows = local[:, :, call.rows[0] : call.rows[1]] if local.shape[2] > 1 else local
        if axis == KEY_AXIS_GLOBAL:
            runs = step.key_runs(first, last)
            pieces = [rows.narrow(3, start, length) for start, length in runs]
            rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=3)
        return rows

    def _problem(self, call: Call, step: Step, q, keys, mask, bias) -> AttentionProblem:
        k, v, travelled_mask, travelled_bias = keys
        first, last = call.keys
        return AttentionProblem(
            query=q[:, call.rows[0] : call.rows[1]],
            key=k[:, first:last],
            value=v[:, first:last],
            attn_mask=self._piece(mask, travelled_mask, self.mask_axis, call, step),
            attn_bias=self._piece(bias, travelled_bias, self.bias_axis, call, step),
            block_mask=None,
            softmax_scale=self.softmax_scale,
            window=call.window,
            softcap=self.softcap,
            deterministic=self.deterministic,
        )

    # ---- forward and backward ---------------------------------------------------------------

    def forward(self, q, k, v, mask, bias) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, S, H, D] in q's dtype, lse [B, H, S] float32)`` of this rank's queries.

        Each call's result is folded into its rows' running result as it comes (one pass): the
        rows' first result is copied in, later ones merged, the last one into ``out``. A first
        call that covers every row is taken as the running result itself, without a copy.
        """
        out = lse = wide = None  # wide: the float32 running result of rows that many calls cover
        pending = None
        for t in range(self.world):
            keys = self._keys(t, pending, k, v, mask, bias)
            if t + 1 < self.world:
                pending = self._post_keys(t + 1, k, v, mask, bias)
            step = self.step(self.rank, self._source(t))
            for call, call_runs in zip(step.calls, self._call_runs[t]):
                part_out, part_lse = self.backend.partial_forward(self._problem(call, step, q, keys, mask, bias))
                if out is None:
                    out, lse = (part_out, part_lse) if call.rows == (0, q.shape[1]) else self._blank(q)
                for run in call_runs:
                    if _running_in_float32(run, q.dtype) and wide is None:
                        wide = torch.empty(q.shape, dtype=torch.float32, device=q.device)
                    self._fold(run, call.rows[0], part_out, part_lse, out, lse, wide)
        return self._blank(q) if out is None else (out, lse)

    def _blank(self, q) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` to fold results into: rows that no call covers see no key (0, -inf)."""
        batch, seqlen, num_heads, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(batch, num_heads, seqlen, dtype=torch.float32, device=q.device)
        for a, b in self._uncovered:
            out[:, a:b].zero_()
            lse[:, :, a:b].fill_(float("-inf"))
        return out, lse

    def _fold(self, run: Run, first_row: int, part_out, part_lse, out, lse, wide) -> None:
        """Fold the run's rows of one call's result (whose rows start at ``first_row``) into the running result."""
        (a, b), own = run.rows, slice(run.rows[0] - first_row, run.rows[1] - first_row)
        running = wide if _running_in_float32(run, out.dtype) else out
        if run.first:
            if running is not part_out:  # else the call's result is the running result already
                running[:, a:b].copy_(part_out[:, own])
            if lse is not part_lse:
                lse[:, :, a:b].copy_(part_lse[:, :, own])
            return
        dest = out if run.last else running
        self.backend.merge_partial(running[:, a:b], lse[:, :, a:b], part_out[:, own], part_lse[:, :, own], dest[:, a:b])

    def backward(self, dout, q, k, v, mask, bias, out, lse, bias_grad: bool):
        """``(dq, dk, dv, dbias or None)`` of this rank's shard (every rank must call it, all with
        the same ``bias_grad``: whether the bias's gradient is wanted)."""
        dq = dk = dv = None  # float32 sums, made by the first call's gradients (_added)
        dbias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias_grad else None
        pending_keys = None
        pending_grads = None
        travels = bias_grad and self.bias_axis == KEY_AXIS_SHARD  # dbias goes back with dK and dV
        # A bias without a key axis shifts whole rows, which the softmax ignores: its gradient is 0.
        key_bias_grad = bias_grad and self.bias_axis != KEY_AXIS_NONE
        for t in range(self.world):
            keys = self._keys(t, pending_keys, k, v, mask, bias)
            if t + 1 < self.world:
                pending_keys = self._post_keys(t + 1, k, v, mask, bias)
            step = self.step(self.rank, self._source(t))
            # Step 0's buffer is the shard itself: its key gradients go straight to ours.
            gk = gv = None
            gb = dbias if t == 0 else None
            if t > 0 and travels and keys is not None:
                gb = torch.zeros(keys[3].shape, dtype=torch.float32, device=k.device)
            for call in step.calls:
                a, b = call.rows
                cdq, cdk, cdv, cdb = self.backend.partial_backward(
                    self._problem(call, step, q, keys, mask, bias), dout[:, a:b], out[:, a:b], lse[:, :, a:b], key_bias_grad
                )
                dq = _added(dq, cdq, call.rows, q.shape)
                gk = _added(gk, cdk, call.keys, keys[0].shape)
                gv = _added(gv, cdv, call.keys, keys[0].shape)
                if cdb is not None:
                    self._add_bias_grad(dbias, gb, cdb, call, step)
            if t == 0:
                dk, dv = (_zeros_if_none(g, k.shape, k.device) for g in (gk, gv))
                continue
            if pending_grads is not None:
                self._collect(pending_grads, dk, dv, dbias)
            pending_grads = self._post_grads(t, [gk, gv, gb][: 3 if travels else 2], [dk, dv, dbias][: 3 if travels else 2])
        if pending_grads is not None:
            self._collect(pending_grads, dk, dv, dbias)
        cast = None if dbias is None else dbias.to(bias.dtype)
        return _zeros_if_none(dq, q.shape, q.device).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), cast

    def _add_bias_grad(self, dbias, travelled, part, call: Call, step: Step) -> None:
        first, last = call.keys
        if self.bias_axis == KEY_AXIS_SHARD:
            travelled[..., first:last] += part
            return
        rows = dbias[:, :, call.rows[0] : call.rows[1]] if dbias.shape[2] > 1 else dbias
        at = 0
        for start, length in step.key_runs(first, last):
            rows[..., start : start + length] += part[..., at : at + length]
            at += length

    def _post_grads(self, t: int, grads: list, owned: list) -> tuple[Transfers, Step]:
        """Step t's key gradients (float32): ``grads`` of ``_source(t)``'s keys back to it (None when
        the step attended nothing), and ``_target(t)``'s for our keys, shaped like ``owned``
        (``dk``, ``dv`` and a travelling ``dbias``)."""
        source, target = self._source(t), self._target(t)
        in_step, out_step = self.step(self.rank, source), self.step(target, self.rank)
        sends = [(g, source) for g in grads] if in_step.calls else []
        receives = []
        if out_step.calls:
            for like, dim in zip(owned, (1, 1, 3)):
                shape = list(like.shape)
                shape[dim] = out_step.length
                receives.append((like.new_empty(shape), target))
        return Transfers(self.group, sends, receives), out_step

    def _collect(self, pending: tuple[Transfers, Step], dk, dv, dbias) -> None:
        transfers, step = pending
        received = transfers.wait()
        if not received:
            return
        self._put(dk, received[0], step, 1)
        self._put(dv, received[1], step, 1)
        if len(received) > 2:
            self._put(dbias, received[2], step, 3)


def _added(total: torch.Tensor | None, part: torch.Tensor, span: tuple[int, int], shape) -> torch.Tensor:
    """``total`` (float32 ``shape``, or None before its first part) with ``part`` added at rows
    ``span`` of dimension 1. A first part that spans every row becomes the total: no zeros, no addition."""
    if total is None:
        if span == (0, shape[1]):
            return part.float()
        total = torch.zeros(shape, dtype=torch.float32, device=part.device)
    total[:, span[0] : span[1]] += part
    return total


def _zeros_if_none(total: torch.Tensor | None, shape, device) -> torch.Tensor:
    """A sum that no call added to is zeros."""
    return torch.zeros(shape, dtype=torch.float32, device=device) if total is None else total
