"""HumanEval-style prompts cut from Python source: a function's signature and its docstring.

``treespec train pair`` makes them from its TRAIN files (``OUT/data/code-prompts-train.jsonl``): the
default pair's EAGLE head is trained on the target's continuations of these, and never sees
HumanEval or the held-out files.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Iterable
from pathlib import Path

from treespec.files import write_text_atomic, writing


def function_prompts(rel: str, text: str) -> Iterable[dict[str, str]]:
    """Every function (or method) in ``text`` that has a docstring: its ``def`` line(s) through the end
    of the docstring, dedented by the ``def``'s indentation, ending with a newline."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        block = lines[node.lineno - 1 : doc.end_lineno]
        indent = len(block[0]) - len(block[0].lstrip())
        if any(line.strip() and len(line) - len(line.lstrip()) < indent for line in block):
            continue  # a continuation line left of the def: not cleanly dedentable
        yield {"id": f"{rel}:{node.lineno}", "prompt": "\n".join(line[indent:] for line in block) + "\n"}


def write_prompts(files: Iterable[tuple[str, str]], out: Path, limit: int, seed: int = 0) -> int:
    """Write up to ``limit`` prompts (a seeded sample, in source order) as JSON lines; returns how many."""
    prompts = [p for rel, text in files for p in function_prompts(rel, text)]
    if len(prompts) > limit:
        keep = sorted(random.Random(seed).sample(range(len(prompts)), limit))
        prompts = [prompts[i] for i in keep]
    with writing(out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "".join(json.dumps(p) + "\n" for p in prompts))
    return len(prompts)
