"""`treespec train eagle`: train an EAGLE head for a local target on the target's own generations.

Registered in ``cli/app.py`` with ``app.add_typer(train_app, name="train")``.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from treespec.cli import fail as _fail

from treespec.errors import TreespecError

EPILOG = """\
Examples:

  treespec train eagle --target ../shared/models/stories260K --data tinystories --offset 200 --limit 4100 --epochs 20 --out heads/s260k

  treespec run --target ../shared/models/stories260K --drafter eagle -D head=heads/s260k --builder opt-tree

Run the same command again to resume after an interruption (OUT/checkpoint.pt); the target's
generations are kept in OUT/data.pt and reused.
"""

train_app = typer.Typer(help="train drafters for a target", no_args_is_help=True, rich_markup_mode=None)




@train_app.command(epilog=EPILOG)
def eagle(
    out: Annotated[str, typer.Option(help="directory for the head (config.json + model.safetensors), checkpoints and data")],
    data: Annotated[str, typer.Option(help="prompts from the target's own domain: mt-bench, spec-bench, gsm8k, humaneval, tinystories, or a .jsonl/.txt file")],
    target: Annotated[Optional[str], typer.Option(help="target model: local directory, alias or hub id [default: treespec-py]", show_default=False)] = None,
    offset: Annotated[int, typer.Option(help="skip the first N prompts (keep benchmark prompts out of training)")] = 0,
    limit: Annotated[int, typer.Option(help="prompts used, held-out ones included")] = 2000,
    holdout: Annotated[float, typer.Option(help="fraction of the prompts held out for the agreement summary")] = 0.1,
    max_new_tokens: Annotated[int, typer.Option(help="tokens the target generates per prompt")] = 128,
    layers: Annotated[int, typer.Option(help="decoder layers in the head (EAGLE-1/2: 1)")] = 1,
    epochs: Annotated[int, typer.Option()] = 10,
    batch_size: Annotated[int, typer.Option()] = 32,
    lr: Annotated[float, typer.Option(help="peak learning rate (AdamW, warm-up then linear decay)")] = 3e-3,
    noise: Annotated[float, typer.Option(help="uniform noise on input features, relative to their std")] = 0.2,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
) -> None:
    """Train an EAGLE-1/2 head: feature regression + token loss on the target's own greedy generations."""
    import torch

    from treespec.cli import TrainingProgress
    from treespec.models import DEFAULT_TARGET
    from treespec.plugins.eagle_train import TrainSettings, train

    if threads:
        torch.set_num_threads(threads)
    for name, value in (("--limit", limit), ("--epochs", epochs), ("--batch-size", batch_size), ("--layers", layers)):
        if value <= 0:
            _fail(f"{name} must be > 0, got {value}")
    settings = TrainSettings(
        target=target or DEFAULT_TARGET, data=data, out=out, offset=offset, limit=limit, holdout=holdout,
        max_new_tokens=max_new_tokens, layers=layers, epochs=epochs, batch_size=batch_size, lr=lr, noise=noise, seed=seed,
    )
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


from treespec.cli.train_pair import EPILOG as PAIR_EPILOG, pair  # noqa: E402  (the sub-command lives in its own module)

train_app.command("pair", epilog=PAIR_EPILOG)(pair)
