"""`treespec train prompts`: chat prompts written by the target itself (``treespec/train/magpie.py``).

Registered in ``cli/train.py`` with ``train_app.command("prompts", epilog=EPILOG)(prompts)``; this
module only parses and reports.
"""

from __future__ import annotations

import math
from typing import Annotated, Optional

import typer

from treespec.cli import fail
from treespec.cli.common import check_positive, check_seed, set_threads, settings_from
from treespec.cli.train_options import Device, Threads
from treespec.errors import TreespecError

EPILOG = """\
Examples:

  treespec train prompts --target smollm2 --count 1000 --out smollm2-magpie.jsonl

  treespec train eagle --target smollm2 --data smollm2-magpie.jsonl --limit 1000 --out heads/smollm2-chat

Run the same command again to resume (the file grows a batch at a time). Queries overlapping an
MT-Bench, Spec-Bench or HumanEval prompt by 8 consecutive words are dropped.
"""


def prompts(
    out: Annotated[str, typer.Option(help="the .jsonl file of prompts to write (or to grow)")],
    target: Annotated[
        Optional[str],
        typer.Option(help="an instruct target with a chat template [default: smollm2]", show_default=False),
    ] = None,
    count: Annotated[int, typer.Option(help="prompts the file holds when done")] = 1000,
    batch_size: Annotated[int, typer.Option(help="queries sampled together")] = 32,
    max_tokens: Annotated[int, typer.Option(help="a query's longest (longer ones are dropped)")] = 96,
    temperature: Annotated[float, typer.Option(help="sampling temperature of the queries")] = 1.0,
    min_words: Annotated[int, typer.Option(help="shorter queries are dropped")] = 3,
    max_words: Annotated[int, typer.Option(help="longer queries are dropped")] = 120,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Threads = None,
    device: Device = None,
) -> None:
    """Write chat prompts sampled from an instruct target given only its chat template up to a user
    turn (Magpie): requests from the target's own distribution, for `treespec train eagle --data`."""
    from treespec.catalog import MAIN_TARGET
    from treespec.cli import TrainingProgress
    from treespec.train.magpie import MagpieSettings, write_prompts

    args = dict(locals())
    set_threads(threads)
    check_seed(seed)
    check_positive(count=count, batch_size=batch_size, max_tokens=max_tokens, min_words=min_words)
    if not (math.isfinite(temperature) and temperature > 0):
        fail(f"--temperature must be a finite number > 0, got {temperature}")
    if max_words < min_words:
        fail(f"--max-words {max_words} is below --min-words {min_words}")
    if not out.endswith(".jsonl"):
        fail(f"--out {out}: give a .jsonl file (`treespec train eagle --data` reads it)")
    settings = settings_from(MagpieSettings, args, target=target or MAIN_TARGET)
    with TrainingProgress() as (progress, log):
        try:
            summary = write_prompts(settings, progress, log)
        except TreespecError as exc:
            fail(str(exc))
    typer.echo(f"{summary['queries']} prompts → {out}")
    typer.echo(f"use them: treespec train eagle --target {settings.target} --data {out} --out HEAD_DIR")
