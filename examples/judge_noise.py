"""What the judge's noise test (``plugins/probe.py``, ``Z_NOISE``) changes in a decode, on this machine.

    python examples/judge_noise.py --target smollm2 --dataset mt-bench --limit 32 --max-new-tokens 256

Three rows per prompt, back to back in an order that alternates from prompt to prompt: treespec's
default configuration for the target with the judge as shipped (a loss must be more than its steps'
noise), the same configuration in a second Decoder whose judge turns speculation off on the point
estimate alone (``Z_NOISE = 0``, the judge before 2026-11-28), and Hugging Face's
``generate(do_sample=False)``. Each Decoder keeps its own planner (calibration, cost curves) across
prompts, as one ``treespec bench`` row does. Every treespec row is checked token for token against
``generate``. Prints a Markdown table: tokens/s, τ, the share of plain steps, and each row over the
others with 95% intervals paired by prompt (``treespec.bench.paired``).
"""

from __future__ import annotations

import argparse
import time

import torch

import treespec
from treespec import defaults
from treespec.bench import paired
from treespec.bench.datasets import as_chat, format_turns, load_prompts
from treespec.plugins import probe

ROWS = ("noise test", "point estimate", "HF greedy")
Z = {"noise test": probe.Z_NOISE, "point estimate": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=defaults.MAIN)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chat", action="store_true", help="completion prompts become chat requests")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.TargetModel.load(args.target)
    drafter = defaults.drafter_for(args.target)
    decs = {
        row: treespec.Decoder(target, drafter=drafter, builder="opt-tree", builder_options={"nodes": "auto"})
        for row in ROWS[:2]
    }
    items = load_prompts(args.dataset, limit=args.limit)
    items = [as_chat(it, args.dataset) if args.chat else it for it in items]
    pairs: dict[str, list[tuple[int, float]]] = {row: [] for row in ROWS}
    steps = {row: 0 for row in ROWS[:2]}
    plain = {row: 0 for row in ROWS[:2]}
    mismatches = 0
    for k, item in enumerate(items):
        ids = format_turns(target.tokenizer, item, [])
        got: dict[str, list[int]] = {}
        for row in ROWS if k % 2 == 0 else ROWS[::-1]:
            t = time.perf_counter()
            if row == "HF greedy":
                with torch.inference_mode():
                    out = target.model.generate(
                        torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False
                    )
                got[row] = out[0, len(ids) :].tolist()
            else:
                probe.Z_NOISE = Z[row]
                result = decs[row].generate(ids, max_new_tokens=args.max_new_tokens)
                got[row], steps[row] = result.token_ids, steps[row] + len(result.stats.steps)
                plain[row] += sum(s.tree_size == 0 for s in result.stats.steps)
            pairs[row].append((len(got[row]), time.perf_counter() - t))
        same = all(got[row] == got["HF greedy"][: len(got[row])] for row in ROWS[:2])
        mismatches += not same
        print(f"prompt {k}: {len(got['HF greedy'])} tokens, {'lossless' if same else 'MISMATCH'}", flush=True)
    print(
        f"\n{args.target}, {drafter} under opt-tree nodes=auto, {len(items)} {args.dataset} prompts, "
        f"{args.max_new_tokens} new tokens, {args.threads} threads; rows differing from generate: {mismatches}\n"
    )
    print("| row | tokens/s | τ | plain steps | × point estimate | × HF greedy |")
    print("|---|---|---|---|---|---|")
    for row in ROWS:
        tokens, seconds = map(sum, zip(*pairs[row]))
        tau = f"{tokens / steps[row]:.2f}" if row in steps else "1"
        share = f"{plain[row] / steps[row]:.0%}" if row in steps else "–"
        cells = [
            paired.cell(paired.ratio(pairs[row], pairs[other]), paired.interval(pairs[row], pairs[other]))
            for other in ROWS[1:]
        ]
        print(f"| {row} | {tokens / seconds:.1f} | {tau} | {share} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
