"""The ring schedule of context-parallel attention: N steps, forward and backward.

At step t, rank r attends the keys of rank ``r - t`` and sends its own to rank ``r + t``
(mod N; step 0 is its own shard). Keys go straight from their owner, not rank to rank, so a
transfer that no pair needs is simply not made. The next step's transfers are posted before the
current step computes, so they overlap it.

- Forward: every call returns ``(out, lse)`` for some rows; they are merged by log-sum-exp
  into float32 accumulators.
- Backward: the keys travel again; each call's dQ adds to the rank's own, and its dK, dV and
  per-key dbias (float32) go back to the keys' owner, which adds them to its gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flash_dma.distributed.exchange import Transfers
from flash_dma.distributed.layout import Chunk
from flash_dma.distributed.plan import Band, Call, Step, plan_step
from flash_dma.inputs import AttentionProblem

# How a mask or bias is sharded (see attention.py): its key axis is 1, this rank's keys (it
# travels with them), or the whole sequence (it stays with its query rows).
KEY_AXIS_NONE, KEY_AXIS_SHARD, KEY_AXIS_GLOBAL = "none", "keys", "all"


@dataclass(frozen=True)
class Ring:
    """One context-parallel attention call, agreed by every rank of the group."""

    group: object
    rank: int
    world: int
    backend: object  # a backend module with partial_forward() and partial_backward()
    chunks: list[list[Chunk]]  # per rank
    kept: list[list[list[bool] | None]]  # per rank, per chunk: plan.kept_blocks of its per-key mask
    band: Band
    mask_axis: str
    bias_axis: str
    bias_grad: bool
    softmax_scale: float
    softcap: float
    deterministic: bool
    _steps: dict = field(default_factory=dict, compare=False, repr=False)
    _indices: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- the plan -------------------------------------------------------------------------

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
        """``(out [B, S, H, D] in q's dtype, lse [B, H, S] float32)`` of this rank's queries."""
        batch, seqlen, num_heads, head_dim = q.shape
        out = torch.zeros(batch, seqlen, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, num_heads, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
        pending = None
        for t in range(self.world):
            keys = self._keys(t, pending, k, v, mask, bias)
            if t + 1 < self.world:
                pending = self._post_keys(t + 1, k, v, mask, bias)
            step = self.step(self.rank, self._source(t))
            for call in step.calls:
                part_out, part_lse = self.backend.partial_forward(self._problem(call, step, q, keys, mask, bias))
                _merge(out, lse, call.rows, part_out, part_lse)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, mask, bias, out, lse):
        """``(dq, dk, dv, dbias or None)`` of this rank's shard (every rank must call it)."""
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        dbias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if self.bias_grad else None
        pending_keys = None
        pending_grads = None
        travels = self.bias_grad and self.bias_axis == KEY_AXIS_SHARD  # dbias goes back with dK and dV
        # A bias without a key axis shifts whole rows, which the softmax ignores: its gradient is 0.
        key_bias_grad = self.bias_grad and self.bias_axis != KEY_AXIS_NONE
        for t in range(self.world):
            keys = self._keys(t, pending_keys, k, v, mask, bias)
            if t + 1 < self.world:
                pending_keys = self._post_keys(t + 1, k, v, mask, bias)
            step = self.step(self.rank, self._source(t))
            # Step 0's buffer is the shard itself: its key gradients go straight to ours.
            gk, gv, gb = dk, dv, dbias
            if t > 0 and keys is not None:
                gk = torch.zeros(keys[0].shape, dtype=torch.float32, device=k.device)
                gv = torch.zeros_like(gk)
                gb = torch.zeros(keys[3].shape, dtype=torch.float32, device=k.device) if travels else None
            for call in step.calls:
                (a, b), (c, d) = call.rows, call.keys
                cdq, cdk, cdv, cdb = self.backend.partial_backward(
                    self._problem(call, step, q, keys, mask, bias), dout[:, a:b], out[:, a:b], lse[:, :, a:b], key_bias_grad
                )
                dq[:, a:b] += cdq
                gk[:, c:d] += cdk
                gv[:, c:d] += cdv
                if cdb is not None:
                    self._add_bias_grad(dbias, gb, cdb, call, step)
            if t > 0:
                if pending_grads is not None:
                    self._collect(pending_grads, dk, dv, dbias)
                pending_grads = self._post_grads(t, [gk, gv, gb][: 3 if travels else 2], [dk, dv, dbias][: 3 if travels else 2])
        if pending_grads is not None:
            self._collect(pending_grads, dk, dv, dbias)
        cast = None if dbias is None else dbias.to(bias.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), cast

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

    @property
    def _bias_travels(self) -> bool:
        return self.bias_grad and self.bias_axis == KEY_AXIS_SHARD

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


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: tuple[int, int], part_out, part_lse) -> None:
    """Fold one call's ``(out, lse)`` for ``rows`` into the float32 accumulators."""
    a, b = rows
    old = lse[:, :, a:b]
    new = torch.logaddexp(old, part_lse)
    shift = torch.where(torch.isinf(new), 0.0, new)  # rows with no visible key yet keep weight 0
    keep = torch.exp(old - shift).transpose(1, 2).unsqueeze(-1)  # [B, rows, H, 1]
    take = torch.exp(part_lse - shift).transpose(1, 2).unsqueeze(-1)
    out[:, a:b] = out[:, a:b] * keep + part_out.float() * take
    lse[:, :, a:b] = new
