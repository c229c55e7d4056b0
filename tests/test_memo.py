"""Memos of the host path: tensors derived from an input, once per version of it."""

import gc

import pytest
import torch

from flash_dma import pack_mask
from flash_dma.memo import DerivedTensors, dry_running


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


def test_a_dry_run_derives_afresh_and_keeps_nothing():
    """A dry run (``launch.dry_run``) launches nothing, so what it derives is never written: it is
    neither kept nor taken from a call before it."""
    from flash_dma.backends.triton import launch

    memo, made = DerivedTensors(), []
    source = torch.ones(3)
    memo.get(source, "sum", lambda: made.append("call"))
    with launch.dry_run():
        assert dry_running()
        for key in ("sum", "other"):
            memo.get(source, key, lambda: made.append("dry run"))
    assert not dry_running() and made == ["call", "dry run", "dry run"]
    for key in ("sum", "other"):
        memo.get(source, key, lambda: made.append("call"))
    assert made == ["call", "dry run", "dry run", "call"]


def test_a_mask_object_is_no_source():
    """Only a tensor has the version counter that keys an entry: a BitMask or KeyIntervals must be
    turned into its tensors first, and one handed over is refused, by name."""
    with pytest.raises(TypeError, match="source: expected a torch.Tensor, got BitMask"):
        DerivedTensors().get(pack_mask(torch.ones(1, 1, 4, 32, dtype=torch.bool)), "bits", lambda: None)
