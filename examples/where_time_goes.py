"""Where a benchmark's time and acceptance go, per configuration, from its steps.jsonl.

    python examples/where_time_goes.py docs/bench/smollm2-mtbench/steps.jsonl

Prints a Markdown table: steps, mean drafted nodes, τ (tokens per step), the mean milliseconds of a
step's draft / verification / bookkeeping, and P(accepted ≥ d) for d = 1..4 over speculative steps
(steps that drafted at least one node): how deep the target follows the draft.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows: dict[str, list[dict]] = defaultdict(list)
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            s = json.loads(line)
            rows[s["config"]].append(s)
    print(
        "| configuration | steps | nodes | τ | draft ms | verify ms | bookkeeping ms | speculative steps "
        "| P(acc≥1) | P(acc≥2) | P(acc≥3) | P(acc≥4) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config, steps in rows.items():
        n = len(steps)
        spec = [s for s in steps if s["tree_size"] > 0]
        mean = lambda key, xs=steps: 1000 * sum(x[key] for x in xs) / max(1, len(xs))  # noqa: E731
        tau = sum(s["emitted"] for s in steps) / n
        p = [sum(s["accepted"] >= d for s in spec) / max(1, len(spec)) for d in (1, 2, 3, 4)]
        print(
            f"| {config} | {n} | {sum(s['tree_size'] for s in steps) / n:.1f} | {tau:.2f} | {mean('t_draft'):.1f} "
            f"| {mean('t_verify'):.1f} | {mean('t_bookkeeping'):.1f} | {len(spec) / n:.0%} | "
            + " | ".join(f"{x:.2f}" for x in p)
            + " |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
