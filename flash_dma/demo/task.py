"""The synthetic long-context recall task.

A sequence of ``seqlen`` tokens holds ``num_pairs`` key-value pairs (a key token followed by its
value token) scattered at random among filler tokens, then a separator, then the keys again in a
random order: at each of these query positions the model must predict the key's value. Keys are
distinct within a sequence; values are drawn at random. Keys, values and fillers have vocabularies
of their own, so a value is told apart by its token, and which value answers a query only by the
key in front of it.

    filler .. k3 v3 .. filler .. k1 v1 .. filler .. SEP  k1 k3 ..
                                                         v1 v3      <- targets
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # targets that carry no loss (cross_entropy's default ignore_index)


@dataclass(frozen=True)
class RecallBatch:
    """``tokens`` ``[B, S]`` int64; ``targets`` ``[B, S]`` int64, IGNORE_INDEX except at query positions."""

    tokens: torch.Tensor
    targets: torch.Tensor

    @property
    def answers(self) -> torch.Tensor:
        """``[B, S]`` bool: the query positions, where the recall is scored."""
        return self.targets != IGNORE_INDEX


@dataclass(frozen=True)
class RecallTask:
    """Vocabulary: the separator (0), then ``num_fillers`` fillers, ``num_keys`` keys, ``num_values`` values.

    Attributes:
        seqlen: S, tokens per sequence.
        num_pairs: key-value pairs per sequence, each queried once.
        num_keys, num_values, num_fillers: sizes of the three vocabularies.
    """

    seqlen: int = 128
    num_pairs: int = 6
    num_keys: int = 16
    num_values: int = 16
    num_fillers: int = 16

    SEPARATOR = 0

    def __post_init__(self):
        if self.num_pairs > self.num_keys:
            raise ValueError(f"num_pairs: at most num_keys = {self.num_keys} distinct keys, got {self.num_pairs}")
        context = self.seqlen - 1 - self.num_pairs
        if 2 * self.num_pairs > context:
            raise ValueError(
                f"seqlen: {self.seqlen} tokens leave {context} for the context, too few for {self.num_pairs} pairs"
            )

    @property
    def first_key(self) -> int:
        return 1 + self.num_fillers

    @property
    def first_value(self) -> int:
        return self.first_key + self.num_keys

    @property
    def vocab_size(self) -> int:
        return self.first_value + self.num_values

    def sample(self, batch_size: int, generator: torch.Generator) -> RecallBatch:
        """``batch_size`` fresh sequences, drawn with ``generator`` (on the CPU)."""
        context = self.seqlen - 1 - self.num_pairs
        rows = torch.arange(batch_size)[:, None]
        tokens = torch.randint(1, self.first_key, (batch_size, self.seqlen), generator=generator)
        # Distinct keys per sequence: the first num_pairs of a random permutation.
        keys = torch.rand(batch_size, self.num_keys, generator=generator).argsort(dim=-1)[:, : self.num_pairs]
        keys = keys + self.first_key
        values = torch.randint(self.first_value, self.vocab_size, (batch_size, self.num_pairs), generator=generator)
        # Pairs sit in distinct, non-overlapping two-token slots of the context.
        slots = torch.rand(batch_size, context // 2, generator=generator).argsort(dim=-1)[:, : self.num_pairs]
        tokens[rows, 2 * slots] = keys
        tokens[rows, 2 * slots + 1] = values
        tokens[:, context] = self.SEPARATOR
        order = torch.rand(batch_size, self.num_pairs, generator=generator).argsort(dim=-1)
        queries = context + 1 + torch.arange(self.num_pairs)
        tokens[:, queries] = keys.gather(1, order)
        targets = torch.full_like(tokens, IGNORE_INDEX)
        targets[:, queries] = values.gather(1, order)
        return RecallBatch(tokens=tokens, targets=targets)
