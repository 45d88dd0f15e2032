"""Prompt sets for benchmarks: the files in ../shared/prompts (or --data-dir / TREESPEC_DATA_DIR).

Every loader returns ``PromptItem``s: one or more user turns. ``format_turns`` turns a conversation
into token ids for a target: its chat template when the tokenizer has one, plain text otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treespec.errors import ConfigError
from treespec.inputs import chat_ids, has_chat_template, json_lines

#: dataset name -> (file name, format)
DATASETS: dict[str, tuple[str, str]] = {
    "mt-bench": ("mt_bench.jsonl", "turns"),
    "spec-bench": ("spec_bench.jsonl", "turns"),
    "gsm8k": ("gsm8k_test.jsonl", "question"),
    "humaneval": ("humaneval.jsonl.gz", "prompt"),
    "tinystories": ("tinystories_val.txt", "story"),
}
#: instruction prompts for training drafts of chat models, disjoint from every benchmark (treespec.train.instruct_mix)
MIX = "instruct-mix"
STORY_PROMPT_WORDS = 12  # a TinyStories prompt is the first 12 words of a validation story


@dataclass(frozen=True)
class PromptItem:
    id: str
    turns: list[str]
    category: str = ""
    raw: bool = field(default=False)  # True: a completion prompt (code, story), never chat-formatted


def default_data_dir() -> Path:
    """``TREESPEC_DATA_DIR``, else ``../shared/prompts`` from the working directory or this checkout."""
    env = os.environ.get("TREESPEC_DATA_DIR")
    if env:
        return Path(env)
    here = Path("../shared/prompts")
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2].parent / "shared" / "prompts"  # beside the checkout: ../shared


def load_prompts(
    dataset: str, data_dir: str | Path | None = None, limit: int | None = None, category: str | None = None
) -> list[PromptItem]:
    """A named dataset, or a path to a ``.jsonl`` (``.jsonl.gz``) or ``.txt`` file."""
    if dataset == MIX:
        return _mix(Path(data_dir) if data_dir is not None else default_data_dir(), limit)
    if dataset in DATASETS:
        fname, fmt = DATASETS[dataset]
        path = Path(data_dir) if data_dir is not None else default_data_dir()
        path = path / fname
        if not path.is_file():
            raise ConfigError(
                f"dataset {dataset!r}: {path} not found; point --data-dir (or TREESPEC_DATA_DIR) at the folder holding {fname}"
            )
    else:
        path, fmt = Path(dataset), "auto"
        if not path.is_file():
            names = ", ".join(DATASETS)
            raise ConfigError(f"dataset {dataset!r} is neither a known name ({names}) nor a file")
    items = _read(path, fmt)
    if category:  # one category, or several separated by commas
        cats = sorted({i.category for i in items})
        wanted = [c.strip() for c in category.split(",") if c.strip()]
        missing = [c for c in wanted if c not in cats]
        if missing:
            raise ConfigError(
                f"dataset {dataset!r} has no category {', '.join(map(repr, missing))}; "
                f"categories: {', '.join(cats) or 'none'}"
            )
        items = [i for i in items if i.category in wanted]
    if not items:
        raise ConfigError(f"dataset {dataset!r} ({path}) holds no prompts")
    return items[:limit] if limit else items


def _mix(folder: Path, limit: int | None) -> list[PromptItem]:
    from treespec.train.instruct_mix import SIZE, instruct_mix

    need = [folder / f for f in ("tinystories_val.txt", "gsm8k_test.jsonl", "spec_bench.jsonl")]
    missing = [p.name for p in need if not p.is_file()]
    if missing:
        raise ConfigError(
            f"dataset {MIX!r} is made from {', '.join(missing)}, not found in {folder}; "
            "point --data-dir (or TREESPEC_DATA_DIR) at the folder holding them"
        )
    rows = instruct_mix(folder, size=max(SIZE, limit or 0))
    return [PromptItem(r["id"], r["turns"], r["category"]) for r in rows][: limit or None]


def _read(path: Path, fmt: str) -> list[PromptItem]:
    """The prompts of a file; a file that is not UTF-8 JSON lines or text is one ConfigError line."""
    if path.suffix not in (".txt", ".jsonl", ".json", ".gz"):
        raise ConfigError(f"dataset file {path}: expected a .jsonl, .jsonl.gz or .txt file of prompts")
    try:
        return _parse(path, fmt)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"dataset file {path} is not UTF-8 text (byte {exc.start}): convert it to UTF-8") from None
    except (OSError, EOFError) as exc:
        raise ConfigError(f"dataset file {path} cannot be read ({type(exc).__name__}: {exc})") from None


def _parse(path: Path, fmt: str) -> list[PromptItem]:
    if path.suffix == ".txt":
        blocks = [b.strip() for b in path.read_text(encoding="utf-8").split("\n\n") if b.strip()]
        if fmt == "story":
            return [
                PromptItem(f"story-{i}", [" ".join(b.split()[:STORY_PROMPT_WORDS])], raw=True)
                for i, b in enumerate(blocks)
            ]
        return [PromptItem(f"{path.stem}-{i}", [b], raw=True) for i, b in enumerate(blocks)]
    return [_record(row, n - 1, path) for n, row in json_lines(path, "dataset file")]


def _record(row: dict[str, Any], n: int, path: Path) -> PromptItem:
    rid = str(row.get("question_id", row.get("task_id", row.get("id", n))))
    cat = str(row.get("category", ""))
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ConfigError(
                f"{path} line {n + 1}: 'turns' must be a non-empty list of texts, got "
                f'{json.dumps(turns)[:60]}: give "turns": ["first user turn", ...]'
            )
        return PromptItem(rid, turns, cat)
    for key in ("question", "prompt", "text"):
        if key in row:
            if not isinstance(row[key], str):  # {"prompt": null} was decoded as the prompt "None"
                raise ConfigError(
                    f"{path} line {n + 1}: {key!r} must be text, got {json.dumps(row[key])[:60]}: give "
                    f'"{key}": "..." (or drop the line)'
                )
            return PromptItem(rid, [row[key]], cat, raw=key == "text" or (key == "prompt" and "task_id" in row))
    raise ConfigError(f"{path} line {n + 1}: no 'turns', 'question', 'prompt' or 'text' field")


#: how ``treespec bench --chat`` asks an instruct model for a completion prompt's continuation
CHAT_REQUESTS = {
    "humaneval": "Complete the following Python function. Reply with the whole function in a code block.\n\n"
    "```python\n{prompt}```",
    "": "Continue the following text.\n\n{prompt}",
}


def as_chat(item: PromptItem, dataset: str) -> PromptItem:
    """A completion prompt (``raw``) as a user request (``CHAT_REQUESTS``); chat prompts unchanged."""
    if not item.raw:
        return item
    template = CHAT_REQUESTS.get(dataset, CHAT_REQUESTS[""])
    return PromptItem(item.id, [template.format(prompt=t) for t in item.turns], item.category)


def format_turns(tokenizer: Any, item: PromptItem, answers: list[str]) -> list[int]:
    """Token ids of the conversation up to the next user turn: ``item.turns[: len(answers) + 1]``
    with the model's previous ``answers`` in between (FastChat's multi-turn MT-Bench)."""
    turns = item.turns[: len(answers) + 1]
    if has_chat_template(tokenizer) and not item.raw:
        messages = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        return chat_ids(tokenizer, messages)
    text = ""
    for i, turn in enumerate(turns):
        text += turn if i == 0 else f"\n\n{turn}"
        if i < len(answers):
            text += answers[i]
    # no length warning: training and bench cut a long prompt to the context, the Decoder refuses it in one line
    return list(tokenizer(text, verbose=False).input_ids)
