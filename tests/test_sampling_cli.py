"""`treespec run --temperature 0.7 --top-p 0.9 --seed 1` on the default pair (treespec-py) for every
builder and drafter, and the sampling options' errors (the exactness itself: test_sampling_exact.py, test_sampling_stories.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import REPO
from treespec.cli.app import app

runner = CliRunner()
SAMPLE = [
    "--target",
    "treespec-py",
    "--temperature",
    "0.7",
    "--top-p",
    "0.9",
    "--seed",
    "1",
    "--max-new-tokens",
    "24",
    "--json",
    "--prompt",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
]
ACCEPTANCE = str(REPO / "docs" / "bench" / "acceptance-s260k-l4.json")
CASES = [  # (builder, builder options, drafter args): every builder, every drafter, sampled children
    ("opt-tree", [], []),
    ("chain", [], ["--drafter", "self"]),
    ("static", [], ["--drafter", "ngram"]),
    ("sequoia", ["-B", f"acceptance={ACCEPTANCE}"], ["--drafter", "model", "-D", "model=treespec-py-draft"]),
    ("eagle2", [], []),
    ("chain", ["-B", "sample=true"], []),
    ("static", ["-B", "shape=kary-2-3,sample=true"], ["--drafter", "self"]),
]


@pytest.fixture(scope="module")
def pinned_profile(tmp_path_factory):
    """A cost profile written by hand: with it and refine=false, opt-tree nodes=auto plans without
    reading the clock, so a seeded sampling run reproduces (docs/cost-aware.md)."""
    from treespec.cost import EXPAND_GRID, VERIFY_GRID, CostModel

    model = CostModel()
    for n in VERIFY_GRID:
        model.verify.observe(n, 0.006 + 0.0001 * n)
        model.bookkeeping.observe(n, 0.001)
    for m in EXPAND_GRID:
        model.expand.observe(m, 0.0008 + 0.0001 * m)
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(model.to_json())
    return path


@pytest.mark.parametrize("builder,b_opts,d_args", CASES)
def test_run_samples_with_every_builder_and_drafter(builder, b_opts, d_args, pinned_profile):
    if builder == "opt-tree":  # nodes=auto: reproducible with a pinned profile and no refinement
        b_opts = [*b_opts, "-B", f"profile={pinned_profile},refine=false"]
    args = ["run", "--builder", builder, *b_opts, *d_args, *SAMPLE]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    n = data["stats"]["new_tokens"]
    assert n == len(data["token_ids"]) and (n == 24 or data["stats"]["stop_reason"] == "eos"), data["stats"]
    again = runner.invoke(app, args)
    assert json.loads(again.stdout)["token_ids"] == data["token_ids"]  # --seed reproduces the run


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "0.7", "--top-p", "1.5"], "top_p"),
        (["--temperature", "0.7", "--top-k", "-3"], "top_k"),
        (["--temperature", "0.7", "--sampling-rule", "magic"], "rule"),
        (
            ["--temperature", "0.7", "--drafter", "ngram", "-B", "sample=true", "--builder", "chain"],
            "full distribution",
        ),
        (["--temperature", "0.7", "--drafter", "ngram", "--sampling-rule", "specinfer"], "full distribution"),
    ],
)
def test_bad_sampling_options_are_one_line(args, needle):
    res = runner.invoke(app, ["run", "--target", "treespec-py", "--prompt", "Hi", "--max-new-tokens", "4", *args])
    assert res.exit_code != 0
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
