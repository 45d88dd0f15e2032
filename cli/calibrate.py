"""`treespec calibrate`: fit a draft model's greedy-acceptance temperature for a target.

Registered in ``cli/app.py`` with ``app.command("calibrate", epilog=EPILOG)(calibrate)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from treespec.cli import measure
from treespec.cli.common import check_positive, hf_errors_only, writable_file, write_or_print

EPILOG = """\
Examples:

  treespec calibrate --drafter treespec-py-draft --dataset humaneval --skip 40 --limit 124

  treespec run --drafter treespec-py-draft -D temperature=0.482 --builder opt-tree -B nodes=8

The target generates greedily on each prompt; T minimises the draft's negative log-likelihood of the
target's tokens under softmax(logits / T) (docs/drafters.md, "Calibrating a draft model"). Skip the prompts you
benchmark on. EAGLE heads are calibrated by `treespec train eagle` itself.
"""
SKIP_HELP = "skip the first S prompts (the 40 that `treespec bench --limit 40` uses, by default)"
MAX_POSITIONS_HELP = (
    "stop after this many generated positions [default: 16384, fewer for vocabularies over 4096: the logits "
    "kept stay under 256 MB]"
)


@hf_errors_only  # generate() warns about pad tokens on every call
def calibrate(
    target: measure.TargetOption = None,
    drafter: measure.DraftModelOption = None,
    layers: measure.Layers = None,
    dataset: measure.Dataset = "humaneval",
    limit: measure.Limit = 124,
    skip: Annotated[int, typer.Option(help=SKIP_HELP)] = 40,
    category: measure.Category = None,
    data_dir: measure.DataDir = None,
    max_new_tokens: measure.MaxNewTokens = 128,
    max_positions: Annotated[Optional[int], typer.Option(help=MAX_POSITIONS_HELP, show_default=False)] = None,
    device: measure.Device = None,
    dtype: measure.Dtype = None,
    threads: measure.Threads = None,
    out: Annotated[
        Optional[Path], typer.Option(help="also write the measurements as JSON here", show_default=False)
    ] = None,
) -> None:
    """Fit the draft model's temperature T so that its q predicts greedy acceptance (for `-D temperature=T`)."""
    check_positive(max_positions=max_positions)
    if out is not None:
        writable_file(out, "--out", create_folder=True)  # before the measurement, not after it
    measure.refuse_plugin_names(drafter, "calibrate")
    run = measure.load(
        target, drafter, layers, dataset, limit, skip, category, data_dir, max_new_tokens, device, dtype, threads
    )

    from rich.progress import Progress

    from treespec.train.calibration import calibrate_draft

    with Progress(transient=True) as bar:
        task = bar.add_task("the target's greedy continuations", total=len(run.prompts))
        progress = lambda done, total: bar.update(task, completed=done)  # noqa: E731
        cal = calibrate_draft(run.target, run.draft, run.prompts, max_new_tokens, max_positions, progress=progress)
    t = f"{cal.temperature:.3g}"
    typer.echo(
        f"T = {t} for {run.drafter_name} drafting for {run.target_name}: NLL of the target's greedy token "
        f"{cal.nll_t1:.3f} → {cal.nll:.3f}; top-1 agreement {cal.top1:.3f}, mean top-1 q "
        f"{cal.mean_q_top1_t1:.3f} → {cal.mean_q_top1:.3f} ({cal.positions} positions of {cal.prompts} prompts)"
    )
    if out is not None:
        record = dict(target=run.target_name, drafter=run.drafter_name, dataset=dataset, skip=skip, limit=limit)
        record.update(max_new_tokens=max_new_tokens, skipped_too_long=run.skipped)
        record.update(dtype=str(run.target.dtype).replace("torch.", ""), **vars(cal))
        write_or_print(out, json.dumps(record, indent=2) + "\n")
        typer.echo(f"wrote {out}")
    model = run.drafter_name.split()[0]
    opts = (f" -D layers={layers}" if layers else "") + f" -D temperature={t}"
    typer.echo(
        f"use it: treespec run --target {run.target_name} --drafter {model}{opts} "
        f"(in treespec bench: --drafter '{run.drafter_name} temperature={t}')"
    )
