"""The drafter conformance suite on ``bigram``: the pattern for a third-party drafter's tests.

``treespec.testing.DrafterConformance`` turns every check of the drafter contract into a test
(shapes, determinism, state after commit, nodes the drafter did not propose, honest flags,
lossless decoding, budget). Subclass it, say how to build your drafter, and pytest does the rest:

    pytest tests/test_bigram_conformance.py -q

By default the checks run on a tiny random-weight Llama (no files, no network). Checks on the
real target your drafter is meant for are better: ``TestBigramOnARealTarget`` below shows how,
and runs when the model is on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from treespec_example.bigram import BigramDrafter

import treespec
from treespec.testing import DrafterConformance


class TestBigramConformance(DrafterConformance):
    """Everything on the default target: a seeded random Llama in float64, token-id prompts."""

    def make_drafter(self, target):
        return BigramDrafter(BigramDrafter.Config(), target)


# A real model: here the treespec repository's stories260K, if present (set TREESPEC_SHARED to
# the directory that holds models/stories260K). Use your own target and prompts.
STORIES260K = (
    Path(os.environ.get("TREESPEC_SHARED", Path(__file__).resolve().parents[3].parent / "shared"))
    / "models"
    / "stories260K"
)


@pytest.mark.skipif(not STORIES260K.is_dir(), reason=f"{STORIES260K} not found")
class TestBigramOnARealTarget(TestBigramConformance):
    """The same checks on a real target (float64: fresh and incremental drafts then agree to ~1e-12)."""

    expect_acceptance = True  # on real text, bigrams do get accepted

    def make_target(self):
        return treespec.TargetModel.load(str(STORIES260K), dtype="float64")

    def prompts(self):
        return [
            "Once upon a time, there was a little dog named Max. Max liked to play with his ball. One day, Max",
            "Lily and Tom went to the park. Lily saw a big red ball and Tom saw a big red",
        ]
