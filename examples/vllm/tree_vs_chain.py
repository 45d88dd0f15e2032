"""The exported vLLM tree against a chain of as many nodes, measured in treespec (vLLM 0.32 has no trees).

    python examples/vllm/tree_vs_chain.py --export serve/vllm --limit 20 --max-new-tokens 128

Reads the export's plan.json (`treespec export vllm --acceptance ...`), decodes the same MT-Bench
first turns greedily with treespec's `static` builder on the vLLM tree and on a chain of the same
node count (the head as vLLM drafts it: the full vocabulary), and prints τ (mean acceptance length
per step) for both beside plan.json's prediction. Greedy verification accepts exactly the target's
own tokens, so τ depends on the drafts and the tree only, not on the engine that runs them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="a `treespec export vllm --acceptance ...` folder")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    import treespec
    from treespec.bench.datasets import format_turns, load_prompts

    torch.set_num_threads(args.threads)
    plan = json.loads((Path(args.export) / "plan.json").read_text())["plan"]
    tree = plan["vllm_tree"]
    shapes = {"vllm tree": tree["paths"], f"chain of {tree['nodes']}": [[0] * d for d in range(1, tree["nodes"] + 1)]}
    results = {}
    for name, paths in shapes.items():
        dec = treespec.Decoder(
            args.target,
            drafter="eagle",
            drafter_options={"vocab": 0, "head": str(Path(args.export))},
            builder="static",
            builder_options={"shape": json.dumps(paths)},
        )
        steps = accepted = 0
        for item in load_prompts("mt-bench", None, args.limit):
            out = dec.generate(format_turns(dec.target.tokenizer, item, []), max_new_tokens=args.max_new_tokens)
            steps += len(out.stats.steps)
            accepted += sum(s.accepted for s in out.stats.steps)
        results[name] = 1 + accepted / steps
        print(f"{name}: τ = {results[name]:.3f} over {steps} steps", flush=True)
    print(json.dumps({"predicted_tau": {"vllm tree": tree["tau"]}, "measured_tau": results}))


if __name__ == "__main__":
    main()
