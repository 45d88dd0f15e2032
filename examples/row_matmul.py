"""What the few-row products (``treespec.row_matmul``) change in a target's forward, on this machine.

    python examples/row_matmul.py --target smollm2 --threads 2 --rows 1,2,3,4,5,8,12,13,16,32

For each row count R: one forward of R new tokens behind a cache of ``--past`` tokens (a causal mask
over them, as a chain of R − 1 drafted nodes is verified), torch's own product vs the W·Xᵀ form,
the two interleaved rep by rep so that a change in the machine's load hits both alike; prints the
medians as a Markdown table, and the largest difference between the two forwards' logits.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from treespec.kv import crop_cache
from treespec.row_matmul import SIZES, RowMatmul
from treespec.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,8,12,13,16,32")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target)
    model = target.model
    rows = RowMatmul(model)
    on = (True,) * len(SIZES)
    cache = DynamicCache(config=model.config)
    ids = (torch.arange(args.past)[None] * 31 + 7) % target.vocab_size  # [1, P] arbitrary tokens
    with torch.inference_mode():
        model(input_ids=ids, **{target.cache_keyword: cache}, use_cache=True)
    print(f"{args.target}, {args.threads} thread(s), {args.past} cached tokens, medians of {args.repeats}\n")
    print("| rows | torch's product (ms) | W·Xᵀ (ms) | ratio | max abs. logit difference |")
    print("|---|---|---|---|---|")
    for r in (int(v) for v in args.rows.split(",")):
        x = (torch.arange(r)[None] * 17 + 5) % target.vocab_size  # [1, R]
        pos = torch.arange(args.past, args.past + r)[None]  # [1, R]
        mask = torch.zeros(1, 1, r, args.past + r)  # [1, 1, R, P+R] causal among the new rows
        mask[..., args.past :] = torch.triu(torch.full((r, r), torch.finfo(torch.float32).min), 1)
        times: dict[str, list[float]] = {"stock": [], "rows": []}
        logits = {}
        for rep in range(args.repeats + 1):
            for name in ("stock", "rows"):
                with torch.inference_mode(), rows.installed(on if name == "rows" else None):
                    began = time.perf_counter()
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
        stock, fast = (sorted(times[k])[len(times[k]) // 2] * 1e3 for k in ("stock", "rows"))
        diff = (logits["stock"] - logits["rows"]).abs().max().item()
        print(f"| {r} | {stock:.1f} | {fast:.1f} | {fast / stock:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
