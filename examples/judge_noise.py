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

from ab_rows import compare, setup

import treespec
from treespec.plugins import probe


def main() -> None:
    args, target, drafter, items = setup(limit=32)

    def judged(z: float):  # a Decoder of its own (its planner learns on its own), its judge's Z_NOISE
        dec = treespec.Decoder(target, drafter=drafter, builder="opt-tree", builder_options={"nodes": "auto"})

        def run(ids: list[int]):
            probe.Z_NOISE = z
            return dec.generate(ids, max_new_tokens=args.max_new_tokens)

        return run

    compare(target, items, {"noise test": judged(probe.Z_NOISE), "point estimate": judged(0.0)}, args.max_new_tokens)


if __name__ == "__main__":
    main()
