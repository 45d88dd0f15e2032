"""What planning builders decided, per bench row: chosen budgets and depths, the cost model's fit,
calibration, and the planner's own time (``opt-tree nodes=auto``; any builder whose steps carry a
``PlanNote``). Used by ``treespec.bench.runner`` (the numbers) and ``treespec.bench.report`` (a table and
a plot of tokens/s against the node budget with the budgets auto chose)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from treespec.bench import paired
from treespec.files import savefig_atomic

#: histogram bins of the verified nodes (root excluded) and of the depth: (label, low, high) inclusive
SIZE_BINS = (("0", 0, 0), ("1-3", 1, 3), ("4-7", 4, 7), ("8-15", 8, 15), ("16-31", 16, 31), ("32+", 32, 1 << 30))
DEPTH_BINS = (("0", 0, 0), ("1-2", 1, 2), ("3-5", 3, 5), ("6-9", 6, 9), ("10-15", 10, 15), ("16+", 16, 1 << 30))


def _histogram(values: list[int], bins: tuple[tuple[str, int, int], ...]) -> dict[str, float]:
    n = len(values) or 1
    return {label: sum(lo <= v <= hi for v in values) / n for label, lo, hi in bins}


def summary(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The planning figures of one row's steps, or None if its builder does not plan (no PlanNote)."""
    planned = [s for s in steps if s.get("predicted_seconds") is not None]
    if not planned:
        return None
    wall = sum(s["t_wall"] for s in planned)
    spec = [s for s in planned if s["tree_size"] > 0]
    accepted = statistics.mean(s["accepted"] for s in planned)
    expected = statistics.mean(s["planned_expected"] for s in planned)
    return {
        "mean_nodes": statistics.mean(s["tree_size"] for s in planned),
        "mean_nodes_speculative": statistics.mean(s["tree_size"] for s in spec) if spec else 0.0,
        "mean_depth": statistics.mean(s["depth"] for s in planned),
        "nodes_hist": _histogram([s["tree_size"] for s in planned], SIZE_BINS),
        "depth_hist": _histogram([s["depth"] for s in planned], DEPTH_BINS),
        "plain_share": 1 - len(spec) / len(planned),
        "predicted_ms": 1000 * statistics.mean(s["predicted_seconds"] for s in planned),
        "measured_ms": 1000 * statistics.mean(s["t_wall"] for s in planned),
        "fit_error": statistics.mean(
            abs(s["predicted_seconds"] - s["t_wall"]) / s["t_wall"] for s in planned if s["t_wall"] > 0
        ),
        "planned_expected": expected,
        "accepted": accepted,
        "calibration": expected / accepted if accepted > 0 else None,
        "planner_share": sum(s["plan_seconds"] or 0.0 for s in planned) / wall if wall > 0 else None,
    }


