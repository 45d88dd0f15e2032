"""First-token acceptance of EAGLE heads for one target, side by side, on a prompt set.

    python examples/compare_heads.py --target smollm2 --dataset mt-bench --per-category 1 \\
        --max-new-tokens 96 --k 1,3 OLD_HEAD_DIR NEW_HEAD_DIR [eagle3=EAGLE3_HEAD_DIR]

Greedy decoding with `chain k=K | eagle head=H` for every head and K, on the first `--per-category`
prompts of each category (chat template, first turns): prints τ (tokens per target forward) and
accepted draft tokens per step. Outputs are the target's own whatever the head (lossless), so only
acceptance differs; with k = 1 it is the head's depth-1 acceptance on these prompts. A head given as
``eagle3=DIR`` is drafted with the ``eagle3`` drafter (EAGLE-3 heads), else with ``eagle``.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

import treespec
from treespec.bench.datasets import format_turns, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", default="1,3")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.TargetModel.load(args.target)
    seen: Counter[str] = Counter()
    prompts = []
    for item in load_prompts(args.dataset):
        if seen[item.category] < args.per_category:
            seen[item.category] += 1
            prompts.append(format_turns(target.tokenizer, item, []))
    for k in (int(v) for v in args.k.split(",")):
        for head in args.heads:
            drafter, _, path = head.partition("=") if head.startswith("eagle3=") else ("eagle", "", head)
            dec = treespec.Decoder(
                target, drafter=drafter, drafter_options={"head": path}, builder="chain", builder_options={"k": k}
            )
            accepted = steps = tokens = 0
            for ids in prompts:
                out = dec.generate(ids, max_new_tokens=args.max_new_tokens)
                accepted += sum(s.accepted for s in out.stats.steps)
                steps += len(out.stats.steps)
                tokens += len(out.token_ids)
            print(
                f"chain k={k} head={head}: τ {tokens / steps:.3f}, accepted per step {accepted / steps:.3f} "
                f"({len(prompts)} prompts)",
                flush=True,
            )


if __name__ == "__main__":
    main()
