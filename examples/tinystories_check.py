"""Acceptance and exactness on real TinyStories prompts, until `treespec bench` (issue 3) exists.

    python examples/tinystories_check.py --prompts 20 --max-new-tokens 128 -B nodes=50

Runs the Decoder (stories260K target, its first 4 layers as draft, opt-tree by default) on the first N
validation stories (each cut to its first 12 words), checks every output against the target's own
`generate(do_sample=False)`, and prints τ and tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import treespec
from treespec.config import parse_pairs

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=20)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--builder", default="opt-tree")
parser.add_argument("-B", action="append", default=[], help="builder option name=value")
parser.add_argument("--layers", type=int, default=4, help="draft = the target's first k layers")
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(args.threads)

model = str(SHARED / "models" / "stories260K")
dec = treespec.Decoder(model, drafter=model, drafter_options={"layers": args.layers},
                       builder=args.builder, builder_options=parse_pairs(args.B, "builder"))
stories = [s for s in (SHARED / "prompts" / "tinystories_val.txt").read_text().split("\n\n") if s.strip()]
taus, exact, spec_time, greedy_time, tokens = [], 0, 0.0, 0.0, 0
phase = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0, "prefill": 0.0}
for story in stories[: args.prompts]:
    ids = dec.encode(" ".join(story.split()[:12]))
    out = dec.generate(ids, max_new_tokens=args.max_new_tokens)
    t = time.perf_counter()
    with torch.inference_mode():
        ref = dec.target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=args.max_new_tokens)
    greedy_time += time.perf_counter() - t
    exact += out.token_ids == ref[0, len(ids):].tolist()
    taus.append(out.stats.mean_accepted)
    spec_time += out.stats.t_total
    d = out.stats.to_dict()
    for key in phase:
        phase[key] += d[f"t_{key}"]
    tokens += len(out.token_ids)
print(f"builder {args.builder} {parse_pairs(args.B, 'builder')} draft layers {args.layers}: "
      f"identical to greedy generate {exact}/{len(taus)}; τ mean {statistics.mean(taus):.2f} "
      f"(min {min(taus):.2f}, max {max(taus):.2f}); {tokens / spec_time:.0f} tokens/s vs "
      f"generate {tokens / greedy_time:.0f} tokens/s; time: "
      + ", ".join(f"{k} {v / spec_time:.0%}" for k, v in phase.items()))
