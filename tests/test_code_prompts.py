"""HumanEval-style prompts cut from source (the default pair's EAGLE-head training prompts)."""

from __future__ import annotations

import json

from treespec.train.code_prompts import function_prompts, write_prompts

SOURCE = '''import os


def documented(a, b=1):
    """Add.

    More text.
    """
    return a + b


def bare(x):
    return x


class K:
    async def method(self):
        """A method."""
        pass
'''


def test_functions_with_docstrings_become_dedented_prompts():
    got = list(function_prompts("m.py", SOURCE))
    assert [p["id"] for p in got] == ["m.py:4", "m.py:17"]
    assert got[0]["prompt"] == 'def documented(a, b=1):\n    """Add.\n\n    More text.\n    """\n'
    assert got[1]["prompt"] == 'async def method(self):\n    """A method."""\n'
    assert list(function_prompts("broken.py", "def (:\n")) == []


def test_write_prompts_samples_reproducibly(tmp_path):
    files = [(f"f{i}.py", SOURCE) for i in range(10)]  # 20 prompts
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert write_prompts(files, a, limit=7, seed=3) == 7 and write_prompts(files, b, limit=7, seed=3) == 7
    assert a.read_text() == b.read_text()
    ids = [json.loads(line)["id"] for line in a.read_text().splitlines()]
    assert len(set(ids)) == 7
    assert write_prompts(files, tmp_path / "all.jsonl", limit=100) == 20
