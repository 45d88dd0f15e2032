"""What a batch's plan pays for a chain of D rounds, against what fixed chains of D rounds cost here.

    python examples/batch_plan_prices.py [--target treespec-py] [--batch-size 4] [--prompts 16] [--depths 1,2,3,4,5,6]

``opt-tree nodes=auto`` in a batch drafts one chain per row and chooses its depth D by
(1 + min_r Ē_r,D) / W(D) (``plugins/batch_budget.py``): W(D) is a line drawn once from the cost curves
measured before the batch's first step. This decodes the first ``--prompts`` HumanEval prompts (128 new
tokens, ``--batch-size`` rows, a finished row's place going to the next prompt) with ``nodes=auto`` and
prints the plan's prices: the curves' chain price P(D) = T_first + (D − 1)·T_expand(1) + T(D) and the line
W(D). Then, for each D, it decodes the same prompts with ``chain k=D`` and prints the medians of its full
steps' phases (drafting, the verifying forward, bookkeeping, the whole step): what a round of D really
adds on this machine.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import treespec
from treespec.batch import generate_batch
from treespec.bench.datasets import format_turns, load_prompts
from treespec.plugins import batch_budget

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "draft_temperature": None, "rule": "auto", "seed": 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="treespec-py")
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--depths", default="1,2,3,4,5,6")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.TargetModel.load(args.target)
    prompts = [format_turns(target.tokenizer, it, []) for it in load_prompts("humaneval", limit=args.prompts)]
    auto = treespec.Decoder(target, drafter=args.drafter, builder="opt-tree", builder_options={"nodes": "auto"})
    generate_batch(auto, prompts, 128, GREEDY, batch_size=args.batch_size)
    # row 0's builder, kept by the Decoder for batches of this size (its planner: the curves the plan read)
    planner = auto.row_builders(auto.drafter.rows(args.batch_size).drafters)[0].planner
    depths = [int(d) for d in args.depths.split(",")]
    print(f"{args.target}, {args.drafter}, B = {args.batch_size}, {len(prompts)} HumanEval prompts, 128 new tokens\n")
    print(
        "| D | plan: P(D) ms (drafting + T(D)) | plan: W(D) ms | chain k=D: step ms | drafting | verify | bookkeeping |"
    )
    print("|---|---|---|---|---|---|---|")
    for d in depths:
        dec = treespec.Decoder(target, drafter=args.drafter, builder="chain", builder_options={"k": d})
        generate_batch(dec, prompts[: args.batch_size], 32, GREEDY, batch_size=args.batch_size)  # warm
        outs = generate_batch(dec, prompts, 128, GREEDY, batch_size=args.batch_size)
        full = [s for o in outs for s in o.stats.steps if s.tree_size == d]  # [row-steps] of full chains

        def med(name: str, steps: list = full) -> str:
            return f"{1e3 * statistics.median(getattr(s, name) for s in steps):.2f}"

        price = line = "–"
        if planner is not None and planner.known:
            drafting = planner.t_first + (d - 1) * float(planner.t_expand[1])
            price = f"{1e3 * batch_budget.chain_price(planner, d):.2f} ({1e3 * drafting:.2f} + {1e3 * float(planner.t_step[d]):.2f})"
            at = batch_budget.line(planner)
            line = "–" if at is None else f"{1e3 * (at[0] + at[1] * (d - batch_budget.ANCHOR)):.2f}"
        print(
            f"| {d} | {price} | {line} | {med('t_wall')} | {med('t_draft')} | {med('t_verify')} | {med('t_bookkeeping')} |"
        )


if __name__ == "__main__":
    main()
