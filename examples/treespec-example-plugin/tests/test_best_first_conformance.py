"""The builder conformance kit on ``best-first``: the pattern for a third-party builder's tests.

``treespec.testing.BuilderConformance`` turns every check of the builder contract into a test
(valid trees grown by the drafter protocol, the node budget, the depth cap, batches, lossless
decoding). Subclass it, say how to build your builder, and pytest does the rest:

    pytest tests/test_best_first_conformance.py -q

By default the checks decode on a tiny random-weight Llama (no files, no network) with the ``self``
and ``ngram`` drafters; ``TestBestFirstOnARealTarget`` adds a real target, real prompts and a real
draft model, and runs when the model is on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from treespec_example.best_first import BestFirstBuilder

import treespec
from treespec.testing import BuilderConformance


class TestBestFirstConformance(BuilderConformance):
    """Everything on the default target: a seeded random Llama in float64, token-id prompts."""

    def make_builder(self):
        return BestFirstBuilder(BestFirstBuilder.Config(nodes=12, branch=3))


STORIES260K = (
    Path(os.environ.get("TREESPEC_SHARED", Path(__file__).resolve().parents[3].parent / "shared"))
    / "models"
    / "stories260K"
)


@pytest.mark.skipif(not STORIES260K.is_dir(), reason=f"{STORIES260K} not found")
class TestBestFirstOnARealTarget(TestBestFirstConformance):
    """The same checks on a real target (float64) with a draft model that gets accepted."""

    expect_acceptance = True

    def make_target(self):
        return treespec.TargetModel.load(str(STORIES260K), dtype="float64")

    def prompts(self):
        return [
            "Once upon a time, there was a little dog named Max. Max liked to play with his ball. One day, Max",
            "Lily and Tom went to the park. Lily saw a big red ball and Tom saw a big red",
        ]

    def drafters(self):
        from treespec.factory import make_drafter

        return [("model", lambda target: make_drafter("model", {"model": str(STORIES260K), "layers": 3}, target))]
