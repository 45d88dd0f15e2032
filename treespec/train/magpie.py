"""Chat prompts written by the target itself (Magpie, Xu et al. 2024, arXiv 2406.08464).

An instruct model given its chat template up to the start of a user turn — and nothing else — writes
a user request: the kind of request it was tuned on. Sampled many times, that is a set of chat prompts
from the target's own distribution with no corpus to download, and the target's greedy answers to them
are what EAGLE's recipe trains a head on (``treespec train eagle --data prompts.jsonl``).

    prefix = template([{"user": SENTINEL}]) cut before SENTINEL   # "<|im_start|>user\n" and what precedes it
    query  = sample(target, prefix) until the end-of-turn token    # temperature 1, full distribution

A query is kept when the model ended the turn itself, it has ``min_words``..``max_words`` words, it is
not a repeat (case and spacing ignored), and it shares no run of ``OVERLAP_WORDS`` words with any
evaluation prompt (MT-Bench, Spec-Bench, HumanEval): nothing benchmarked is trained on. The file is
written a batch at a time and each line records its batch; batch ``i`` is drawn with seed ``seed + i``,
so the same command (or a larger ``count``) resumes from the last batch written and writes what an
uninterrupted run would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treespec.devices import check_device
from treespec.errors import ConfigError

SENTINEL = "\x00treespec-user-turn\x00"
OVERLAP_WORDS = 8  # a query sharing this many consecutive words with an evaluation prompt is dropped
EVAL_SETS = ("mt-bench", "spec-bench", "humaneval")
GIVE_UP = 20  # batches in a row that keep nothing: the model does not write requests; stop with a line


@dataclass(frozen=True)
class MagpieSettings:
    target: str
    out: str
    count: int = 1000  # queries to write
    batch_size: int = 32  # queries sampled together
    max_tokens: int = 96  # a query's longest; longer ones are dropped (not cut)
    temperature: float = 1.0
    seed: int = 0
    min_words: int = 3
    max_words: int = 120
    device: str | None = None  # where the target samples (None: cpu); another device draws other queries


def query_prefix(tokenizer: Any) -> list[int]:
    """The chat template's tokens up to where a user's first message begins (its default system
    prompt included): what the model continues with a request."""
    from treespec.inputs import has_chat_template

    if not has_chat_template(tokenizer):
        raise ConfigError("the target has no chat template: Magpie prompts need an instruct model's template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    return list(tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False).input_ids)


def end_of_turn(tokenizer: Any) -> list[int]:
    """Token ids that end a user turn: the first token the template puts after the message, and EOS.
    The tail is tokenized after a word (``"x" + tail`` minus ``"x"``), as it follows text in a turn:
    alone, a SentencePiece tokenizer would start it with a space token."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    tail = text[text.index(SENTINEL) + len(SENTINEL) :]
    word = tokenizer("x", add_special_tokens=False).input_ids
    after = tokenizer("x" + tail, add_special_tokens=False).input_ids
    if after[: len(word)] == word:
        first = after[len(word) : len(word) + 1]
    else:  # the word merged with the tail: take the tail's own first token
        first = tokenizer(tail, add_special_tokens=False).input_ids[:1]
    return sorted({i for i in [*first, tokenizer.eos_token_id] if i is not None})


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.casefold())


def shingles(text: str, n: int = OVERLAP_WORDS) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def evaluation_shingles(sets: Iterable[str] = EVAL_SETS) -> set[tuple[str, ...]]:
    """Every run of ``OVERLAP_WORDS`` words in the evaluation prompts found on this machine."""
    from treespec.bench.datasets import load_prompts

    found: set[tuple[str, ...]] = set()
    for name in sets:
        try:
            items = load_prompts(name)
        except ConfigError:
            continue  # a set that is not here cannot be trained on either
        for item in items:
            for turn in item.turns:
                found |= shingles(turn)
    return found


