"""``instruct-mix``: instruction prompts for training a chat model's draft, disjoint from every benchmark.

EAGLE's recipe trains a head on the target's OWN answers to instruction prompts (ShareGPT there).
No instruction corpus can be downloaded here, so the mix is made from material on this machine that
no benchmark of treespec's uses, in four kinds of request (the target answers them; only its answers
and hidden states are learnt, so the prompts need to be varied requests, not good ones):

- **math** (25 %): GSM8K test questions, minus the 80 that Spec-Bench's ``math_reasoning`` category
  holds (compared by text), so no benchmark prompt is trained on.
- **stories** (35 %): TinyStories validation stories turned into requests: summarise, continue, answer
  a question about, retell for a child, give a title, translate a sentence, write a poem or a letter
  from it. (The TinyStories benchmark rows are completion prompts of the first 12 words, a different
  task, and the stories/260K pair is not a chat model.)
- **code** (25 %): Python standard-library functions (this interpreter's, as ``treespec train pair``
  reads them): write a function from its signature and docstring, explain, or test it. HumanEval
  is not in the standard library.
- **general** (15 %): short writing and explanation requests built from stdlib module docstrings'
  first sentences ("Explain to a beginner what ... is for") and story sentences (emails, blog posts).

MT-Bench, Spec-Bench (all categories) and HumanEval prompts never appear. The mix is deterministic
for a seed: the same rows every time on the same files.
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

SHARES = {"math": 0.25, "stories": 0.35, "code": 0.25, "general": 0.15}
SIZE = 4000  # rows made; `--limit` takes a prefix (rows are shuffled, so any prefix is a mix)

_STORY_TASKS = (
    "Summarize this story in two or three sentences.\n\n{story}",
    "Continue this story for a few more paragraphs.\n\n{head}",
    "Read the story and answer: what lesson does it teach, and why?\n\n{story}",
    "Retell this story for a five-year-old in simple words.\n\n{story}",
    "Give this story a title and explain your choice.\n\n{story}",
    "Translate into French: {sentence}",
    "Translate into German: {sentence}",
    "Translate into Spanish: {sentence}",
    "Write a short poem inspired by this sentence: {sentence}",
    "Write a letter from one of the characters to a friend, telling what happened.\n\n{story}",
    "List the characters in this story and describe each in one sentence.\n\n{story}",
)
_GENERAL_TASKS = (
    "Explain to a beginner what this Python module is for, with an example: {module} ({doc})",
    "Write a short blog post that starts with this sentence: {sentence}",
    "Write a polite email to a neighbour about this: {sentence}",
    "Give three tips for someone who wants to learn about {topic}.",
    "What are the pros and cons of {topic}? Answer in a short list.",
)
_CODE_TASKS = (
    "Write a Python function with this signature and docstring.\n\n```python\n{stub}```",
    "Explain what this Python function does, step by step.\n\n```python\n{source}```",
    "Write unit tests with pytest for this function.\n\n```python\n{source}```",
    "Is there a bug or an edge case in this function? Explain.\n\n```python\n{source}```",
)


def _stories(data_dir: Path) -> list[str]:
    text = (data_dir / "tinystories_val.txt").read_text(encoding="utf-8")
    return [" ".join(b.split()) for b in text.split("\n\n") if 40 <= len(b.split()) <= 300]


def _math(data_dir: Path) -> list[str]:
    rows = [json.loads(line) for line in (data_dir / "spec_bench.jsonl").open(encoding="utf-8")]
    bench = {r["turns"][0].strip() for r in rows if r.get("category") == "math_reasoning"}
    rows = [json.loads(line)["question"].strip() for line in (data_dir / "gsm8k_test.jsonl").open(encoding="utf-8")]
    return [q for q in rows if not any(q in b for b in bench)]


def _functions(root: Path, rng: random.Random, want: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(stub, source) of short documented stdlib functions, and (module, first docstring line) pairs."""
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    funcs: list[tuple[str, str]] = []
    modules: list[tuple[str, str]] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        doc = ast.get_docstring(tree)
        if doc and doc.strip():
            modules.append((path.stem, doc.strip().splitlines()[0][:160]))
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node) or node.name.startswith("_"):
                continue
            body = lines[node.lineno - 1 : node.end_lineno]
            if not 4 <= len(body) <= 30:
                continue
            doc_end = node.body[0].end_lineno
            funcs.append(("\n".join(lines[node.lineno - 1 : doc_end]) + "\n", "\n".join(body) + "\n"))
        if len(funcs) >= want and len(modules) >= 50:
            break
    return funcs, modules


def instruct_mix(data_dir: Path, size: int = SIZE, seed: int = 0) -> list[dict[str, str]]:
    """``size`` rows ``{"id", "category", "turns": [request]}``, shuffled (see the module docstring)."""
    import sysconfig

    rng = random.Random(seed)
    stories, math = _stories(data_dir), _math(data_dir)
    funcs, modules = _functions(Path(sysconfig.get_paths()["stdlib"]), rng, int(size * SHARES["code"]) + 1)
    rng.shuffle(stories)
    rng.shuffle(math)
    rows: list[dict[str, str]] = []

    def add(kind: str, text: str) -> None:
        rows.append({"id": f"{kind}-{len(rows)}", "category": kind, "turns": [text]})

    for q in math[: int(size * SHARES["math"])]:
        add("math", q)
    for i in range(int(size * SHARES["stories"])):
        story = stories[i % len(stories)]
        sentences = [s.strip() + "." for s in story.split(".") if len(s.split()) >= 5]
        task = rng.choice(_STORY_TASKS)
        add(
            "stories",
            task.format(
                story=story,
                head=" ".join(sentences[:3]) or story,
                sentence=rng.choice(sentences) if sentences else story,
            ),
        )
    for i in range(int(size * SHARES["code"])):
        stub, source = funcs[i % len(funcs)]
        add("code", rng.choice(_CODE_TASKS).format(stub=stub, source=source))
    topics = [f"the Python module {m}" for m, _ in modules]
    while len(rows) < size:
        module, doc = rng.choice(modules)
        story = rng.choice(stories)
        add(
            "general",
            rng.choice(_GENERAL_TASKS).format(
                module=module, doc=doc, topic=rng.choice(topics), sentence=story.split(".")[0].strip() + "."
            ),
        )
    rng.shuffle(rows)
    return rows
