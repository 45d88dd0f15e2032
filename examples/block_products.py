"""Time the compiled few-row product reading a GGUF target's float32 weights against reading its
blocks (``treespec.gguf_blocks``), over every matrix of the model, and check every output's bits.

    python examples/block_products.py --target smollm2 --rows 1,2,4,8,16

Both products run in one process, interleaved matrix set by matrix set; each size prints the median
of --repeats passes over all matrices. The float pass multiplies a copy of each weight (no blocks
attached to it), so the two read different memory but compute on the same numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import treespec
from treespec import native_matmul, weight_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.TargetModel.load(args.target)
    weights = [m.weight for m in target.row_matmul.layers if weight_blocks.find(m.weight) is not None]
    if not weights:
        raise SystemExit(f"{args.target}: no weight reads GGUF blocks (not a quantised GGUF, or no C compiler)")
    floats = [w.detach().clone() for w in weights]  # the same numbers, nothing attached
    kinds = sorted({weight_blocks.KINDS[weight_blocks.find(w).kind][0] for w in weights})
    mb = sum(b.q.nbytes + b.d.nbytes + b.m.nbytes for b in map(weight_blocks.find, weights)) / 1e6
    print(
        f"{len(weights)} matrices ({', '.join(kinds)}): {mb:.0f} MB of blocks, "
        f"{sum(w.nbytes for w in floats) / 1e6:.0f} MB of float32; {args.threads} threads"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            g = torch.Generator().manual_seed(rows)
            xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in weights}}
            same = all(
                torch.equal(native_matmul.linear(xs[w.shape[1]], w), native_matmul.linear(xs[f.shape[1]], f))
                for w, f in zip(weights, floats)
            )
            times: dict[str, list[float]] = {"float32": [], "blocks": []}
            for _ in range(args.repeats):
                for name, mats in (("float32", floats), ("blocks", weights)):
                    began = time.perf_counter()
                    for w in mats:
                        native_matmul.linear(xs[w.shape[1]], w)
                    times[name].append(time.perf_counter() - began)
            f, b = (statistics.median(times[n]) * 1e3 for n in ("float32", "blocks"))
            print(
                f"{rows:3d} rows: float32 {f:6.2f} ms  blocks {b:6.2f} ms  ({f / b:.2f}x)  "
                f"outputs {'equal bit for bit' if same else 'DIFFER'}"
            )


if __name__ == "__main__":
    main()