class Filter:
    """Keeps a query once, if its length is in range and it overlaps no evaluation prompt."""

    def __init__(self, s: MagpieSettings, banned: set[tuple[str, ...]], seen: Iterable[str] = ()) -> None:
        self.s, self.banned = s, banned
        self.seen = {" ".join(_words(q)) for q in seen}
        self.dropped = {"unfinished": 0, "length": 0, "repeat": 0, "overlap": 0}

    def keep(self, query: str, finished: bool) -> bool:
        key = " ".join(_words(query))
        reason = self.reason(key, query, finished)
        if reason:
            self.dropped[reason] += 1
            return False
        self.seen.add(key)
        return True

    def reason(self, key: str, query: str, finished: bool) -> str | None:
        """Why a query is dropped (a key of ``dropped``), or None to keep it."""
        if not finished:
            return "unfinished"
        if not self.s.min_words <= len(key.split()) <= self.s.max_words:
            return "length"
        if key in self.seen:
            return "repeat"
        if shingles(query) & self.banned:
            return "overlap"
        return None


@torch.no_grad()
def sample_queries(
    model: Any, tokenizer: Any, s: MagpieSettings, batch: int, prefix_ids: list[int], stops: list[int]
) -> list[tuple[str, bool]]:
    """One batch of ``s.batch_size`` sampled user turns after ``prefix_ids`` (``query_prefix``), ended by
    any of ``stops`` (``end_of_turn``): (text, whether the model ended the turn)."""
    prefix = torch.tensor([prefix_ids], device=model.device).repeat(s.batch_size, 1)  # [B, P]
    torch.manual_seed(s.seed + batch)
    out = model.generate(
        prefix,
        attention_mask=torch.ones_like(prefix),
        do_sample=True,
        temperature=s.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=s.max_tokens,
        eos_token_id=stops,
        pad_token_id=stops[0],
    )[:, prefix.shape[1] :]  # [B, <= max_tokens]
    rows = []
    for row in out.tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        text = tokenizer.decode(row[: ends[0]] if ends else row, skip_special_tokens=True).strip()
        rows.append((text, bool(ends)))
    return rows


def _written(out: Path) -> list[dict[str, Any]]:
    """The rows a previous run wrote to ``out`` (none if it does not exist); another file is one line."""
    if not out.is_file():
        return []
    try:
        rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        for row in rows:
            int(row["batch"]), str(row["turns"][0])
    except (ValueError, KeyError, TypeError, IndexError):
        raise ConfigError(
            f"{out} holds lines `treespec train prompts` did not write: pass a new --out to start a file"
        ) from None
    return rows


def write_prompts(
    s: MagpieSettings, progress: Callable[[str, int, int, str], None], log: Callable[[str], None]
) -> dict[str, Any]:
    """Append kept queries to ``s.out`` (JSON lines: id, turns, category) until it holds ``s.count``."""
    from treespec.models import load_causal_lm, load_tokenizer

    check_device(s.device)  # before anything loads
    out = Path(s.out)
    rows = _written(out)
    tokenizer = load_tokenizer(s.target)
    prefix = query_prefix(tokenizer)  # a target without a chat template fails here, before the model loads
    stops = end_of_turn(tokenizer)
    model = load_causal_lm(s.target, device=s.device)
    keep = Filter(s, evaluation_shingles(), (r["turns"][0] for r in rows))
    # the last batch is drawn again: its queries already written are repeats now, the rest (cut by a
    # smaller --count) are what an uninterrupted run would have written next
    batch = int(rows[-1]["batch"]) if rows else 0
    fruitless = 0  # batches in a row that kept nothing
    with out.open("a", encoding="utf-8") as f:
        while len(rows) < s.count:
            if fruitless == GIVE_UP:
                raise ConfigError(
                    f"{GIVE_UP} batches in a row kept no query ({keep.dropped}); {len(rows)} are in {out}: "
                    "is the target an instruct model? (or raise --max-tokens / widen --min-words..--max-words)"
                )
            lines = []
            for text, finished in sample_queries(model, tokenizer, s, batch, prefix, stops):
                if len(rows) < s.count and keep.keep(text, finished):
                    row = {"id": f"magpie-{len(rows)}", "turns": [text], "category": "magpie", "batch": batch}
                    rows.append(row)
                    lines.append(json.dumps(row, ensure_ascii=False) + "\n")
            fruitless = 0 if lines else fruitless + 1
            f.write("".join(lines))  # the batch's lines at once: a resumed run draws this batch again
            f.flush()
            batch += 1
            progress("queries", len(rows), s.count, f"batch {batch}")
    log(f"{len(rows)} queries in {out} after {batch} batches; dropped this run: {keep.dropped}")
    return {"queries": len(rows), "batches": batch, "dropped": keep.dropped}
