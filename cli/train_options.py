"""The options the `treespec train` commands share, declared once (typer reads each
parameter's ``Annotated`` type)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Target = Annotated[
    Optional[str],
    typer.Option(help="target model: local directory, alias or hub id [default: treespec-py]", show_default=False),
]
Offset = Annotated[int, typer.Option(help="skip the first N prompts (keep benchmark prompts out of training)")]
Limit = Annotated[int, typer.Option(help="prompts used, held-out ones included")]
Holdout = Annotated[float, typer.Option(help="fraction of the prompts held out for the agreement summary")]
MaxNew = Annotated[int, typer.Option(help="tokens the target generates per prompt")]
Threads = Annotated[Optional[int], typer.Option(help="torch CPU threads")]
Device = Annotated[
    Optional[str],
    typer.Option(
        help="the device training runs on (the target, and the model being trained): cpu, cuda, cuda:1, mps ... "
        "[default: cpu]",
        show_default=False,
    ),
]
Answers = Annotated[
    Optional[str],
    typer.Option(
        help="an earlier training run's data.pt on the same prompts: reuse its continuations (only the target's "
        "features are computed)",
        show_default=False,
    ),
]
GenBatch = Annotated[
    Optional[int],
    typer.Option(
        help="prompts per batch while the target generates the training data [default: --batch-size]",
        show_default=False,
    ),
]
