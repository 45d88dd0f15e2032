"""Bench outputs: the terminal table, results.json, steps.jsonl, PNG plots, and docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from treespec.bench import paired, planning
from treespec.files import savefig_atomic, write_text_atomic, writing

BUDGET_KEYS = ("nodes", "total_tokens", "k")  # the option that is a builder's node budget


def environment() -> dict[str, Any]:
    import torch
    import transformers

    import treespec
    from treespec import threads
    from treespec.devices import cpu_name

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "treespec": treespec.__version__,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "threads_follow_load": threads.enabled(),  # every row's, baselines' too (treespec/threads.py)
    }


def budget(row: dict[str, Any]) -> float | None:
    """A builder row's node budget: its nodes / total_tokens / k option, the size of a static shape,
    else (no fixed budget, e.g. ``nodes=auto``) the measured mean tree size."""
    for key in BUDGET_KEYS:
        if key in (row.get("options") or {}) and str(row["options"][key]) != "auto":
            return float(row["options"][key])
    if row.get("builder") == "static" and "shape" in (row.get("options") or {}):
        try:
            from treespec.plugins.static import load_shape

            return float(len(load_shape(row["options"]["shape"])))
        except Exception:  # a shape file that is gone: fall back to the measured size
            pass
    if row.get("builder") and row.get("mean_tree_size"):
        return float(round(row["mean_tree_size"]))
    return None


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def speedup_cell(row: dict[str, Any]) -> str:
    """× greedy, with its paired 95% interval over prompts where the results have one (bench/paired.py)."""
    if row.get("speedup") is None:
        return _fmt(None)
    return paired.cell(row["speedup"], row.get("speedup_interval"))


COLUMNS = [
    ("config", "config", "s"),
    ("τ", "tau", ".2f"),
    ("tokens/s", "tokens_per_s", ".0f"),
    ("× greedy", "speedup", ".2f"),
    ("× assisted", "speedup_vs_assisted", ".2f"),
    ("lossless", "lossless", ""),
    ("corr E(A),A", "corr_ea_a", ".2f"),
    ("bookkeeping", "share_bookkeeping", ".1%"),
]


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{result['dataset']} · {result['prompts']} prompts · {result['max_new_tokens']} new tokens · {result['target']}"
    )
    for title, _, _ in COLUMNS:
        table.add_column(title, justify="left" if title == "config" else "right", no_wrap=True)
    for row in result["rows"]:
        cells = {"config": row["config"], "speedup": speedup_cell(row)}
        table.add_row(*[cells.get(key) or _fmt(row.get(key), spec) for _, key, spec in COLUMNS])
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)
    for line in targets(result):
        console.print(line)


def write_results(out: Path, result: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    """results.json and steps.jsonl, each written atomically (``treespec.files``: a failed write is a
    ``ConfigError`` and leaves the last complete file)."""
    with writing(out, "--out"):
        out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(result, indent=1, default=str) + "\n", "--out")
    write_text_atomic(out / "steps.jsonl", "".join(json.dumps(s) + "\n" for s in steps), "--out")


def write_outputs(out: Path, result: dict[str, Any], steps: list[dict[str, Any]]) -> list[Path]:
    write_results(out, result, steps)
    return plot(out, result, steps)


def plot(out: Path, result: dict[str, Any], steps: list[dict[str, Any]]) -> list[Path]:
    """τ against node budget per builder; E(A) against accepted length (OPT-Tree, Fig. 4); accepted lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [_plot_tau(plt, out, result)]
    configs = [r["config"] for r in result["rows"] if r["builder"]]
    by_config: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for s in steps:
        by_config.setdefault(s["config"], []).append(s)
    if configs:
        files += [_plot_ea(plt, out, configs, by_config), _plot_accepted(plt, out, configs, by_config, steps)]
    budgets = planning.plot(out, result, steps, budget)
    return files + ([budgets] if budgets else [])


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    savefig_atomic(fig, path, "--out", dpi=110)
    plt.close(fig)
    return path


