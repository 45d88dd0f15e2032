"""`treespec run --batch-size B --prompt-file F`: decode a file of prompts, B rows in flight.

F is read as a dataset (``treespec.bench.datasets.load_prompts``): a ``.jsonl`` of records with
``prompt``/``text``/``turns``/``question`` fields, or a ``.txt`` whose prompts are separated by blank
lines. The prompts go through ``Decoder.generate([...], batch_size=B)`` in chunks of ``4·B``: every
step verifies all rows' trees in one target forward, and a finished row's place goes to the next
prompt of the chunk (continuous batching); each chunk's outputs are printed when it is done. Output:
with ``--json`` one JSON object per prompt and line, else each completion after a ``### prompt N``
header; statistics (one line per chunk) go to stderr. Ctrl-C or SIGTERM (exit 130 / 143) or a failure
(exit 1) mid-chunk still prints that chunk's finished outputs and its rows' partial ones
(``stats.stop_reason`` "interrupted" / "error"), then one error line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from treespec.cli import fail
from treespec.cli.common import interrupt_exit, sigterm_as_interrupt, stdout_failed
from treespec.errors import DecodingError, Interrupted, TreespecError

CHUNK = 4  # prompts per generate call, in batch sizes: outputs appear chunk by chunk, rows refill within one


def _prompts(dec: Any, prompt_file: Path, chat: bool, system: str | None) -> list[list[int]]:
    """The file's prompts as token ids (first turns; in the chat template with --chat or --system)."""
    from treespec.bench.datasets import format_turns, load_prompts
    from treespec.inputs import chat_ids

    try:
        items = load_prompts(str(prompt_file))
        tok = dec.target.tokenizer
        if not (chat or system is not None):
            return [format_turns(tok, it, []) for it in items]
        sys_turn = [{"role": "system", "content": system}] if system is not None else []
        where = f"target {dec.target.name!r}"
        return [dec.encode(chat_ids(tok, sys_turn + [{"role": "user", "content": it.turns[0]}], where)) for it in items]
    except TreespecError as exc:
        fail(str(exc))


def _summary(outs: list[Any], start: int, n: int, batch_size: int, seconds: float) -> None:
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(len(o.stats.steps) for o in outs)
    tau = tokens / steps if steps else 0.0
    typer.secho(
        f"prompts {start + 1}-{start + n} ({min(batch_size, n)} rows): {tokens} tokens in {seconds:.2f} s "
        f"({tokens / max(seconds, 1e-9):.1f} tokens/s), τ {tau:.2f}",
        fg=typer.colors.CYAN,
        err=True,
    )


def run_batches(
    dec: Any,
    prompt_file: Path | None,
    batch_size: int,
    max_new_tokens: int,
    sampling: dict[str, Any],
    chat: bool,
    system: str | None,
    as_json: bool,
) -> None:
    if batch_size <= 0:
        fail(f"--batch-size must be > 0, got {batch_size}")
    if prompt_file is None:
        fail(
            "--batch-size decodes a file of prompts: give --prompt-file F (.jsonl records or blank-line separated .txt)"
        )
    prompts = _prompts(dec, prompt_file, chat, system)
    with sigterm_as_interrupt() as term:
        for start in range(0, len(prompts), CHUNK * batch_size):
            chunk = prompts[start : start + CHUNK * batch_size]
            began = time.perf_counter()
            error, code = None, 1
            try:
                outs = dec.generate(chunk, max_new_tokens=max_new_tokens, batch_size=batch_size, **sampling)
            except DecodingError as exc:  # Ctrl-C, SIGTERM or a failure: print what the chunk's rows generated
                outs, error = exc.outputs, str(exc)
                if isinstance(exc, Interrupted):
                    error, code = interrupt_exit(error, term)
            except TreespecError as exc:
                fail(str(exc))
            _print_chunk(outs, start, as_json)
            _summary(outs, start, len(chunk), batch_size, time.perf_counter() - began)
            if error:
                fail(
                    f"{error} in prompts {start + 1}-{start + len(chunk)} of {len(prompts)}; every prompt that "
                    "started is printed",
                    code=code,
                )


def _print_chunk(outs: list[Any], start: int, as_json: bool) -> None:
    """The chunk's outputs (those of prompts that started: finished, or partial after an interrupt),
    as JSON lines or after ``### prompt N`` headers; a stdout that cannot be written is one line."""
    try:
        for i, out in enumerate(outs):
            if out.stats.stop_reason == "not started":
                continue
            n = start + i + 1
            if as_json:
                print(
                    json.dumps(
                        {"prompt": n, "text": out.text, "token_ids": out.token_ids, "stats": out.stats.to_dict()},
                        ensure_ascii=False,
                    ),
                    flush=True,
                )
            else:
                print(f"### prompt {n}\n{out.text}", flush=True)
    except OSError as exc:
        stdout_failed(exc)
