"""`treespec tree show`: one real tree, verified and drawn."""

from __future__ import annotations

from typer.testing import CliRunner

from conftest import STORIES260K
from treespec.cli.app import app


def test_tree_show_draws_terminal_dot_and_png(tmp_path, greedy_reference):
    prompt = "Once upon a time, there was a little dog"
    res = CliRunner().invoke(
        app,
        [
            "tree",
            "show",
            "--target",
            str(STORIES260K),
            "--drafter",
            str(STORIES260K),
            "-D",
            "layers=4",
            "--builder",
            "opt-tree",
            "-B",
            "nodes=12",
            "--prompt",
            prompt,
            "--dot",
            str(tmp_path / "t.dot"),
            "--png",
            str(tmp_path / "t.png"),
        ],
    )
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "▁named" in out and "q=" in out and "p̂=" in out and "+ bonus" in out
    assert "12 drafted nodes" in out and "the target accepts" in out
    # what the target accepts is the start of its own greedy continuation
    ids = greedy_reference.target.tokenizer(prompt).input_ids
    first = greedy_reference.target.tokenizer.convert_ids_to_tokens(greedy_reference(ids, 4)[0])
    assert "+ bonus" in out and first in out
    dot = (tmp_path / "t.dot").read_text()
    assert dot.startswith("digraph draft_tree {") and dot.count("->") == 12 + 1 and "bonus" in dot
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_tree_show_bad_builder_is_one_line():
    res = CliRunner().invoke(app, ["tree", "show", "--builder", "opt-tre"])
    assert res.exit_code == 2 and "did you mean 'opt-tree'" in res.stderr
