"""`treespec train pair`: train treespec's own target + draft pair on the Python standard library.

Registered in ``cli/train.py`` with ``train_app.command("pair", epilog=EPILOG)(pair)``. The work is
in ``treespec/train/pair.py`` and ``treespec/train/pair_data.py``; this module only parses and reports.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from treespec.cli.train_options import Device
from treespec.errors import TreespecError
from treespec.train.pair import ModelSize, PairSettings

EPILOG = """\
Examples:

  treespec train pair --out pair

  treespec train pair --out pair --minutes 20

  treespec train pair --out trial --max-files 60 --steps 50 --draft-steps 50

The first trains the default pair (about an hour on 2 cores); the second stops after 20 minutes,
checkpointed; the third is a quick trial. Run the same command again to resume
(OUT/checkpoint-target.pt, OUT/checkpoint-draft.pt); the tokenizer and token streams are kept in
OUT/data/ and reused. The recipe: docs/default-pair.md.
"""


D = PairSettings(out="")
Out = Annotated[
    str, typer.Option(help="directory for target/, draft/, training.json, log.jsonl, checkpoints and data/")
]
Minutes = Annotated[
    Optional[float],
    typer.Option(
        help="stop after this many minutes (checkpointed); the same command continues [default: no limit]",
        show_default=False,
    ),
]
HeldOut = Annotated[float, typer.Option(help="fraction of the corpus files held out (by a hash of the path)")]
MaxFiles = Annotated[
    Optional[int],
    typer.Option(help="use only the first N corpus files (quick trials) [default: all]", show_default=False),
]
Context = Annotated[int, typer.Option(help="training window and the models' max_position_embeddings")]
Vocab = Annotated[int, typer.Option(help="byte-level BPE vocabulary, special tokens included")]
EvalEvery = Annotated[int, typer.Option(help="steps between held-out evaluations (OUT/log.jsonl)")]
Size = Annotated[int, typer.Option()]  # a model dimension (--target-hidden, --draft-layers, ...)


def pair(
    out: Out,
    which: Annotated[str, typer.Option(help="target, draft or both")] = "both",
    steps: Annotated[int, typer.Option(help="target optimiser steps")] = D.steps,
    draft_steps: Annotated[int, typer.Option(help="draft optimiser steps")] = D.draft_steps,
    minutes: Minutes = None,
    seed: Annotated[int, typer.Option()] = D.seed,
    threads: Annotated[int, typer.Option(help="torch CPU threads")] = D.threads,
    batch_size: Annotated[int, typer.Option(help="windows of --context tokens per step")] = D.batch_size,
    lr: Annotated[float, typer.Option(help="peak learning rate (AdamW, warm-up then cosine decay)")] = D.lr,
    context: Context = D.context,
    vocab_size: Vocab = D.vocab_size,
    held_out: HeldOut = D.held_out,
    max_files: MaxFiles = None,
    target_hidden: Size = D.target.hidden,
    target_layers: Size = D.target.layers,
    target_heads: Size = D.target.heads,
    target_kv_heads: Size = D.target.kv_heads,
    target_intermediate: Size = D.target.intermediate,
    draft_hidden: Size = D.draft.hidden,
    draft_layers: Size = D.draft.layers,
    draft_heads: Size = D.draft.heads,
    draft_kv_heads: Size = D.draft.kv_heads,
    draft_intermediate: Size = D.draft.intermediate,
    eval_every: EvalEvery = D.eval_every,
    checkpoint_every: Annotated[int, typer.Option(help="steps between checkpoints")] = D.checkpoint_every,
    device: Device = None,
) -> None:
    """Train treespec's own Llama target and draft (one BPE tokenizer) on the Python standard library's source."""
    from treespec.cli import TrainingProgress
    from treespec.cli import fail as _fail
    from treespec.cli.common import settings_from
    from treespec.train.pair import train_pair

    args = dict(locals())
    if minutes is not None and minutes <= 0:
        _fail(f"--minutes must be > 0, got {minutes}")
    settings = settings_from(
        PairSettings,
        args,
        target=ModelSize(target_hidden, target_layers, target_heads, target_kv_heads, target_intermediate),
        draft=ModelSize(draft_hidden, draft_layers, draft_heads, draft_kv_heads, draft_intermediate),
    )
    with TrainingProgress() as (progress, log):
        try:
            summary = train_pair(settings, which=which, progress=progress, log=log)
        except TreespecError as exc:
            _fail(str(exc))
    _report(summary, which, out)


def _report(summary: dict, which: str, out: str) -> None:
    """One line per model trained, then where the summary is and how to use the pair."""
    for name, m in summary["models"].items():
        if name not in (("target", "draft") if which == "both" else (which,)):
            continue
        state = (
            ""
            if m["finished"]
            else f" — stopped at step {m['steps']}/{m['steps_planned']}, run the same command to continue"
        )
        held = "n/a" if m["held_out_loss"] is None else f"{m['held_out_loss']:.4f}"
        typer.echo(
            f"{name}: {m['parameters']:,} parameters, {m['steps']} steps, {m['tokens_seen']:,} tokens, held-out loss "
            f"{held} (untrained {m['held_out_loss_initial'] or float('nan'):.4f}), {m['wall_clock_seconds']:.0f} s → {out}/{name}{state}"
        )
    typer.echo(f"summary: {out}/training.json · use it: treespec run --target {out}/target --drafter {out}/draft")