def _plot_tau(plt: Any, out: Path, result: dict[str, Any]) -> Path:
    rows = [r for r in result["rows"] if r["builder"] and budget(r) is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for builder, drafter in sorted({(r["builder"], r["drafter"]) for r in rows}):
        pts = sorted((budget(r), r["tau"]) for r in rows if r["builder"] == builder and r["drafter"] == drafter)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{builder} | {drafter}")
    ax.set_xlabel("node budget (nodes / k)")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title(f"τ vs node budget · {result['dataset']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, out / "tau_vs_budget.png")


def _plot_ea(plt: Any, out: Path, configs: list[str], by_config: dict[str, list[dict[str, Any]]]) -> Path:
    cols = min(3, len(configs))
    nrows = (len(configs) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.4 * nrows), squeeze=False)
    for ax, c in zip(axes.flat, configs):
        xs = [s["expected_accepted"] for s in by_config[c]]
        ys = [s["accepted"] for s in by_config[c]]
        if xs:
            top = max(max(xs), max(ys)) + 1
            ax.hist2d(xs, ys, bins=[20, range(int(top) + 2)], cmap="Blues")
            ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--")
        ax.set_title(c, fontsize=7)
        ax.set_xlabel("E(A) = Σ p̂")
        ax.set_ylabel("accepted draft tokens")
    for ax in list(axes.flat)[len(configs) :]:
        ax.axis("off")
    return _save(plt, fig, out / "ea_vs_accepted.png")


def _plot_accepted(
    plt: Any, out: Path, configs: list[str], by_config: dict[str, list[dict[str, Any]]], steps: list[dict[str, Any]]
) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max((s["accepted"] for s in steps), default=0) + 2
    for c in configs:
        ax.hist([s["accepted"] for s in by_config[c]], bins=range(top), histtype="step", density=True, label=c)
    ax.set_xlabel("accepted draft tokens per step")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=6)
    return _save(plt, fig, out / "accepted_hist.png")


def targets(result: dict[str, Any]) -> list[str]:
    """The benchmark targets of the issues, checked on these numbers: opt-tree's τ against every other
    builder at an equal or larger node budget (a loss counts as a miss only at an equal one), our chain against assisted generation at the same k,
    the bookkeeping share, exactness."""
    lines = []
    rows = result["rows"]
    for drafter in sorted({r["drafter"] for r in rows if r["builder"]}):
        mine = [r for r in rows if r["drafter"] == drafter]
        opt = [
            r
            for r in mine
            if r["builder"] == "opt-tree" and (r.get("options") or {}).get("nodes") != "auto" and budget(r) is not None
        ]
        for other in (r for r in mine if r["builder"] not in (None, "opt-tree") and budget(r) is not None):
            same = [r for r in opt if budget(r) <= budget(other)]
            if not same:
                lines.append(
                    f"- not measured: no opt-tree row with ≤ {budget(other):g} nodes to compare with {other['config']}"
                )
                continue
            best = max(same, key=lambda r: (budget(r), r["tau"]))
            gap = best["tau"] - other["tau"]
            # the target is "at equal budget": a smaller opt-tree that wins meets it a fortiori; one that
            # loses to a larger tree says nothing about it
            verdict = "met" if gap >= 0 else "MISSED" if budget(best) == budget(other) else "not at equal budget"
            lines.append(
                f"- {verdict}: τ {best['config']} = {best['tau']:.2f} vs {other['config']} = "
                f"{other['tau']:.2f} ({gap:+.2f}; {budget(best):g} vs {budget(other):g} nodes)"
            )
        for chain in (r for r in mine if r["builder"] == "chain"):
            a = next((r for r in rows if r["config"] == chain.get("assisted_config")), None)
            if a is not None:
                ok = chain["tokens_per_s"] >= a["tokens_per_s"]
                lines.append(
                    f"- {'met' if ok else 'MISSED'}: {chain['config']} {chain['tokens_per_s']:.0f} tokens/s vs "
                    f"{a['config']} {a['tokens_per_s']:.0f} tokens/s"
                )
    for r in rows:
        share = r.get("share_bookkeeping")
        if share is not None and share >= 0.10:
            lines.append(f"- MISSED: bookkeeping {share:.1%} ≥ 10% of the step for {r['config']}")
    shares = [r["share_bookkeeping"] for r in rows if r.get("share_bookkeeping") is not None]
    if shares:
        lines.append(f"- bookkeeping share of a step: {min(shares):.1%} – {max(shares):.1%} (aim: under 10%)")
    lines += planning.target_lines(rows)
    lines += category_lines(result)
    lossy = [r["config"] for r in rows if r["lossless"] is False]
    if all(r["lossless"] is None for r in rows):  # sampling: exact in distribution, not token for token
        lines.append(
            "- lossless: not compared token for token under sampling (exactness in distribution: docs/sampling.md)"
        )
    else:
        lines.append(f"- lossless: {'every row' if not lossy else 'NOT ' + ', '.join(lossy)}")
    return lines


