"""What a fresh process's default decodes do with the quick cost measurement it starts from.

    python examples/first_decode.py --target smollm2 [--quick-sizes 0,1,4,16,48 --quick-repeats 1]

Run it several times: each run is a new process, so ``opt-tree nodes=auto`` starts from its own quick
measurement (``treespec.cost_measure.quick``, taken when the Decoder is created; a profile saved with
``treespec profile`` is not read: profiles are looked up in an empty temporary directory). It decodes four MT-Bench first turns (one in every
twenty, 128 new tokens) with the target's default configuration and prints the tokens per second, τ,
the share of steps by tree size (4: four nodes or more), and T(0) … T(4) (verification plus
bookkeeping, ms) as measured and as the decodes left them. ``--quick-sizes`` / ``--quick-repeats`` replace the measured sizes
and repeats (``0,1,4,16,48`` and ``1``: the quick measurement before 2026-11-28) to compare the two.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time

import numpy as np
import torch

import treespec
from treespec import cost_measure, defaults
from treespec.bench.datasets import format_turns, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=defaults.MAIN)
    ap.add_argument("--quick-sizes", default=None, help="comma-separated node counts (default: QUICK_VERIFY)")
    ap.add_argument("--quick-repeats", type=int, default=None, help="measurements per size (default: QUICK_REPEATS)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick_sizes:
        cost_measure.QUICK_VERIFY = tuple(int(n) for n in args.quick_sizes.split(","))
    if args.quick_repeats:
        cost_measure.QUICK_REPEATS = args.quick_repeats
    os.environ["TREESPEC_PROFILE_DIR"] = tempfile.mkdtemp()  # no saved profile: the quick measurement is what runs
    target = treespec.TargetModel.load(args.target)
    dec = treespec.Decoder(
        target, drafter=defaults.drafter_for(args.target), builder="opt-tree", builder_options={"nodes": "auto"}
    )
    cost = dec.builder.planner.cost  # measured when the Decoder was created

    def t_table() -> np.ndarray:  # T(0) … T(4), verification plus bookkeeping, ms
        return np.round(1e3 * (np.array(cost.verify.table(4)) + np.array(cost.bookkeeping.table(4))), 1)

    measured = t_table()
    prompts = [format_turns(target.tokenizer, it, []) for it in load_prompts("mt-bench", limit=80)[5::20]]
    began, steps, tokens = time.perf_counter(), [], 0
    for ids in prompts:
        out = dec.generate(ids, max_new_tokens=128)
        steps += out.stats.steps
        tokens += len(out.token_ids)
    wall = time.perf_counter() - began
    sizes = collections.Counter(min(s.tree_size, 4) for s in steps)
    print(
        f"tokens/s {tokens / wall:.1f}, tau {tokens / len(steps):.2f}, steps by tree size "
        + ", ".join(f"{n}: {c / len(steps):.0%}" for n, c in sorted(sizes.items()))
    )
    print(f"T(0..4), ms: as measured {measured}, after the decodes' refinement {t_table()}")


if __name__ == "__main__":
    main()
