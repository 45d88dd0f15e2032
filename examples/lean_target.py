"""What the lean target forward (``treespec.lean.lean_target``) changes in a decode, on this machine.

    python examples/lean_target.py --target smollm2 --dataset mt-bench --limit 16 --max-new-tokens 256

Three rows per prompt, back to back in an order that alternates from prompt to prompt: treespec's
default configuration for the target with trees verified by the lean forward, the same with the model's
own forward (``TREESPEC_LEAN_TARGET=off``), and Hugging Face's ``generate(do_sample=False)``. Every
treespec row is checked token for token against ``generate``. Prints a Markdown table (``ab_rows.compare``): tokens/s, τ,
and each row over the others with 95% intervals paired by prompt (``treespec.bench.paired``).
"""

from __future__ import annotations

import argparse
import os

import torch
from ab_rows import compare

import treespec
from treespec import defaults
from treespec.bench.datasets import as_chat, format_turns, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=defaults.MAIN)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chat", action="store_true", help="completion prompts become chat requests")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.TargetModel.load(args.target)
    drafter = defaults.drafter_for(args.target)
    dec = treespec.Decoder(target, drafter=drafter, builder="opt-tree", builder_options={"nodes": "auto"})
    items = load_prompts(args.dataset, limit=args.limit)
    items = [as_chat(it, args.dataset) if args.chat else it for it in items]
    dec.generate(format_turns(target.tokenizer, items[0], []), max_new_tokens=8)  # warm: verdicts, costs

    def forward(setting: str):  # the same Decoder, trees verified by the lean forward or the model's own
        def run(ids: list[int]):
            os.environ["TREESPEC_LEAN_TARGET"] = setting
            return dec.generate(ids, max_new_tokens=args.max_new_tokens)

        return run

    print(
        f"{args.target}, {drafter} under opt-tree nodes=auto, {len(items)} {args.dataset} prompts, "
        f"{args.max_new_tokens} new tokens, {args.threads} threads\n"
    )
    compare(target, items, {"lean": forward("auto"), "model's forward": forward("off")}, args.max_new_tokens)


if __name__ == "__main__":
    main()
