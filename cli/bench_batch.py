"""`treespec bench --batch-size 1,4,8,16`: the throughput mode (``treespec.bench.batch_runner``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import typer

from treespec.cli import fail
from treespec.cli.common import command_line, set_threads
from treespec.errors import Interrupted, TreespecError
from treespec.files import write_text_atomic


def _sizes(value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        fail(f"--batch-size {value!r}: give batch sizes separated by commas, e.g. 1,4,8,16")
    if not sizes or any(s <= 0 for s in sizes):
        fail(f"--batch-size {value!r}: every batch size must be > 0")
    return sizes


def bench_batches(
    ctx: Any,
    batch_size: str,
    items: list,
    target: str,
    drafter: list[str],
    builder: list[str],
    max_new_tokens: int,
    device: str | None,
    dtype: str | None,
    seed: int,
    threads: int | None,
    placement: dict[str, Any],
    dataset: str,
    out: Path,
    report_to: Path | None,
    sampling: Any,
) -> None:
    import torch

    from treespec.bench.batch_runner import plot

    sizes = _sizes(batch_size)
    if sampling is not None:
        fail(
            "--batch-size measures greedy throughput: drop --temperature (sampled rows: Decoder.generate([...], temperature=...))"
        )
    if not drafter:
        fail('no drafter: pass --drafter "MODEL-or-NAME [key=value ...]"')
    builder = builder or ["opt-tree"]
    torch.manual_seed(seed)
    set_threads(threads)
    runner, prompts = _load(target, drafter, builder, sizes, max_new_tokens, device, dtype, placement, items)
    line = command_line(ctx, {"target": target, "drafter": drafter, "builder": builder})
    result = _header(shlex.join(line), dataset, len(prompts), max_new_tokens, target, seed)

    saved: list[int] = []  # the batch sizes whose rows are in results.json

    def save(rows: list[dict[str, Any]], partial: bool = True) -> None:  # after every batch size, atomically
        write_text_atomic(
            out / "results.json",
            json.dumps({**result, "rows": rows, "partial": partial}, indent=1, default=str) + "\n",
            "--out",
        )
        saved[:] = sorted({r["batch_size"] for r in rows})

    try:
        rows = _run(runner, prompts, sizes, save)
        save(rows, partial=False)
    except (KeyboardInterrupt, Interrupted):
        _stopped(out, "interrupted", 130, saved)
    except TreespecError as exc:
        _stopped(out, str(exc), 1, saved)
    try:
        png = plot(out, rows)
    except TreespecError as exc:
        fail(f"{exc}; the results are complete in {out / 'results.json'}", code=1)
    _print_rows(rows)
    typer.echo(f"wrote {out / 'results.json'}, {png}")


def _print_rows(rows: list[dict[str, Any]]) -> None:
    """Every row's throughput, then ``nodes=auto`` against the best fixed row at each batch size."""
    from treespec.bench import paired
    from treespec.bench.batch_runner import target_lines

    for r in rows:
        same = "lossless" if r["lossless"] else f"{r['mismatches']} rows differ"
        typer.echo(
            f"B={r['batch_size']:>3}  {r['config'][:60]:<60} {r['tokens_per_s']:8.1f} tok/s  × HF {paired.cell(r['vs_hf'], r.get('vs_hf_interval'))}  {same}"
        )
    for verdict in target_lines(rows):
        typer.echo(verdict)


def _load(
    target: str,
    drafter: list[str],
    builder: list[str],
    sizes: list[int],
    max_new_tokens: int,
    device: str | None,
    dtype: str | None,
    placement: dict[str, Any],
    items: list,
) -> tuple[Any, list[list[int]]]:
    """The bench (its models loaded) and the prompts, left-cut to leave room for the new tokens."""
    from treespec.bench.batch_runner import BatchBench
    from treespec.bench.datasets import format_turns

    try:
        runner = BatchBench(
            target, drafter, builder, sizes, max_new_tokens, device=device, dtype=dtype, placement=placement
        )
        tok = runner.target.tokenizer
        limit = runner.target.max_positions
        if limit is not None and max_new_tokens >= limit:  # p[-0:] would keep the whole prompt, p[-(-k):] cut it wrong
            fail(
                f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in {target!r}'s context of {limit} "
                f"tokens: use at most {limit - 1}"
            )
        prompts = [format_turns(tok, it, []) for it in items]
    except TreespecError as exc:
        fail(str(exc))
    if limit:
        prompts = [p[-(limit - max_new_tokens) :] for p in prompts]
    return runner, prompts


def _header(command: str, dataset: str, prompts: int, max_new_tokens: int, target: str, seed: int) -> dict[str, Any]:
    """results.json of a batch run before its rows (``partial`` until the last batch size is in)."""
    from treespec.bench import report

    return {
        "mode": "batch",
        "command": command,
        "dataset": dataset,
        "category": None,
        "prompts": prompts,
        "truncated": 0,
        "max_new_tokens": max_new_tokens,
        "target": target,
        "seed": seed,
        "temperature": 0.0,
        "environment": report.environment(),
        "rows": [],
        "partial": True,
    }


def _run(runner: Any, prompts: list[list[int]], sizes: list[int], save: Any) -> list[dict[str, Any]]:
    """Every configuration at every batch size, with a progress bar (redrawn at each run: no refresh
    thread beside the timed forwards); ``save(rows)`` after every batch size."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    runs = len(runner.configs) * sum(-(-len(prompts) // b) for b in sizes)
    with Progress(
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        auto_refresh=False,
    ) as progress:
        task = progress.add_task("warm-up", total=runs + 1)
        return runner.run(
            prompts,
            progress=lambda what: progress.update(task, advance=1, description=what, refresh=True),
            on_rows=save,
        )


def _stopped(out: Path, why: str, code: int, saved: list[int]) -> None:
    """One line: why the run stopped, and what of it is on disk (the rows of every finished batch size)."""
    kept = (
        f"the rows of batch sizes {','.join(map(str, saved))} are in {out / 'results.json'} (marked partial)"
        if saved
        else "no batch size finished"
    )
    fail(f"bench stopped ({why}); {kept}", code=code)
