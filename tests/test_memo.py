"""Memos of the host path: tensors derived from an input, once per version of it."""

import gc

import torch

from flash_dma.memo import DerivedTensors


def test_derived_tensors_are_made_once_per_version_and_go_with_their_source():
    memo, made = DerivedTensors(), []

    def make():
        made.append(1)
        return source.sum()

    source = torch.ones(4)
    assert memo.get(source, "sum", make) == 4 and memo.get(source, "sum", make) == 4
    assert len(made) == 1
    source.mul_(2)  # changed in place: its version moves
    assert memo.get(source, "sum", make) == 8 and len(made) == 2
    memo.get(source, "other", make)  # another key of the same version
    assert len(made) == 3 and len(memo) == 1
    del source
    gc.collect()
    assert len(memo) == 0


def test_inference_tensors_are_never_memoised():
    memo, made = DerivedTensors(), []
    with torch.inference_mode():
        source = torch.ones(3)
    for _ in range(2):
        memo.get(source, "sum", lambda: made.append(1))
    assert len(made) == 2 and len(memo) == 0