def _bars(hist: dict[str, float]) -> str:
    return " ".join(f"{label}:{share:.0%}" for label, share in hist.items() if share >= 0.005)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: one row per planning configuration (none if there is none)."""
    planned = [r for r in rows if r.get("plan")]
    if not planned:
        return []
    lines = [
        "Planning rows (`nodes=auto`): what each step chose, how well the cost model predicted the step's wall "
        "time, and how well the calibrated E(A) predicted what was accepted:",
        "",
        "| config | nodes: mean (speculative steps) | nodes per step | depth: mean | depth per step | plain steps | "
        "step: predicted / measured (mean abs. error) | calibrated E(A) / accepted | planner's own time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in planned:
        p = r["plan"]
        cal = (
            f"{p['planned_expected']:.2f} / {p['accepted']:.2f} ({p['calibration']:.2f}×)" if p["calibration"] else "–"
        )
        share = f"{p['planner_share']:.1%}" if p["planner_share"] is not None else "–"
        lines.append(
            f"| {r['config'].replace('|', chr(92) + '|')} | {p['mean_nodes']:.1f} ({p['mean_nodes_speculative']:.1f}) | "
            f"{_bars(p['nodes_hist'])} | {p['mean_depth']:.1f} | {_bars(p['depth_hist'])} | {p['plain_share']:.0%} | "
            f"{p['predicted_ms']:.2f} / {p['measured_ms']:.2f} ms ({p['fit_error']:.0%}) | {cal} | {share} |"
        )
    return lines + [""]


def plot(out: Path, result: dict[str, Any], steps: list[dict[str, Any]], budget: Any) -> Path | None:
    """tokens_vs_budget.png: tokens/s of the fixed rows against their node budget, per builder and
    drafter, with each planning row drawn as its tokens/s (a horizontal line) over the histogram of
    the budgets it chose (bars, right axis)."""
    planned = [r for r in result["rows"] if r.get("plan")]
    if not planned:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = [r for r in result["rows"] if r["builder"] and not r.get("plan") and budget(r) is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for builder, drafter in sorted({(r["builder"], r["drafter"]) for r in fixed}):
        pts = sorted(
            (budget(r), r["tokens_per_s"]) for r in fixed if r["builder"] == builder and r["drafter"] == drafter
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{builder} | {drafter}")
    greedy = next((r["tokens_per_s"] for r in result["rows"] if r["config"] in ("hf-greedy", "hf-sample")), None)
    if greedy:
        ax.axhline(greedy, color="black", lw=0.8, ls=":", label="hf-greedy")
    right = ax.twinx()
    top = max([s["tree_size"] for s in steps if s["config"] in {r["config"] for r in planned}] or [1])
    for i, r in enumerate(planned):
        color = f"C{(i + 5) % 10}"
        ax.axhline(r["tokens_per_s"], color=color, lw=1.6, label=f"{r['config']} (its tokens/s)")
        sizes = [s["tree_size"] for s in steps if s["config"] == r["config"]]
        right.hist(sizes, bins=range(0, top + 2), density=True, alpha=0.25, color=color)
    right.set_ylabel("share of steps (auto's budgets)")
    ax.set_xlabel("node budget (nodes / k / total_tokens; auto: verified nodes per step)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"tokens/s vs node budget · {result['dataset']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    path = out / "tokens_vs_budget.png"
    savefig_atomic(fig, path, "--out", dpi=110)
    plt.close(fig)
    return path


def _interval(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float] | None:
    """The paired bootstrap interval of row a's rate over row b's (None for results without per-prompt times)."""
    if "per_prompt" not in a or "per_prompt" not in b:
        return None
    return paired.interval(a["per_prompt"], b["per_prompt"])


def _bounds(bounds: tuple[float, float] | None, lead: str = "; ", close: str = "") -> str:
    """``lead`` + "95% interval lo–hi" + ``close``, or nothing without an interval."""
    return f"{lead}95% interval {paired.span(bounds)}{close}" if bounds is not None else ""


def _near(row: dict[str, Any], bounds: tuple[float, float] | None) -> str:
    """The "within 5% of the best fixed row" verdict, for results with per-prompt times (older ones: nothing).
    The best fixed row is the fastest of several noisy rows, so its rate leans high: a verdict of
    "met" holds despite that, "MISSED" may overstate the gap a little."""
    if "per_prompt" not in row:
        return ""
    return f"; within {1 - paired.NEAR_BEST:.0%}: {paired.verdict(bounds, paired.NEAR_BEST)}"


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per drafter with a planning row: its speed against the best fixed row and greedy, its calibration."""
    lines = []
    greedy = next((r for r in rows if r["config"] in ("hf-greedy", "hf-sample")), None)
    for r in (r for r in rows if r.get("plan")):
        fixed = [
            o for o in rows if o["drafter"] == r["drafter"] and o["builder"] and not o.get("plan") and o["tokens_per_s"]
        ]
        best = max(fixed, key=lambda o: o["tokens_per_s"], default=None)
        parts = [f"- {r['config']}: {r['tokens_per_s']:.0f} tokens/s"]
        if best is not None:
            bounds = _interval(r, best)
            parts.append(
                f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}× the best fixed row ({best['config']}, "
                f"{best['tokens_per_s']:.0f}{_bounds(bounds)}{_near(r, bounds)})"
            )
        if greedy and greedy["tokens_per_s"]:
            parts.append(
                f"{r['tokens_per_s'] / greedy['tokens_per_s']:.2f}× {greedy['config']}{_bounds(_interval(r, greedy), ' (', ')')}"
            )
        p = r["plan"]
        if p["calibration"]:
            parts.append(f"calibrated E(A) {p['calibration']:.2f}× accepted")
        if p["planner_share"] is not None:
            parts.append(f"planner's own time {p['planner_share']:.1%} of a step")
        lines.append(", ".join(parts))
    return lines
