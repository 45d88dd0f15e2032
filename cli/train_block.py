"""`treespec train block`: train a block drafter (``plugins/block_train.py``) for a target.

Registered in ``cli/train.py`` with ``train_app.command("block", epilog=EPILOG)(block)``; this
module only parses and reports.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from treespec.cli import fail
from treespec.cli.common import check_positive, check_seed, set_threads
from treespec.errors import TreespecError
from treespec.plugins.block_settings import BlockSettings

EPILOG = """\
Examples:

  treespec train block --data code-prompts-train.jsonl --limit 3000 --epochs 10 --out heads/py-block

  treespec run --drafter block -D head=heads/py-block --builder opt-tree

  treespec train block --target smollm2 --data instruct-mix --limit 1000 --max-new-tokens 256 --draft-vocab 8192 --answers heads/smollm2-eagle/data.pt --out heads/smollm2-block

Run the same command again to resume after an interruption (OUT/checkpoint.pt); the target's
generations and features are kept in OUT/data.pt and reused. The recipe: docs/drafters.md.
"""

D = BlockSettings(target="", data="", out="")


def block(
    out: Annotated[
        str, typer.Option(help="directory for the drafter (config.json + model.safetensors), checkpoints, data")
    ],
    data: Annotated[
        str, typer.Option(help="prompts: a dataset name (see `treespec bench --help`) or a .jsonl file")
    ] = "code-prompts-train.jsonl",
    target: Annotated[
        Optional[str],
        typer.Option(help="target model: local directory, alias or hub id [default: treespec-py]", show_default=False),
    ] = None,
    offset: Annotated[int, typer.Option(help="skip the first N prompts (keep benchmark prompts out of training)")] = 0,
    limit: Annotated[int, typer.Option(help="prompts used, held-out ones included")] = D.limit,
    holdout: Annotated[
        float, typer.Option(help="fraction of the prompts held out for the agreement summary")
    ] = D.holdout,
    max_new_tokens: Annotated[int, typer.Option(help="tokens the target generates per prompt")] = D.max_new_tokens,
    block_size: Annotated[
        int, typer.Option(help="K: positions drafted by one forward (the tree's depth limit)")
    ] = D.block_size,
    layers: Annotated[int, typer.Option(help="decoder layers in the drafter")] = D.layers,
    feature_layers: Annotated[
        Optional[str],
        typer.Option(
            help="the target's hidden states the drafter reads, as hidden_states indices (i = the input of layer i; "
            "L = the last layer's output), e.g. 2,5,8 [default: EAGLE-3's 2, L//2, L-3]",
            show_default=False,
        ),
    ] = None,
    anchors: Annotated[int, typer.Option(help="blocks per sequence per training batch")] = D.anchors,
    last_feature: Annotated[
        bool, typer.Option(help="add the newest context row's features to every block row's input")
    ] = D.last_feature,
    gamma: Annotated[
        Optional[float],
        typer.Option(help="loss weight of depth k: exp(-(k-1)/gamma) [default: K/2]", show_default=False),
    ] = None,
    epochs: Annotated[int, typer.Option()] = D.epochs,
    batch_size: Annotated[int, typer.Option(help="sequences per optimiser step")] = D.batch_size,
    lr: Annotated[float, typer.Option()] = D.lr,
    draft_vocab: Annotated[
        Optional[int],
        typer.Option(
            help="draft over the N tokens the target generates most [default: all, up to 32,000]", show_default=False
        ),
    ] = None,
    max_len: Annotated[int, typer.Option(help="train on each sequence's last N tokens")] = D.max_len,
    gen_batch_size: Annotated[
        Optional[int],
        typer.Option(help="prompts per batch while the target generates [default: --batch-size]", show_default=False),
    ] = None,
    answers: Annotated[
        Optional[str],
        typer.Option(
            help="an earlier `train eagle` run's data.pt on the same prompts: reuse its continuations",
            show_default=False,
        ),
    ] = None,
    save_dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16 for the saved weights")] = D.save_dtype,
    seed: Annotated[int, typer.Option()] = D.seed,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
) -> None:
    """Train a block drafter: one forward over the target's features proposes every depth of a tree
    (DFlash's recipe on the target's own greedy generations)."""
    from treespec.catalog import DEFAULT_TARGET
    from treespec.cli import TrainingProgress
    from treespec.plugins.block_train import train_block

    set_threads(threads)
    check_seed(seed)
    check_positive(
        limit=limit,
        epochs=epochs,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        gen_batch_size=gen_batch_size,
        max_len=max_len,
    )
    if offset < 0:
        fail(f"--offset must be >= 0, got {offset} (it counts prompts skipped from the start)")
    if not lr > 0:
        fail(f"--lr must be a number > 0, got {lr}")
    try:
        features = tuple(int(x) for x in feature_layers.split(",")) if feature_layers else ()
    except ValueError:
        fail(f"--feature-layers {feature_layers!r}: give comma-separated layer indices, e.g. 2,5,8")
    settings = BlockSettings(
        target=target or DEFAULT_TARGET,
        data=data,
        out=out,
        offset=offset,
        limit=limit,
        holdout=holdout,
        max_new_tokens=max_new_tokens,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        block_size=block_size,
        layers=layers,
        anchors=anchors,
        gamma=gamma,
        draft_vocab=draft_vocab,
        max_len=max_len,
        gen_batch_size=gen_batch_size,
        save_dtype=save_dtype,
        answers=answers,
        seed=seed,
        feature_layers=features,
        last_feature=last_feature,
    )
    with TrainingProgress() as (progress, log):
        try:
            summary = train_block(settings, progress=progress, log=log)
        except TreespecError as exc:
            fail(str(exc))
    depths = " ".join(f"{a:.3f}" for a in summary["held_out"]["top1_per_depth"])
    typer.echo(
        f"block drafter ({summary['parameters']:,} parameters, K = {block_size}, target layers "
        f"{summary['feature_layers']}) → {out}: held-out top-1 agreement per depth {depths}; argmax chain "
        f"τ {summary['held_out']['chain_tau']:.2f}"
    )
    typer.echo(f"use it: treespec run --target {settings.target} --drafter block -D head={out}")
