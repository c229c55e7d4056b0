"""The routing table: which kernel serves which form, and the table of docs/api.md."""

from pathlib import Path

import pytest

from flash_dma.backends.triton.dispatch import HOPPER, TRITON, Form, route, routing_table

API = Path(__file__).resolve().parents[3] / "docs" / "api.md"
PLAIN = Form(
    device="hopper", dtype="bf16", head_dim=128, mask="keys", bias="keys", walk="blocks", sequences="fixed", split=False,
    deterministic=False, softcap=False, aligned=True,
)


def test_docs_show_the_table_the_code_routes_by():
    assert routing_table() in API.read_text()


@pytest.mark.parametrize(
    "changes, forward, dq, dkdv",
    [
        ({}, HOPPER, HOPPER, HOPPER),
        (dict(mask="bits", bias="pairs"), HOPPER, HOPPER, HOPPER),
        (dict(mask="rows", bias="rows", walk="dense"), HOPPER, HOPPER, HOPPER),
        (dict(mask="pairs"), TRITON, TRITON, TRITON),  # a bool per pair: bits only on Hopper
        (dict(walk="keys", mask="none"), HOPPER, HOPPER, TRITON),  # a key list's columns
        (dict(deterministic=True), HOPPER, HOPPER, TRITON),  # query chunks add up by atomics
        (dict(softcap=True), TRITON, TRITON, TRITON),
        (dict(dtype="fp32"), TRITON, TRITON, TRITON),
        (dict(head_dim=96), TRITON, TRITON, TRITON),
        (dict(sequences="packed"), TRITON, TRITON, TRITON),
        (dict(split=True), TRITON, TRITON, TRITON),
        (dict(aligned=False), TRITON, TRITON, TRITON),
        (dict(device="cuda"), TRITON, TRITON, TRITON),
        (dict(device="interpreter"), TRITON, TRITON, TRITON),
    ],
    ids=str,
)
def test_routes(changes, forward, dq, dkdv):
    form = PLAIN._replace(**changes)
    assert (route("forward", form), route("dq", form), route("dkdv", form)) == (forward, dq, dkdv)
