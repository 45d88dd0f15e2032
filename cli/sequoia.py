"""`treespec sequoia-measure`: measure the per-rank acceptance vector the `sequoia` builder needs.

Registered in ``cli/app.py`` with ``app.command("sequoia-measure", epilog=EPILOG)(sequoia_measure)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from treespec.cli import fail as _fail

from treespec.errors import TreespecError

EPILOG = """\
Examples:

  treespec sequoia-measure --target ../shared/models/stories260K --drafter ../shared/models/stories260K --layers 4 --dataset tinystories --limit 20 --out acceptance-l4.json

  treespec run --target ../shared/models/stories260K --builder sequoia -B nodes=40 -B acceptance=acceptance-l4.json --drafter ../shared/models/stories260K -D layers=4
"""





def sequoia_measure(
    target: Annotated[Optional[str], typer.Option(help="target model: hub id, alias or local directory [default: treespec-py]", show_default=False)] = None,
    drafter: Annotated[Optional[str], typer.Option(help="draft model: alias, hub id or local directory [default with the default target: treespec-py-draft]", show_default=False)] = None,
    layers: Annotated[Optional[int], typer.Option(help="keep only the draft model's first k decoder layers")] = None,
    dataset: Annotated[str, typer.Option(help="mt-bench, spec-bench, gsm8k, humaneval, tinystories, or a .jsonl/.txt file")] = "humaneval",
    limit: Annotated[Optional[int], typer.Option(help="use N prompts (first turns only)")] = 20,
    skip: Annotated[int, typer.Option(help="skip the first S prompts (measure on prompts a benchmark does not use)")] = 0,
    category: Annotated[Optional[str], typer.Option(help="only this category (mt-bench, spec-bench)")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="folder of the dataset files [default: $TREESPEC_DATA_DIR or ../shared/prompts]", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(help="greedy tokens the target generates per prompt")] = 128,
    ranks: Annotated[int, typer.Option(help="length of the acceptance vector (draft ranks counted)")] = 16,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1, mps ... (default: cpu)")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16, float16 (default: float32 on CPU)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch")] = None,
    out: Annotated[Optional[Path], typer.Option(help="write the JSON here (for `--builder sequoia -B acceptance=FILE`) [default: print it]", show_default=False)] = None,
) -> None:
    """Measure the draft's per-rank acceptance vector on the target's greedy outputs (for `--builder sequoia`)."""
    if limit is not None and limit <= 0:
        _fail(f"--limit must be > 0, got {limit}")
    if max_new_tokens <= 0:
        _fail(f"--max-new-tokens must be > 0, got {max_new_tokens}")
    if ranks <= 0:
        _fail(f"--ranks must be > 0, got {ranks}")
    if layers is not None and layers <= 0:
        _fail(f"--layers must be > 0, got {layers}")
    if threads is not None and threads <= 0:
        _fail(f"--threads must be > 0, got {threads}")
    if target is None:
        from treespec.models import DEFAULT_DRAFT, DEFAULT_TARGET

        target = DEFAULT_TARGET
        drafter = drafter or DEFAULT_DRAFT
    if drafter is None:
        _fail("no draft model: pass --drafter MODEL (alias, hub id or directory), and --layers K for its first K layers")

    from treespec.datasets import format_turns, load_prompts

    try:
        items = load_prompts(dataset, data_dir, (limit + skip) if limit else None, category)[skip:]
        if not items:
            _fail(f"--skip {skip} leaves no prompts in {dataset!r}")
    except TreespecError as exc:
        _fail(str(exc))

    import torch

    from treespec.acceptance import measure_acceptance
    from treespec.models import check_same_tokenizer, load_causal_lm, load_tokenizer
    from treespec.target import TargetModel

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        tgt = TargetModel.load(target, device=device, dtype=dtype)
        if tgt.tokenizer is None:
            _fail(f"target {target!r} has no tokenizer")
        check_same_tokenizer(tgt.tokenizer, load_tokenizer(drafter), target, drafter)
        draft = load_causal_lm(drafter, device=tgt.device, dtype=tgt.dtype, num_hidden_layers=layers)
        prompts = [format_turns(tgt.tokenizer, item, []) for item in items]
    except TreespecError as exc:
        _fail(str(exc))
    context = tgt.max_positions
    skipped = 0
    if context is not None:  # the target's greedy run must fit its context
        fits = [p for p in prompts if len(p) + max_new_tokens <= context]
        skipped = len(prompts) - len(fits)
        if not fits:
            _fail(f"no prompt fits the target's context of {context} with --max-new-tokens {max_new_tokens}; lower it")
        prompts = fits

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about pad tokens on every call
    drafter_name = f"{drafter} layers={layers}" if layers else drafter
    result = measure_acceptance(
        tgt, draft, prompts, max_new_tokens, ranks, target_name=target, drafter_name=drafter_name, dataset=dataset
    )
    result.update({"limit": limit, "skip": skip, "category": category, "skipped_too_long": skipped,
                   "dtype": str(tgt.dtype).replace("torch.", "")})
    text = json.dumps(result, indent=2)
    p = result["acceptance"]
    summary = (
        f"p = [{', '.join(f'{x:.3f}' for x in p[:6])}{', ...' if len(p) > 6 else ''}] "
        f"over {result['positions']} positions of {len(prompts)} prompts (rank ≥ {ranks}: {result['beyond']:.3f})"
    )
    if out is None:
        sys.stdout.write(text + "\n")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        summary += f"; wrote {out} (use: --builder sequoia -B acceptance={out})"
    typer.secho(summary, fg=typer.colors.CYAN, err=True)
