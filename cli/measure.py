"""What `treespec sequoia-measure` and `treespec calibrate` share: both run the target greedily on a
prompt set and score its continuations with a draft model. Their common options and the loading of
target, draft and prompts, with every bad input reported as one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from treespec.cli import fail as _fail
from treespec.cli.common import check_positive, check_threads, set_threads
from treespec.errors import TreespecError

TargetOption = Annotated[
    Optional[str],
    typer.Option(help="target model: hub id, alias or local directory [default: treespec-py]", show_default=False),
]
DraftModelOption = Annotated[
    Optional[str],
    typer.Option(
        help="draft model: alias, hub id or local directory [default with the default target: treespec-py-draft]",
        show_default=False,
    ),
]
Layers = Annotated[
    Optional[int], typer.Option(help="keep only the draft model's first k decoder layers (as the drafter's layers=k)")
]
Dataset = Annotated[
    str, typer.Option(help="mt-bench, spec-bench, gsm8k, humaneval, tinystories, or a .jsonl/.txt file")
]
Limit = Annotated[Optional[int], typer.Option(help="use N prompts (first turns only)")]
Skip = Annotated[int, typer.Option(help="skip the first S prompts (measure on prompts a benchmark does not use)")]
Category = Annotated[Optional[str], typer.Option(help="only this category (mt-bench, spec-bench)")]
DataDir = Annotated[
    Optional[Path],
    typer.Option(
        help="folder of the dataset files [default: $TREESPEC_DATA_DIR or ../shared/prompts]", show_default=False
    ),
]
MaxNewTokens = Annotated[int, typer.Option(help="greedy tokens the target generates per prompt")]
Device = Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1, mps ... (default: cpu)")]
Dtype = Annotated[Optional[str], typer.Option(help="float32, bfloat16, float16 (default: float32 on CPU)")]
Threads = Annotated[Optional[int], typer.Option(help="CPU threads for torch")]


@dataclass
class Loaded:
    target: Any  # TargetModel
    draft: Any  # the draft causal LM
    target_name: str
    drafter_name: str  # the draft as a drafter spec: "MODEL" or "MODEL layers=k"
    prompts: list[list[int]]  # token ids of the prompts that fit the target's context
    skipped: int  # prompts left out because prompt + max_new_tokens exceeds the target's context


def refuse_plugin_names(drafter: str | None, command: str) -> None:
    """One line of error when ``--drafter`` names a drafter plugin: these commands take a draft MODEL."""
    if drafter is None:
        return
    from treespec.factory import resolve_drafter_name

    try:
        _, options = resolve_drafter_name(drafter, None)  # what `treespec run --drafter` would make of it
    except TreespecError:
        return  # neither a drafter nor a model name: loading it says why
    if "model" not in options:  # a drafter plugin or a+b, not a model for drafter `model`
        _fail(
            f"`treespec {command}` takes a draft model (alias, hub id or directory), not the drafter {drafter!r}: "
            "an EAGLE head is calibrated by `treespec train eagle`; for `self` pass --drafter TARGET --layers K"
        )


def _items(dataset: str, data_dir: Path | None, limit: int | None, skip: int, category: str | None) -> list:
    from treespec.bench.datasets import load_prompts

    try:
        items = load_prompts(dataset, data_dir, (limit + skip) if limit else None, category)[skip:]
    except TreespecError as exc:
        _fail(str(exc))
    if not items:
        _fail(f"--skip {skip} leaves no prompts in {dataset!r}")
    return items


def load(
    target: str | None,
    drafter: str | None,
    layers: int | None,
    dataset: str,
    limit: int | None,
    skip: int,
    category: str | None,
    data_dir: Path | None,
    max_new_tokens: int,
    device: str | None,
    dtype: str | None,
    threads: int | None,
) -> Loaded:
    """Target, draft model and tokenised prompts, or one line of error (exit 2)."""
    check_positive(limit=limit, max_new_tokens=max_new_tokens, layers=layers, threads=threads)
    if skip < 0:
        _fail(f"--skip must be >= 0, got {skip}")
    check_threads(threads)
    if target is None:
        from treespec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

        target = DEFAULT_TARGET
        drafter = drafter or DEFAULT_DRAFT
    if drafter is None:
        _fail(
            "no draft model: pass --drafter MODEL (alias, hub id or directory), and --layers K for its first K layers"
        )

    items = _items(dataset, data_dir, limit, skip, category)

    from treespec.bench.datasets import format_turns
    from treespec.models import check_same_tokenizer, load_causal_lm, load_tokenizer
    from treespec.target import TargetModel

    set_threads(threads)
    try:
        tgt = TargetModel.load(target, device=device, dtype=dtype)
        if tgt.tokenizer is None:
            _fail(f"target {target!r} has no tokenizer")
        check_same_tokenizer(tgt.tokenizer, load_tokenizer(drafter), target, drafter)
        draft = load_causal_lm(drafter, device=tgt.device, dtype=tgt.dtype, num_hidden_layers=layers)
        prompts = [format_turns(tgt.tokenizer, item, []) for item in items]
    except TreespecError as exc:
        _fail(str(exc))
    n = len(prompts)
    context = tgt.max_positions
    if context is not None:  # the target's greedy run must fit its context
        prompts = [p for p in prompts if len(p) + max_new_tokens <= context]
        if not prompts:
            _fail(f"no prompt fits the target's context of {context} with --max-new-tokens {max_new_tokens}; lower it")

    spec = f"{drafter} layers={layers}" if layers else drafter
    return Loaded(tgt, draft, target, spec, prompts, n - len(prompts))
