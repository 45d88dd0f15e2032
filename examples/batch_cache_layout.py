"""Measure the two ways to keep a batch's KV cache when rows accept different numbers of tokens.

    python examples/batch_cache_layout.py [--target treespec-py] [--batch 16] [--steps 40]

A batched step verifies every row's tree in one forward and each row keeps its root plus m_b accepted
nodes (m_b differs by row). The cache must then hold, for every row, its committed tokens followed by
room for the next step's tree block:

- **per-row lengths** (treespec's ``BatchTarget``): row b's committed rows sit at 0..len_b − 1, holes up
  to S = max len are masked; after a step row b copies its 1 + m_b kept rows from the tree block to
  len_b.. (``kv.move_cache_rows``: one gather and one scatter per layer for all rows), then the cache
  is cut to the new longest row. Cost per step: O(Σ_b (1 + m_b)) rows copied.
- **left padding** (Hugging Face's batched ``generate``): every row ends at the same column, so the
  tree block can follow it; after a step with different m_b, row b's kept rows must end at the common
  end: its whole cache shifts right by (max m − m_b) columns (or every other row's prefix moves), a copy
  of every layer's whole [B, H_kv, S, D] cache each step (done here as one gather per tensor).

Both layouts mask the same number of empty columns on average (holes vs left pads), so the attention
reads the same S keys per row; the difference is the copying, measured here on a cache shaped like the
target's (its layers, KV heads, head size, dtype), with the rows' acceptance drawn from 0..max_accept.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="treespec-py")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=300, help="committed tokens per row at the start")
    ap.add_argument("--tree", type=int, default=5, help="nodes per row's tree block")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from treespec.kv import move_cache_rows
    from treespec.models import load_causal_lm

    cfg = load_causal_lm(args.target).config
    layers, heads = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    b, n, gen = args.batch, args.tree, torch.Generator().manual_seed(0)
    accepts = torch.randint(0, n, (args.steps, b), generator=gen)  # [steps, B] accepted nodes per row

    from treespec.kv import crop_cache
    from treespec.slack_cache import slack_cache

    def block() -> torch.Tensor:
        return torch.randn(b, heads, n, dim)  # [B, H_kv, N, D] a tree block's keys or values

    def per_row() -> float:
        cache, lens = slack_cache(), torch.full((b,), args.prompt)
        for i in range(layers):
            cache.update(torch.randn(b, heads, args.prompt, dim), torch.randn(b, heads, args.prompt, dim), i)
        blocks = [(block(), block()) for _ in range(layers)]
        t0 = time.perf_counter()
        for m in accepts:
            s = int(lens.max())
            for i, (k, v) in enumerate(blocks):  # the step's tree block is appended (in place)
                cache.update(k, v, i)
            keep = 1 + m  # [B] root + accepted
            rows = torch.repeat_interleave(torch.arange(b), keep)
            src = s + torch.cat([torch.arange(int(k)) for k in keep])  # a chain's first k nodes of the block
            dst = torch.cat([torch.arange(int(lo), int(lo + k)) for lo, k in zip(lens, keep)])
            move_cache_rows(cache, rows, src, dst)  # each row's kept rows into place
            lens = lens + keep
            crop_cache(cache, int(lens.max()))  # cut to the longest row
        return (time.perf_counter() - t0) / len(accepts)

    def left_padded() -> float:
        keys = [torch.randn(b, heads, args.prompt, dim) for _ in range(layers)]  # [B, H_kv, S, D] per layer
        values = [torch.randn(b, heads, args.prompt, dim) for _ in range(layers)]
        blocks = [(block(), block()) for _ in range(layers)]
        width = args.prompt
        t0 = time.perf_counter()
        for m in accepts:
            keep = 1 + m  # [B]
            top = int(keep.max())
            # every row's kept rows must end at the common end: new column j of row r is old column
            # j - (top - keep_r) of [committed | tree block] (left of 0: padding): one gather per tensor
            col = torch.arange(width + top)[None, :] - (top - keep)[:, None]  # [B, S'] source column
            src = col.clamp(min=0)[:, None, :, None].expand(b, heads, width + top, dim)  # [B, H, S', D]
            for i, (k, v) in enumerate(blocks):
                keys[i] = torch.cat([keys[i], k], dim=2).gather(2, src)  # the block appended, then re-aligned
                values[i] = torch.cat([values[i], v], dim=2).gather(2, src)
            width += top
        return (time.perf_counter() - t0) / len(accepts)

    per_row(), left_padded()  # warm up
    a, c = per_row(), left_padded()
    print(
        f"target {args.target}: {layers} layers x {heads} KV heads x {dim}, batch {b}, prompt {args.prompt}, "
        f"tree {n}, {args.steps} steps"
    )
    print(f"per-row lengths: {a * 1e3:.2f} ms per step; left padding: {c * 1e3:.2f} ms per step ({c / a:.1f}x)")


if __name__ == "__main__":
    main()
