"""Plot a target's measured cost curve T(n)/T(0) and its drafter's expansion cost from a profile.

    treespec profile --target smollm2 --out docs/bench/smollm2-cost/profile.json
    python examples/cost_curve.py docs/bench/smollm2-cost/profile.json docs/bench/smollm2-cost/cost_curve.png

T(n) is one verification of n drafted nodes (the root excluded) — the target's tree forward plus the
bookkeeping around it — as `treespec profile` measures it (median of its repeats). The draft side
is one expansion of m nodes (one head forward and its top-k). Prints the table the plot shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from treespec.cost import CostModel  # noqa: E402


def main(profile: str, out: str) -> None:
    model = CostModel.from_json(Path(profile).read_text())
    v, b, e = model.verify, model.bookkeeping, model.expand
    seen = [i for i, c in enumerate(v.counts) if c > 0]
    xs = [v.xs[i] for i in seen]
    ms = [1000 * (v.ys[i] + b.ys[i]) for i in seen]
    base = ms[xs.index(0)] if 0 in xs else ms[0]
    print(f"target {model.key.get('target')}  drafter {model.key.get('drafter')}  threads {model.key.get('threads')}")
    print("| n drafted | verify ms | T(n)/T(0) |\n|---|---|---|")
    for x, m in zip(xs, ms):
        print(f"| {x} | {m:.1f} | {m / base:.2f} |")
    eseen = [i for i, c in enumerate(e.counts) if c > 0]
    print("| m expanded | expand ms |\n|---|---|")
    for i in eseen:
        print(f"| {e.xs[i]} | {1000 * e.ys[i]:.1f} |")
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(xs, [m / base for m in ms], "o-")
    ax[0].set_xlabel("drafted nodes n (root excluded)")
    ax[0].set_ylabel("T(n) / T(0)")
    ax[0].set_title(f"verification, T(0) = {base:.0f} ms")
    ax[0].grid(alpha=0.3)
    ax[1].plot([e.xs[i] for i in eseen], [1000 * e.ys[i] for i in eseen], "o-", color="C1")
    ax[1].set_xlabel("nodes expanded in one call m")
    ax[1].set_ylabel("ms")
    ax[1].set_title("draft expansion (one head forward + top-k)")
    ax[1].grid(alpha=0.3)
    fig.suptitle(f"{Path(str(model.key.get('target', ''))).name}: cost on this machine")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