def category_lines(result: dict[str, Any]) -> list[str]:
    """Per category (Spec-Bench's, MT-Bench's), × the reference row with its paired interval over that
    category's prompts: the planning rows (the default configuration) and the category's best row."""
    cats = result.get("prompt_categories") or []
    rows = [r for r in result["rows"] if "per_prompt" in r]
    ref = next((r for r in rows if r["config"] in ("hf-greedy", "hf-sample")), None)
    if len(set(cats)) < 2 or ref is None or any(len(r["per_prompt"]) != len(cats) for r in rows):
        return []
    lines, others = [], [r for r in rows if r is not ref]
    for cat in dict.fromkeys(cats):
        picks = [i for i, c in enumerate(cats) if c == cat]
        base = [ref["per_prompt"][i] for i in picks]
        mine = {r["config"]: [r["per_prompt"][i] for i in picks] for r in others}  # this category's pairs
        ratios = {name: paired.ratio(pairs, base) or 0.0 for name, pairs in mine.items()}
        best = max(others, key=lambda r: ratios[r["config"]], default=None)
        shown = [r for r in others if r.get("plan")] + ([best] if best is not None and not best.get("plan") else [])
        cells = []
        for r in shown:
            bounds = paired.interval(mine[r["config"]], base)
            cells.append(f"{r['config']} {ratios[r['config']]:.2f}" + (f" ({paired.span(bounds)})" if bounds else ""))
        lines.append(f"- {cat} ({len(picks)} prompts), × {ref['config']}: " + "; ".join(cells))
    return lines


def markdown(results: list[tuple[Path, dict[str, Any]]], doc_dir: Path, out: Path | None = None) -> str:
    """The benchmarks page; its regenerate hint names ``out`` (default: docs/benchmarks.md)."""
    target = os.path.relpath(out, Path.cwd()) if out is not None else "docs/benchmarks.md"
    parts = [
        "# Benchmarks",
        "",
        "Generated by `treespec bench-report` from the `results.json` of each run below; do not edit by hand.",
        "Each section gives the exact command that produced its numbers. τ = new tokens per target forward",
        "(bonus token included; Hugging Face rows count `generate`'s own forward calls). Speed-ups are over the",
        "target's plain greedy `generate` (`hf-greedy`) and over Hugging Face assisted generation with the same",
        "draft model, measured in the same run on the same prompts, interleaved prompt by prompt. `lossless` = every",
        "output equals `hf-greedy`'s token for token. Runs since 2026-11-27 17:30 give `× greedy` with its paired 95%",
        "interval over prompts in parentheses (a bootstrap of the prompts, each prompt's rows run back to back:",
        '`treespec/bench/paired.py`), and read issue 28\'s "within 5% of the best fixed row" as met, MISSED or',
        "undecided against that interval: this machine's speed swings more than 5% between minutes.",
        "",
        "Regenerate this page from the runs' results: `treespec bench-report "
        + " ".join(os.path.relpath(p.parent, Path.cwd()) for p, _ in results)
        + f" --out {target}`.",
        "",
    ]
    for path, res in results:
        parts += _section(path, res, os.path.relpath(path.parent, doc_dir))
    return "\n".join(parts).rstrip() + "\n"


