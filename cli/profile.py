"""`treespec profile`: measure the cost model `opt-tree nodes=auto` plans with (treespec/cost_measure.py).

Registered in ``cli/app.py`` with ``app.command("profile", epilog=EPILOG)(profile)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from treespec import defaults
from treespec.cli import fail
from treespec.cli.common import check_positive, check_threads, pair_options, set_threads, writable_dir, writable_file
from treespec.cli.decode_options import Device, DeviceMap, DrafterOptions, Dtype, MaxMemory, OffloadFolder, Threads
from treespec.errors import TreespecError

EPILOG = """\
Examples:

  treespec profile                                   # the default pair (treespec-py + its EAGLE head)

  treespec profile --target ../shared/models/stories260K --drafter self -D layers=4 --threads 1

  treespec profile --batch-size 4                    # one row of a batch of 4 (`run --batch-size 4` reads it)

It times a verification of n drafted nodes for n on a grid (0 ... 128, within the context), a draft
expansion of m nodes at once (1 ... 64), and each step's bookkeeping, on this machine, and saves the
result where `opt-tree nodes=auto` finds it for the same target, drafter, device, dtype and thread
count (docs/cost-aware.md); with --batch-size B, what one row of B rows decoded together pays (every
row verifying n nodes, expanding m), which batch runs of B rows and `treespec export --profile` read.
Runs refine it online anyway; without a saved profile, each run takes a
quick measurement of a few sizes when it starts.
"""
TARGET_HELP = f"target model [default: {defaults.MAIN}, what `treespec run` runs]"
DRAFTER_HELP = f"drafter name or draft model [default with the default target: {defaults.MAIN_DRAFTER}]"
PROMPT_HELP = "the prompt the measurements run on [default: a Python class opening]"
BATCH_HELP = "rows decoded together: the profile prices one row of a batch of this many"
OUT_HELP = "write the profile here instead of where runs look for it"


def profile(
    target: Annotated[Optional[str], typer.Option(help=TARGET_HELP, show_default=False)] = None,
    drafter: Annotated[Optional[str], typer.Option(help=DRAFTER_HELP, show_default=False)] = None,
    drafter_option: DrafterOptions = None,
    prompt: Annotated[str, typer.Option(help=PROMPT_HELP, show_default=False)] = defaults.PROMPT,
    repeats: Annotated[int, typer.Option(help="measurements per point (the median is kept)")] = 5,
    batch_size: Annotated[int, typer.Option(help=BATCH_HELP)] = 1,
    device: Device = None,
    dtype: Dtype = None,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    offload_folder: OffloadFolder = None,
    threads: Threads = None,
    out: Annotated[Optional[Path], typer.Option(help=OUT_HELP, show_default=False)] = None,
) -> None:
    """Measure what drafting and verifying cost on this machine, for `opt-tree nodes=auto`."""
    check_positive(repeats=repeats, batch_size=batch_size)
    check_threads(threads)
    from treespec.cost import profile_dir

    if out is not None:
        writable_file(out, "--out")
    else:  # where runs look for it: a folder that cannot take it fails now, not after the measurements
        writable_dir(profile_dir(), "--out (or TREESPEC_PROFILE_DIR)")
    try:
        target, drafter, _, d_opts = pair_options(target, drafter, "chain", None, drafter_option)
        from treespec.decoder import Decoder

        set_threads(threads)
        placement = dict(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
        dec = Decoder(target, drafter, "chain", d_opts, None, device=device, dtype=dtype, **placement)
        model = _measure(dec, prompt, repeats, batch_size)
    except TreespecError as exc:
        fail(str(exc))
    from treespec.cost import profile_path
    from treespec.files import write_text_atomic

    path = out if out is not None else profile_path(model.key)
    try:
        write_text_atomic(path, model.to_json(), "--out")
    except TreespecError as exc:
        fail(str(exc), code=1)
    plain = model.plain_seconds()
    rows = f"{batch_size} rows: " if batch_size > 1 else ""
    typer.echo(
        f"{rows}plain step {1000 * plain:.2f} ms · verify 16 nodes {1000 * model.verify.predict(16):.2f} ms · "
        f"expand 1 node {1000 * model.expand.predict(1):.2f} ms · wrote {path}"
    )


def _measure(dec, prompt: str, repeats: int, batch: int):
    from rich.progress import Progress

    from treespec.cost_measure import measure
    from treespec.plugins.cost_aware import profile_key

    ids = dec.encode(prompt)
    key = profile_key(dec.target, dec.drafter)
    if batch > 1:  # keyed as a batch row's planner looks it up (plugins/cost_aware.py, attach)
        key["batch"] = batch
    # no refresh thread: it would wake ten times a second beside the forwards being timed (measured: a
    # one-token forward of SmolLM2 37 → 64 ms with rich's auto-refresh running); redrawn at each point
    with Progress(transient=True, auto_refresh=False) as bar:
        task = bar.add_task("profile", total=1)

        def progress(what: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=what, refresh=True)

        return measure(dec.target, dec.drafter, ids, key, repeats, progress, batch=batch)
