"""What treespec promises per dtype (docs/reliability.md, "Dtypes").

float32 (and float64, which the other tests use) decode token for token what the target's own
``generate(do_sample=False)`` does in that dtype. float16 and bfloat16 cannot promise that: a tree
forward sums the same products in another order than generate's one-token forwards, and with 11 or 8
bits of mantissa logits one step apart are ties either may win (float16 flipped one on stories260K on
an Intel Xeon with AVX-512). treespec says so when a target is in either; the tests check that any
difference starts at such a tie.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from typer.testing import CliRunner

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec.devices import InexactDtypeWarning, dtype_note
from treespec.testing import GreedyReference


def decode(dtype: str, check) -> None:
    """A 25-node opt-tree and a chain, on real stories, each output given to ``check`` with its reference."""
    target = treespec.TargetModel.load(str(STORIES260K), dtype=dtype)
    assert target.dtype == getattr(torch, dtype)
    reference = GreedyReference(target)
    for builder, options in (("opt-tree", {"nodes": 25}), ("chain", {"k": 4})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InexactDtypeWarning)
            dec = treespec.Decoder(target, drafter="ngram", builder=builder, builder_options=options)
        for prompt in tinystories_prompts(3):
            ids = dec.encode(prompt)
            check(reference, ids, dec.generate(ids, max_new_tokens=48).token_ids, reference(ids, 48))


def test_float32_trees_decode_what_generate_does():
    def check(reference, ids, got, want):
        assert got == want, reference.explain(ids, got, want)

    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactDtypeWarning)  # no weaker promise in float32
        treespec.Decoder(str(STORIES260K), drafter="ngram")
    decode("float32", check)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_parts_from_generate_only_at_a_near_tie(dtype):
    """float16 and bfloat16 decode generate's tokens until, if ever, two near-tied tokens (within a few
    rounding steps of the dtype) go different ways; then the two continue from different tokens."""

    def check(reference, ids, got, want):
        if got != want:
            d = reference.difference(ids, got, want)
            assert d.is_near_tie(getattr(torch, dtype)), reference.explain(ids, got, want)

    decode(dtype, check)


def test_half_precision_says_what_it_promises():
    for dtype in ("bfloat16", "float16"):
        with pytest.warns(InexactDtypeWarning, match=f"{dtype}: .*near-tied tokens can differ from generate"):
            treespec.Decoder(str(STORIES260K), drafter="ngram", dtype=dtype)
    assert dtype_note(torch.float32) is None and dtype_note(torch.float64) is None


def test_the_cli_prints_the_note_as_one_line():
    from treespec.cli.app import app

    r = CliRunner().invoke(
        app,
        [
            "run",
            "--target",
            str(STORIES260K),
            "--drafter",
            "ngram",
            "--dtype",
            "bfloat16",
            "--prompt",
            "Once upon a time",
            "--max-new-tokens",
            "4",
        ],
    )
    assert r.exit_code == 0, r.output
    notes = [line for line in r.output.splitlines() if "bfloat16" in line]
    assert notes == [notes[0]] and notes[0].startswith("note: bfloat16:") and "Warning" not in r.output