def _section(path: Path, res: dict[str, Any], rel: str) -> list[str]:
    """One run's section: its heading, command and machine, its table, and (single-sequence runs) the
    planning table, the targets checked, the hand-written NOTES.md beside it and its plots."""
    parts = _section_head(res, rel)
    notes = path.parent / "NOTES.md"  # hand-written reading of this run, kept beside its results
    if res.get("mode") == "batch":  # throughput mode: treespec.bench.batch_runner
        from treespec.bench.batch_runner import markdown_rows, target_lines

        parts += [*markdown_rows(res["rows"]), ""]
        if any("per_batch" in r for r in res["rows"]):  # runs with per-batch times: auto against the best row
            parts += ["`nodes=auto` against the best fixed row at each batch size:", "", *target_lines(res["rows"]), ""]
        if notes.is_file():
            parts += [notes.read_text().strip(), ""]
        if (path.parent / "throughput_vs_batch.png").exists():
            parts += [f"![throughput_vs_batch.png]({rel}/throughput_vs_batch.png)", ""]
        return parts
    parts += [*_rows_table(res["rows"]), "", *planning.table(res["rows"]), "Targets:", "", *targets(res), ""]
    if notes.is_file():
        parts += [notes.read_text().strip(), ""]
    for png in ("tau_vs_budget.png", "tokens_vs_budget.png", "ea_vs_accepted.png", "accepted_hist.png"):
        if (path.parent / png).exists():
            parts.append(f"![{png}]({rel}/{png})")
    return parts + [""]


def _section_head(res: dict[str, Any], rel: str) -> list[str]:
    env = res["environment"]
    return [
        f"## {res['dataset']}{' / ' + res['category'] if res.get('category') else ''}: {res['prompts']} prompts, "
        f"{res['max_new_tokens']} new tokens, target {res['target']}"
        + (" (PARTIAL: the run stopped before its last prompt)" if res.get("partial") else "")
        + (f", temperature {res['temperature']}" if res.get("temperature") else "")
        + (f", {res['background_load']} busy process(es) beside it" if res.get("background_load") else "")
        + f" (`{rel}`)",
        "",
        "```bash",
        res["command"],
        "```",
        "",
        f"{env['date']} · {env['cpu']} · {env['threads']} torch thread(s)"
        + (", following the load" if env.get("threads_follow_load") else "")
        + f" · Python {env['python']} · "
        f"torch {env['torch']} · transformers {env['transformers']} · treespec {env['treespec']}"
        + (f" · {res['truncated']} prompt(s) left-truncated to fit the context" if res.get("truncated") else ""),
        "",
    ]


def _rows_table(rows: list[dict[str, Any]]) -> list[str]:
    parts = [
        "| config | τ | tokens/s | × greedy | × assisted | lossless | corr E(A),A | tree nodes | draft / verify / bookkeeping |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shares = (
            " / ".join(_fmt(r.get(f"share_{p}"), ".0%") for p in ("draft", "verify", "bookkeeping"))
            if r.get("share_draft") is not None
            else "–"
        )
        settings = (
            ""
            if r["builder"]
            else (" (" + ", ".join(f"{k}={v}" for k, v in r["options"].items()) + ")" if r["options"] else "")
        )
        cell = f"{r['config']}{settings}".replace("|", "\\|")  # a literal pipe inside a table cell
        parts.append(
            f"| {cell} | {_fmt(r['tau'])} | {_fmt(r['tokens_per_s'], '.0f')} | {speedup_cell(r)} | "
            f"{_fmt(r['speedup_vs_assisted'])} | {_fmt(r['lossless'])} | {_fmt(r['corr_ea_a'])} | "
            f"{_fmt(r.get('mean_tree_size'), '.1f')} | {shares} |"
        )
    return parts


def command_line(argv: list[str]) -> str:
    """The command that reproduces a run, every effective setting spelled out."""
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
