"""What the judge's noise test (``plugins/probe.py``, ``Z_NOISE``) changes in a decode, on this machine.

    python examples/judge_noise.py --target smollm2 --dataset mt-bench --limit 32 --max-new-tokens 256

Three rows per prompt, back to back in an order that alternates from prompt to prompt: treespec's
default configuration for the target with the judge as shipped (a loss must be more than its steps'
noise), the same configuration in a second Decoder whose judge turns speculation off on the point
estimate alone (``Z_NOISE = 0``, the judge before 2026-11-28), and Hugging Face's
``generate(do_sample=False)``. Each Decoder keeps its own planner (calibration, cost curves) across
prompts, as one ``treespec bench`` row does. Every treespec row is checked token for token against
``generate``. Prints a Markdown table (``ab_rows.compare``): tokens/s, τ, the share of plain steps,
and each row over the others with 95% intervals paired by prompt (``treespec.bench.paired``).
"""

from __future__ import annotations

import argparse

import torch
from ab_rows import compare

import treespec
from treespec import defaults
from treespec.bench.datasets import as_chat, load_prompts
from treespec.plugins import probe


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
    items = load_prompts(args.dataset, limit=args.limit)
    items = [as_chat(it, args.dataset) if args.chat else it for it in items]

    def judged(z: float):  # a Decoder of its own (its planner learns on its own), its judge's Z_NOISE
        dec = treespec.Decoder(target, drafter=drafter, builder="opt-tree", builder_options={"nodes": "auto"})

        def run(ids: list[int]):
            probe.Z_NOISE = z
            return dec.generate(ids, max_new_tokens=args.max_new_tokens)

        return run

    print(
        f"{args.target}, {drafter} under opt-tree nodes=auto, {len(items)} {args.dataset} prompts, "
        f"{args.max_new_tokens} new tokens, {args.threads} threads\n"
    )
    compare(target, items, {"noise test": judged(probe.Z_NOISE), "point estimate": judged(0.0)}, args.max_new_tokens)


if __name__ == "__main__":
    main()
