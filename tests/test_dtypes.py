"""What treespec promises per dtype (docs/reliability.md, "Dtypes").

float16 and float32 (and float64, which the other tests use) decode token for token what the
target's own ``generate(do_sample=False)`` does in that dtype. bfloat16 cannot promise that: a tree
forward sums the same products in another order than generate's one-token forwards, and with 8 bits of
mantissa logits one step apart are frequent ties. treespec says so when a target is bfloat16.
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


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_float16_and_float32_trees_decode_what_generate_does(dtype):
    """A 25-node opt-tree and a chain, on real stories, against generate() in the same dtype."""
    target = treespec.TargetModel.load(str(STORIES260K), dtype=dtype)
    assert target.dtype == getattr(torch, dtype)
    reference = GreedyReference(target)
    for builder, options in (("opt-tree", {"nodes": 25}), ("chain", {"k": 4})):
        with warnings.catch_warnings():
            warnings.simplefilter("error", InexactDtypeWarning)  # no weaker promise in these dtypes
            dec = treespec.Decoder(target, drafter="ngram", builder=builder, builder_options=options)
        for prompt in tinystories_prompts(3):
            ids = dec.encode(prompt)
            out = dec.generate(ids, max_new_tokens=48)
            want = reference(ids, 48)
            assert out.token_ids == want, reference.explain(ids, out.token_ids, want)


def test_bfloat16_says_what_it_promises_instead():
    """bfloat16 decodes (every token is the target's argmax in the tree forward) with a one-line note."""
    with pytest.warns(InexactDtypeWarning, match="near-tied tokens can differ from generate"):
        treespec.Decoder(str(STORIES260K), drafter="ngram", dtype="bfloat16")
    assert dtype_note(torch.float32) is None and dtype_note(torch.float16) is None


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
