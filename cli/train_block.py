"""`treespec train block`: train a block drafter (``plugins/block_train.py``) for a target.

Registered in ``cli/train.py`` with ``train_app.command("block", epilog=EPILOG)(block)``; this
module only parses and reports.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from treespec.cli import fail
from treespec.cli.common import check_offset_lr, check_positive, check_seed, set_threads, settings_from
from treespec.cli.train_options import Answers, Device, GenBatch, Holdout, Limit, MaxNew, Offset, Target, Threads
from treespec.errors import TreespecError
from treespec.plugins.block_settings import BlockSettings

EPILOG = """\
Examples:

  treespec train block --data code-prompts-train.jsonl --limit 3000 --epochs 10 --out heads/py-block

  treespec run --drafter block -D head=heads/py-block --builder opt-tree

  treespec train block --target smollm2 --data instruct-mix --limit 1000 --max-new-tokens 256 --draft-vocab 8192 --answers heads/smollm2-eagle/data.pt --out heads/smollm2-block

  treespec train block --target smollm2 --data smollm2-magpie.jsonl --max-new-tokens 256 --init smollm2-block --layers 2 --epochs 3 --out heads/smollm2-block-chat

Run the same command again to resume after an interruption (OUT/checkpoint.pt); the target's
generations and features are kept in OUT/data.pt and reused. The recipe: docs/drafters.md.
"""

D = BlockSettings(target="", data="", out="")
# the options, declared once (typer reads each parameter's Annotated type)
Out = Annotated[
    str, typer.Option(help="directory for the drafter (config.json + model.safetensors), checkpoints, data")
]
Data = Annotated[str, typer.Option(help="prompts: a dataset name (see `treespec bench --help`) or a .jsonl file")]
BlockSize = Annotated[int, typer.Option(help="K: positions drafted by one forward (the tree's depth limit)")]
Layers = Annotated[int, typer.Option(help="decoder layers in the drafter")]
FeatureLayers = Annotated[
    Optional[str],
    typer.Option(
        help="the target's hidden states the drafter reads, as hidden_states indices (i = the input of layer i; "
        "L = the last layer's output), e.g. 2,5,8 [default: EAGLE-3's 2, L//2, L-3]",
        show_default=False,
    ),
]
Anchors = Annotated[int, typer.Option(help="blocks per sequence per training batch")]
LastFeature = Annotated[bool, typer.Option(help="add the newest context row's features to every block row's input")]
Gamma = Annotated[
    Optional[float], typer.Option(help="loss weight of depth k: exp(-(k-1)/gamma) [default: K/2]", show_default=False)
]
BatchSize = Annotated[int, typer.Option(help="sequences per optimiser step")]
DraftVocab = Annotated[
    Optional[int],
    typer.Option(
        help="draft over the N tokens the target generates most [default: all, up to 32,000]", show_default=False
    ),
]
MaxLen = Annotated[int, typer.Option(help="train on each sequence's last N tokens")]
SaveDtype = Annotated[str, typer.Option(help="float32, float16 or bfloat16 for the saved weights")]
Init = Annotated[
    Optional[str], typer.Option(help="fine-tune this block drafter (folder or alias) on --data", show_default=False)
]


def block(
    out: Out,
    data: Data = "code-prompts-train.jsonl",
    target: Target = None,
    offset: Offset = 0,
    limit: Limit = D.limit,
    holdout: Holdout = D.holdout,
    max_new_tokens: MaxNew = D.max_new_tokens,
    block_size: BlockSize = D.block_size,
    layers: Layers = D.layers,
    feature_layers: FeatureLayers = None,
    anchors: Anchors = D.anchors,
    last_feature: LastFeature = D.last_feature,
    gamma: Gamma = None,
    epochs: Annotated[int, typer.Option()] = D.epochs,
    batch_size: BatchSize = D.batch_size,
    lr: Annotated[float, typer.Option()] = D.lr,
    draft_vocab: DraftVocab = None,
    max_len: MaxLen = D.max_len,
    gen_batch_size: GenBatch = None,
    answers: Answers = None,
    init: Init = None,
    save_dtype: SaveDtype = D.save_dtype,
    seed: Annotated[int, typer.Option()] = D.seed,
    threads: Threads = None,
    device: Device = None,
) -> None:
    """Train a block drafter: one forward over the target's features proposes every depth of a tree
    (DFlash's recipe on the target's own greedy generations)."""
    from treespec.catalog import DEFAULT_TARGET
    from treespec.cli import TrainingProgress
    from treespec.plugins.block_train import train_block

    args = dict(locals())
    set_threads(threads)
    check_seed(seed)
    check_positive(
        limit=limit, epochs=epochs, batch_size=batch_size, max_new_tokens=max_new_tokens,
        gen_batch_size=gen_batch_size, max_len=max_len,
    )  # fmt: skip
    check_offset_lr(offset, lr)
    try:
        features = tuple(int(x) for x in feature_layers.split(",")) if feature_layers else ()
    except ValueError:
        fail(f"--feature-layers {feature_layers!r}: give comma-separated layer indices, e.g. 2,5,8")
    settings = settings_from(BlockSettings, args, target=target or DEFAULT_TARGET, feature_layers=features)
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
