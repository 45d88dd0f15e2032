"""`treespec sequoia-measure`: measure the per-rank acceptance vector the `sequoia` builder needs.

Registered in ``cli/app.py`` with ``app.command("sequoia-measure", epilog=EPILOG)(sequoia_measure)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from treespec.cli import fail, measure
from treespec.cli.common import check_positive, hf_errors_only, writable_file, write_or_print

EPILOG = """\
Examples:

  treespec sequoia-measure --target ../shared/models/stories260K --drafter ../shared/models/stories260K --layers 4 --dataset tinystories --limit 20 --out acceptance-l4.json

  treespec run --target ../shared/models/stories260K --builder sequoia -B nodes=40 -B acceptance=acceptance-l4.json --drafter ../shared/models/stories260K -D layers=4
"""
OUT_HELP = "write the JSON here (for `--builder sequoia -B acceptance=FILE`) [default: print it]"


@hf_errors_only  # generate() warns about pad tokens on every call
def sequoia_measure(
    target: measure.TargetOption = None,
    drafter: measure.DraftModelOption = None,
    layers: measure.Layers = None,
    dataset: measure.Dataset = "humaneval",
    limit: measure.Limit = 20,
    skip: measure.Skip = 0,
    category: measure.Category = None,
    data_dir: measure.DataDir = None,
    max_new_tokens: measure.MaxNewTokens = 128,
    ranks: Annotated[int, typer.Option(help="length of the acceptance vector (draft ranks counted)")] = 16,
    device: measure.Device = None,
    dtype: measure.Dtype = None,
    threads: measure.Threads = None,
    out: Annotated[Optional[Path], typer.Option(help=OUT_HELP, show_default=False)] = None,
) -> None:
    """Measure the draft's per-rank acceptance vector on the target's greedy outputs (for `--builder sequoia`)."""
    check_positive(ranks=ranks)
    if out is not None:
        writable_file(out, "--out", create_folder=True)  # before the measurement, not after it
    run = measure.load(
        target, drafter, layers, dataset, limit, skip, category, data_dir, max_new_tokens, device, dtype, threads
    )
    prompts, tgt = run.prompts, run.target
    if ranks > tgt.vocab_size:  # a rank is a place among the vocabulary: 10⁹ ranks allocated gigabytes of counts
        fail(
            f"--ranks {ranks} is more ranks than the vocabulary has tokens ({tgt.vocab_size}): use at most "
            f"{tgt.vocab_size} (the default 16 covers what trees use)"
        )

    from treespec.train.acceptance import measure_acceptance

    names = dict(target_name=run.target_name, drafter_name=run.drafter_name, dataset=dataset)
    result = measure_acceptance(tgt, run.draft, prompts, max_new_tokens, ranks, **names)
    result.update(limit=limit, skip=skip, category=category, skipped_too_long=run.skipped)
    result.update(dtype=str(tgt.dtype).replace("torch.", ""))
    text = json.dumps(result, indent=2)
    p = result["acceptance"]
    summary = (
        f"p = [{', '.join(f'{x:.3f}' for x in p[:6])}{', ...' if len(p) > 6 else ''}] "
        f"over {result['positions']} positions of {len(prompts)} prompts (rank ≥ {ranks}: {result['beyond']:.3f})"
    )
    if out is None:
        sys.stdout.write(text + "\n")
    else:
        write_or_print(out, text + "\n")
        summary += f"; wrote {out} (use: --builder sequoia -B acceptance={out})"
    typer.secho(summary, fg=typer.colors.CYAN, err=True)
