"""Shared by the examples that compare treespec variants with each other and with Hugging Face's greedy
``generate`` (``lean_target.py``, ``judge_noise.py``): rows run back to back on every prompt, in an order
that alternates from prompt to prompt, each treespec row checked token for token against ``generate``,
and one Markdown table with 95% intervals paired by prompt (``treespec.bench.paired``)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

import treespec
from treespec import defaults
from treespec.bench import paired
from treespec.bench.datasets import as_chat, format_turns, load_prompts

HF = "HF greedy"


def setup(
    limit: int, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> tuple[argparse.Namespace, Any, str, list[Any]]:
    """The examples' common options (target, dataset, which prompts, new tokens, threads, chat), the target loaded,
    its default drafter's name, and the prompts."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=defaults.MAIN)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--limit", type=int, default=limit)
    ap.add_argument("--start", type=int, default=0, help="the first prompt taken")
    ap.add_argument(
        "--every", type=int, default=1, help="take every N-th prompt from --start (5: all MT-Bench categories)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chat", action="store_true", help="completion prompts become chat requests")
    if extra is not None:  # an example's own options
        extra(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.TargetModel.load(args.target)
    items = load_prompts(args.dataset, limit=None)[args.start :: args.every][: args.limit or None]
    items = [as_chat(it, args.dataset) if args.chat else it for it in items]
    drafter = defaults.drafter_for(args.target)
    print(
        f"{args.target}, {drafter} under opt-tree nodes=auto, {len(items)} {args.dataset} prompts, "
        f"{args.max_new_tokens} new tokens, {args.threads} threads\n"
    )
    return args, target, drafter, items


def compare(target: Any, items: list[Any], rows: dict[str, Callable[[list[int]], Any]], max_new_tokens: int) -> None:
    """Decode every prompt of ``items`` with each of ``rows`` (name -> a function of the prompt's ids
    returning a treespec ``Output``) and with ``generate``; print per prompt whether every row matched,
    then the table: tokens/s, τ, the share of plain steps, and each row over every other row."""
    names = [*rows, HF]
    pairs: dict[str, list[tuple[int, float]]] = {row: [] for row in names}
    steps = {row: 0 for row in rows}
    plain = {row: 0 for row in rows}
    mismatches = 0
    for k, item in enumerate(items):
        ids = format_turns(target.tokenizer, item, [])
        got: dict[str, list[int]] = {}
        for row in names if k % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            if row == HF:
                with torch.inference_mode():
                    out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
                got[row] = out[0, len(ids) :].tolist()
            else:
                result = rows[row](ids)
                got[row], steps[row] = result.token_ids, steps[row] + len(result.stats.steps)
                plain[row] += sum(s.tree_size == 0 for s in result.stats.steps)
            pairs[row].append((len(got[row]), time.perf_counter() - t))
        same = all(got[row] == got[HF][: len(got[row])] for row in rows)
        mismatches += not same
        print(f"prompt {k}: {len(got[HF])} tokens, {'lossless' if same else 'MISMATCH'}", flush=True)
    print(f"\nrows differing from generate: {mismatches}\n")
    print("| row | tokens/s | τ | plain steps | " + " | ".join(f"× {o}" for o in names[1:]) + " |")
    print("|---|---|---|---|" + "---|" * (len(names) - 1))
    for row in names:
        tokens, seconds = map(sum, zip(*pairs[row]))
        tau = f"{tokens / steps[row]:.2f}" if row in steps else "1"
        share = f"{plain[row] / steps[row]:.0%}" if row in steps else "–"
        cells = [
            paired.cell(paired.ratio(pairs[row], pairs[o]), paired.interval(pairs[row], pairs[o])) for o in names[1:]
        ]
        print(f"| {row} | {tokens / seconds:.1f} | {tau} | {share} | " + " | ".join(cells) + " |")
