"""`treespec train eagle`: train an EAGLE head for a local target on the target's own generations.

Registered in ``cli/app.py`` with ``app.add_typer(train_app, name="train")``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

import typer

from treespec.cli import fail as _fail
from treespec.cli.common import check_offset_lr, check_positive, check_seed, set_threads, settings_from
from treespec.cli.train_options import Answers, Device, GenBatch, Holdout, Limit, MaxNew, Offset, Target, Threads
from treespec.errors import TreespecError

EPILOG = """\
Examples:

  treespec train eagle --target ../shared/models/stories260K --data tinystories --offset 200 --limit 4100 --epochs 20 --out heads/s260k

  treespec run --target ../shared/models/stories260K --drafter eagle -D head=heads/s260k --builder opt-tree

  treespec train eagle --version 3 --data code.jsonl --limit 3000 --epochs 4 --out heads/py-eagle3

  treespec run --drafter eagle3 -D head=heads/py-eagle3

Run the same command again to resume after an interruption (OUT/checkpoint.pt); the target's
generations are kept in OUT/data.pt and reused.
"""

train_app = typer.Typer(help="train drafters for a target", no_args_is_help=True, rich_markup_mode=None)


Out = Annotated[
    str, typer.Option(help="directory for the head (config.json + model.safetensors), checkpoints and data")
]
Data = Annotated[
    str,
    typer.Option(
        help="prompts from the target's own domain: mt-bench, spec-bench, gsm8k, humaneval, tinystories, or a .jsonl/.txt file"
    ),
]
Lr = Annotated[
    Optional[float],
    typer.Option(
        help="peak learning rate (AdamW, warm-up then linear decay) [default: 3e-3; EAGLE-3: 1e-3]", show_default=False
    ),
]
Noise = Annotated[float, typer.Option(help="uniform noise on input features, relative to their std")]
Version = Annotated[
    int,
    typer.Option(
        help="1: an EAGLE-1/2 head (--drafter eagle); 3: an EAGLE-3 head with training-time test (--drafter eagle3)"
    ),
]
Ttt = Annotated[int, typer.Option(help="EAGLE-3: steps the head is unrolled on its own outputs")]
DraftVocab = Annotated[
    Optional[int],
    typer.Option(
        help="draft over the N target tokens generated most often (a cheaper output layer) [default: EAGLE-1: the whole vocabulary; EAGLE-3: the target's, up to 32000]",
        show_default=False,
    ),
]
SaveDtype = Annotated[
    str,
    typer.Option(
        help="EAGLE-1: dtype of the saved head's weights (float16 halves it; loading casts to the target's dtype)"
    ),
]
Init = Annotated[
    Optional[str],
    typer.Option(
        help="EAGLE-1: start from this head (directory or alias) and its draft vocabulary: fine-tune it on --data",
        show_default=False,
    ),
]


@train_app.command(epilog=EPILOG)
def eagle(
    out: Out,
    data: Data,
    target: Target = None,
    offset: Offset = 0,
    limit: Limit = 2000,
    holdout: Holdout = 0.1,
    max_new_tokens: MaxNew = 128,
    layers: Annotated[int, typer.Option(help="decoder layers in the head (EAGLE-1/2: 1)")] = 1,
    epochs: Annotated[int, typer.Option()] = 10,
    batch_size: Annotated[int, typer.Option()] = 32,
    lr: Lr = None,
    noise: Noise = 0.2,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Threads = None,
    device: Device = None,
    version: Version = 1,
    ttt_steps: Ttt = 7,
    draft_vocab: DraftVocab = None,
    save_dtype: SaveDtype = "float32",
    gen_batch_size: GenBatch = None,
    max_len: Annotated[int, typer.Option(help="EAGLE-3: train on each sequence's last N tokens")] = 2048,
    init: Init = None,
    answers: Answers = None,
) -> None:
    """Train an EAGLE head on the target's own greedy generations: EAGLE-1/2 (feature regression +
    token loss) or, with --version 3, EAGLE-3 (three fused target layers, training-time test)."""
    from treespec.catalog import DEFAULT_TARGET
    from treespec.cli import TrainingProgress
    from treespec.plugins.eagle_train import TrainSettings, train

    args = dict(locals())
    set_threads(threads)
    _check(
        seed, limit, epochs, batch_size, layers, ttt_steps, max_new_tokens, gen_batch_size, offset, lr, noise, version
    )
    if version == 3:
        if init is not None:
            _fail("--init: fine-tuning starts from EAGLE-1 heads; drop --init for --version 3")
        return _eagle3(args, target or DEFAULT_TARGET, lr if lr is not None else 1e-3)
    settings = settings_from(TrainSettings, args, target=target or DEFAULT_TARGET, lr=lr if lr is not None else 3e-3)
    with TrainingProgress() as (progress, log):
        try:
            summary = train(settings, progress=progress, log=log)
        except TreespecError as exc:
            _fail(str(exc))
    typer.echo(
        f"EAGLE head ({summary['parameters']:,} parameters) → {out}: held-out top-1 agreement "
        f"{summary['top1']:.3f} (untrained {summary['top1_before']:.3f}) on {summary['held_out_positions']} "
        f"generated positions of {summary['held_out_sequences']} held-out prompts"
    )
    typer.echo(f"use it: treespec run --target {settings.target} --drafter eagle -D head={out}")


def _check(
    seed: int,
    limit: int,
    epochs: int,
    batch_size: int,
    layers: int,
    ttt_steps: int,
    max_new_tokens: int,
    gen_batch_size: int | None,
    offset: int,
    lr: float | None,
    noise: float,
    version: int,
) -> None:
    """One line for a setting that cannot train, before the target loads."""
    check_seed(seed)
    check_positive(
        limit=limit,
        epochs=epochs,
        batch_size=batch_size,
        layers=layers,
        ttt_steps=ttt_steps,
        max_new_tokens=max_new_tokens,
        gen_batch_size=gen_batch_size,
    )
    check_offset_lr(offset, lr)
    if not (math.isfinite(noise) and noise >= 0):
        _fail(f"--noise must be a finite number >= 0 (0: no noise), got {noise}")
    if version not in (1, 3):
        _fail(f"--version {version}: use 1 (EAGLE-1/2) or 3 (EAGLE-3)")


def _eagle3(args: dict[str, Any], target: str, lr: float) -> None:
    """`train eagle --version 3`: the command's parameters ``args``, with the target and lr filled in."""
    from treespec.cli import TrainingProgress
    from treespec.plugins.eagle3_train import Train3Settings, train3

    if args["layers"] != 1:
        _fail("--layers: EAGLE-3 heads have one decoder layer (the published layout); drop --layers")
    settings = settings_from(Train3Settings, args, target=target, lr=lr)
    with TrainingProgress() as (progress, log):
        try:
            summary = train3(settings, progress=progress, log=log)
        except TreespecError as exc:
            _fail(str(exc))
    steps = " ".join(f"{a:.3f}" for a in summary["top1_per_step"])
    typer.echo(
        f"EAGLE-3 head ({summary['parameters']:,} parameters, draft vocabulary {summary['draft_vocab']}, "
        f"target layers {summary['layers']}) → {settings.out}: held-out top-1 agreement per unrolled step {steps} "
        f"on {summary['held_out_positions']} generated positions"
    )
    typer.echo(f"use it: treespec run --target {target} --drafter eagle3 -D head={settings.out}")


from treespec.cli.train_pair import EPILOG as PAIR_EPILOG  # noqa: E402  (the sub-command lives in its own module)
from treespec.cli.train_pair import pair  # noqa: E402

train_app.command("pair", epilog=PAIR_EPILOG)(pair)

from treespec.cli.train_block import EPILOG as BLOCK_EPILOG  # noqa: E402
from treespec.cli.train_block import block  # noqa: E402

train_app.command("block", epilog=BLOCK_EPILOG)(block)

from treespec.cli.train_prompts import EPILOG as PROMPTS_EPILOG  # noqa: E402
from treespec.cli.train_prompts import prompts  # noqa: E402

train_app.command("prompts", epilog=PROMPTS_EPILOG)(prompts)
