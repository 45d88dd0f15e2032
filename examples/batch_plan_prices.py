"""What a batch's plan pays for a chain of D rounds, against what fixed chains of D rounds cost here.

    python examples/batch_plan_prices.py [--target treespec-py] [--batch-size 4] [--prompts 16] [--depths 1,2,3,4,5,6]

``opt-tree nodes=auto`` in a batch drafts one chain per row and chooses its depth D by
(1 + min_r Ē_r,D) / W(D) (``plugins/batch_budget.py``): W(D) is a line drawn once from the cost curves
measured before the batch's first step. This decodes the first ``--prompts`` HumanEval prompts (128 new
tokens, ``--batch-size`` rows, a finished row's place going to the next prompt) with ``nodes=auto`` and
prints what it planned with, per chain depth D: the line W(D) it chose by (drawn before its first step),
the chain price P(D) = T_first + (D − 1)·T_expand(1) + T(D) by the curves as the decode left them
(refined online from its steps; the line does not follow them), the rows' steps at D, and the calibrated
E it expected there against the drafted tokens accepted. Then, for each D, it decodes the same prompts
with ``chain k=D`` and prints the medians of its full steps' phases (drafting, the verifying forward,
bookkeeping, the whole step), the drafted tokens its full steps accepted, and the rate (1 + accepted) per
millisecond of a median step they buy: what a round of D really adds and gains on this machine.
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
    steps = [s for o in generate_batch(auto, prompts, 128, GREEDY, batch_size=args.batch_size) for s in o.stats.steps]
    # row 0's builder, kept by the Decoder for batches of this size (its planner: the curves the plan read)
    planner = auto.row_builders(auto.drafter.rows(args.batch_size).drafters)[0].planner
    drawn = planner.plan.line if planner is not None and planner.plan is not None else None
    depths = [int(d) for d in args.depths.split(",")]
    print(f"{args.target}, {args.drafter}, B = {args.batch_size}, {len(prompts)} HumanEval prompts, 128 new tokens\n")
    print("| D | plan: W(D) ms | curves after: P(D) ms (drafting + T(D)) | auto row-steps | E expected | accepted |")
    print("|---|---|---|---|---|---|")
    expected: dict[int, float] = {}
    for d in depths:
        at = [s for s in steps if s.tree_size == d]  # the auto rows' steps with a chain of d
        if at:
            expected[d] = statistics.mean(s.planned_expected or 0.0 for s in at)
        line = "–" if drawn is None else f"{1e3 * (drawn[0] + drawn[1] * (d - batch_budget.ANCHOR)):.2f}"
        price = "–"
        if planner is not None and planner.known:
            drafting = planner.t_first + (d - 1) * float(planner.t_expand[1])
            price = f"{1e3 * batch_budget.chain_price(planner, d):.2f} ({1e3 * drafting:.2f} + {1e3 * float(planner.t_step[d]):.2f})"
        got = f"{statistics.mean(s.accepted for s in at):.2f}" if at else "–"
        print(f"| {d} | {line} | {price} | {len(at)} | {expected.get(d, 0.0):.2f} | {got} |")
    print("\n| D | chain k=D: step ms | drafting | verify | bookkeeping | accepted | (1 + accepted)/step, tokens/ms |")
    print("|---|---|---|---|---|---|---|")
    for d in depths:
        dec = treespec.Decoder(target, drafter=args.drafter, builder="chain", builder_options={"k": d})
        generate_batch(dec, prompts[: args.batch_size], 32, GREEDY, batch_size=args.batch_size)  # warm
        outs = generate_batch(dec, prompts, 128, GREEDY, batch_size=args.batch_size)
        full = [s for o in outs for s in o.stats.steps if s.tree_size == d]  # [row-steps] of full chains

        def med(name: str, steps: list = full) -> str:
            return f"{1e3 * statistics.median(getattr(s, name) for s in steps):.2f}"

        accepted = statistics.mean(s.accepted for s in full)
        rate = (1 + accepted) / float(med("t_wall"))
        print(
            f"| {d} | {med('t_wall')} | {med('t_draft')} | {med('t_verify')} | {med('t_bookkeeping')} "
            f"| {accepted:.2f} | {rate:.3f} |"
        )


if __name__ == "__main__":
    main()
