"""What the few-row products (``treespec.row_matmul``) change in a target's forward, on this machine.

    python examples/row_matmul.py --target smollm2 --threads 2 --rows 1,2,3,4,5,8,12,13,16,32

For each row count R: one forward of R new tokens behind a cache of ``--past`` tokens (a causal mask
over them, as a chain of R − 1 drafted nodes is verified), torch's own product vs the W·Xᵀ form,
the two interleaved rep by rep so that a change in the machine's load hits both alike; prints the
medians as a Markdown table, and the largest difference between the two forwards' logits.

    python examples/row_matmul.py --target smollm2 --compare lean --rows 1,2,4,8,16

compares instead the model's own forward with the lean one a target verifies trees with
(``treespec.lean.lean_target``), both with the products the machine's verdict picks, and

    python examples/row_matmul.py --target smollm2 --compare packed --rows 1,2,3,4,5,8,16

torch's product with MKL's packed one (``treespec.packed_matmul``; the weights packed for the padded
row count on each size's warm-up forward, not after a run's ``USES_BEFORE_PACKING`` uses);
``--compare native`` the product compiled on this machine (``treespec.native_matmul``).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from treespec import packed_matmul
from treespec.kv import crop_cache
from treespec.lean import LeanCausalLM
from treespec.row_matmul import SIZES, RowMatmul
from treespec.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,8,12,13,16,32")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--compare", choices=("rows", "packed", "native", "lean"), default="rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target)
    model = target.model
    rows = RowMatmul(model)
    on = (args.compare,) * len(SIZES)  # W·Xᵀ, the packed or the compiled product at every size
    packed_matmul.USES_BEFORE_PACKING = 1  # the packed product from each size's warm-up on, not a run's 16th use
    cache = DynamicCache(config=model.config)
    ids = (torch.arange(args.past)[None] * 31 + 7) % target.vocab_size  # [1, P] arbitrary tokens
    with torch.inference_mode():
        model(input_ids=ids, **{target.cache_keyword: cache}, use_cache=True)
    names = ("model", "lean") if args.compare == "lean" else ("stock", args.compare)
    heads = {
        "rows": ("torch's product", "W·Xᵀ"),
        "packed": ("torch's product", "packed"),
        "native": ("torch's product", "compiled here"),
        "lean": ("the model's forward", "lean forward"),
    }[args.compare]
    lean = LeanCausalLM(model, fuse=False) if args.compare == "lean" else None
    print(f"{args.target}, {args.threads} thread(s), {args.past} cached tokens, medians of {args.repeats}\n")
    print(f"| rows | {heads[0]} (ms) | {heads[1]} (ms) | ratio | max abs. logit difference |")
    print("|---|---|---|---|---|")
    for r in (int(v) for v in args.rows.split(",")):
        x = (torch.arange(r)[None] * 17 + 5) % target.vocab_size  # [1, R]
        pos = torch.arange(args.past, args.past + r)[None]  # [1, R]
        mask = torch.zeros(1, 1, r, args.past + r)  # [1, 1, R, P+R] causal among the new rows
        mask[..., args.past :] = torch.triu(torch.full((r, r), torch.finfo(torch.float32).min), 1)
        times: dict[str, list[float]] = {name: [] for name in names}
        logits = {}
        for rep in range(args.repeats + 1):
            for name in names:
                products = rows.installed(on if name == args.compare else None) if lean is None else rows.applied()
                with torch.inference_mode(), products:
                    began = time.perf_counter()
                    if name == "lean":
                        out = lean(input_ids=x, position_ids=pos, attention_mask=mask, cache=cache)
                    else:
                        out = model(
                            input_ids=x,
                            position_ids=pos,
                            attention_mask=mask,
                            **{target.cache_keyword: cache},
                            use_cache=True,
                        )
                    took = time.perf_counter() - began
                crop_cache(cache, args.past)
                if rep:  # the first of each is a warm-up
                    times[name].append(took)
                logits[name] = out.logits
        stock, fast = (sorted(times[k])[len(times[k]) // 2] * 1e3 for k in names)
        diff = (logits[names[0]] - logits[names[1]]).abs().max().item()
        print(f"| {r} | {stock:.1f} | {fast:.1f} | {fast / stock:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
