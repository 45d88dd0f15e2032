"""`treespec bench` and `treespec bench-report`: measure configurations against Hugging Face baselines,
write results.json / steps.jsonl / plots, and regenerate docs/benchmarks.md."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from treespec import defaults
from treespec.bench.load import background_load as busy
from treespec.cli import fail
from treespec.cli.bench_batch import bench_batches
from treespec.cli.bench_inputs import baselines_for, load_items, parse_rules, parse_sampling, rows_for
from treespec.cli.bench_report import write_report
from treespec.cli.common import (
    check_positive,
    check_seed,
    check_threads,
    command_line,
    hf_errors_only,
    set_threads,
    writable_dir,
    writable_file,
)
from treespec.cli.decode_options import Device, DeviceMap, Dtype, MaxMemory, OffloadFolder, Threads
from treespec.errors import Interrupted, TreespecError

EPILOG = """\
Examples:

  treespec bench --dataset tinystories --limit 40 --target ../shared/models/stories260K \
--drafter "../shared/models/stories260K layers=3,4" --builder "opt-tree nodes=10,25,60" --builder "chain k=4,8" \
--threads 1 --out docs/bench/tinystories --report docs/benchmarks.md

  treespec bench --limit 10 --out bench/humaneval     # the default pair on HumanEval

  treespec bench-report docs/bench/tinystories bench/humaneval --out docs/benchmarks.md
"""
DATASET_HELP = "mt-bench, spec-bench, gsm8k, humaneval, tinystories, or a .jsonl/.txt file"
DATA_DIR_HELP = "folder of the dataset files [default: $TREESPEC_DATA_DIR or ../shared/prompts]"
DRAFTER_HELP = (
    'drafter spec, repeatable: "NAME-or-MODEL key=v1,v2 ..." (comma lists sweep) '
    "[default with the default target: treespec-py-draft, eagle; with a target that ships a head alone, e.g. "
    "smollm2: its default drafter and its head, defaults.shipped_bench_pairs]"
)
BUILDER_HELP = (
    'builder spec, repeatable: "NAME key=v1,v2 ..." [default: opt-tree, chain k=4; '
    "with the default target: opt-tree nodes=auto,6, chain k=8; with a shipped head alone: opt-tree nodes=auto "
    "(the default drafter and the head), chain k=1 and k=2 (the head)]"
)
BASELINE_HELP = (
    'Hugging Face baselines besides hf-greedy: "hf-assisted [num_assistant_tokens=..] '
    '[num_assistant_tokens_schedule=..] [assistant_confidence_threshold=..]", "hf-lookup '
    '[prompt_lookup_num_tokens=..]"; "none" for none [default: hf-assisted with its defaults, hf-assisted at '
    "each chain k (constant, no confidence stop), hf-lookup]"
)
RULES_HELP = (
    "under sampling, run every treespec configuration once per verification rule, e.g. "
    "specinfer,traversal,auto (docs/sampling.md): same prompts, same seeds"
)
TEMPERATURE_HELP = (
    "0 = greedy; > 0 = sampling in every row (treespec exact speculative sampling, Hugging Face "
    "generate(do_sample=True)); outputs are then not compared token for token"
)
BATCH_HELP = (
    "throughput mode: decode the prompts in batches of these sizes (e.g. 1,4,8,16) against Hugging Face's "
    "batched greedy generate; every row checked against its prompt's own greedy output"
)
CONFIG_HELP = (
    'one configuration, repeatable: "BUILDER-SPEC | DRAFTER-SPEC" (a row label, e.g. "opt-tree nodes=auto | eagle"), '
    "besides every --drafter x --builder"
)
CHAT_HELP = (
    "completion prompts (humaneval, tinystories, .txt) become user requests in the target's chat template, "
    "e.g. HumanEval's as 'Complete the following Python function ...'"
)
TARGET_HELP = f"target model [default: {defaults.TARGET}]"
REPORT_HELP = (
    "then regenerate this Markdown file (e.g. docs/benchmarks.md) from every results.json in --out's parent folder"
)


LIMIT_HELP = "use the first N prompts (conversations for mt-bench)"
CATEGORY_HELP = "only this category, or several separated by commas (mt-bench, spec-bench)"
TURNS_HELP = "keep each conversation's first N turns (mt-bench: 1 = first turns only)"
PER_CATEGORY_HELP = "the first N prompts of every category (instead of --limit), e.g. 3 per MT-Bench category"
LOAD_HELP = (
    "N busy processes (one core's work each) run beside the measurement, started and stopped by the bench: "
    "speed on a busy machine"
)


@hf_errors_only  # assisted generation warns about its own arguments on every call
def bench(
    ctx: typer.Context,
    dataset: Annotated[str, typer.Option(help=DATASET_HELP)] = "humaneval",
    limit: Annotated[Optional[int], typer.Option(help=LIMIT_HELP)] = 10,
    category: Annotated[Optional[str], typer.Option(help=CATEGORY_HELP)] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help=DATA_DIR_HELP, show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(help="new tokens per prompt")] = 128,
    target: Annotated[Optional[str], typer.Option(help=TARGET_HELP, show_default=False)] = None,
    drafter: Annotated[Optional[list[str]], typer.Option(help=DRAFTER_HELP, show_default=False)] = None,
    builder: Annotated[Optional[list[str]], typer.Option(help=BUILDER_HELP, show_default=False)] = None,
    baseline: Annotated[Optional[list[str]], typer.Option(help=BASELINE_HELP, show_default=False)] = None,
    temperature: Annotated[float, typer.Option(help=TEMPERATURE_HELP)] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling threshold when --temperature > 0 (1 = off)")] = 1.0,
    top_k: Annotated[int, typer.Option(help="top-k filter when --temperature > 0 (0 = off)")] = 0,
    seed: Annotated[int, typer.Option(help="random seed; prompt n is sampled with seed + n in every row")] = 0,
    threads: Threads = None,
    device: Device = None,
    dtype: Dtype = None,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    offload_folder: OffloadFolder = None,
    out: Annotated[str, typer.Option(help="folder for results.json, steps.jsonl and the plots")] = "bench-out",
    report_to: Annotated[Optional[Path], typer.Option("--report", help=REPORT_HELP)] = None,
    batch_size: Annotated[Optional[str], typer.Option(help=BATCH_HELP, show_default=False)] = None,
    sampling_rule: Annotated[Optional[str], typer.Option(help=RULES_HELP, show_default=False)] = None,
    turns: Annotated[Optional[int], typer.Option(help=TURNS_HELP, show_default=False)] = None,
    chat: Annotated[bool, typer.Option("--chat", help=CHAT_HELP)] = False,
    config: Annotated[Optional[list[str]], typer.Option(help=CONFIG_HELP, show_default=False)] = None,
    per_category: Annotated[Optional[int], typer.Option(help=PER_CATEGORY_HELP, show_default=False)] = None,
    background_load: Annotated[Optional[int], typer.Option(help=LOAD_HELP, show_default=False)] = None,
) -> None:
    """Measure τ, tokens/s, speed-ups and exactness of treespec configurations against Hugging Face baselines."""
    out, load, sampling, rules, limit = _inputs(
        out, background_load, temperature, top_p, top_k, sampling_rule, seed, threads, limit, max_new_tokens, turns,
        per_category, report_to,
    )  # fmt: skip
    items = load_items(dataset, data_dir, limit, category, turns, chat, per_category)
    target, drafter, builder, pairs = rows_for(target, drafter, builder, config, sampling=temperature > 0)
    placement = dict(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    if batch_size is not None:
        _refuse_in_batches(rules, pairs)
        with busy(load):
            bench_batches(
                ctx, batch_size, items, target, drafter, builder, max_new_tokens, device, dtype, seed, threads,
                placement, dataset, out, report_to, sampling,
            )  # fmt: skip
    else:
        given, baseline = baseline, baselines_for(baseline, builder)
        runner = _runner(
            target, drafter, builder, baseline, max_new_tokens, device, dtype, sampling, seed, threads, placement,
            rules, pairs,
        )  # fmt: skip
        _check_runner(runner, given, target, max_new_tokens)
        names = {"target": target, "drafter": drafter, "limit": limit, "builder": builder, "baseline": baseline}
        result = _result(ctx, names, dataset, category, max_new_tokens, seed, temperature, top_p, top_k, sampling)
        result.update(sampling_rules=rules, background_load=load)
        with busy(load):
            _measure(runner, items, result, out)
    if report_to is not None:
        write_report(sorted(out.parent.glob("*/results.json")), report_to, "--report")


def _inputs(
    out: str,
    background_load: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    sampling_rule: str | None,
    seed: int,
    threads: int | None,
    limit: int | None,
    max_new: int,
    turns: int | None,
    per_category: int | None,
    report_to: Path | None,
) -> tuple[Path, int | None, Any, list[str] | None, int | None]:
    """(out folder, background load, sampling settings, rules, limit: none with --per-category), or one line
    for what cannot run, before anything loads."""
    from treespec.bench.load import check_load

    if not out.strip():  # Path("") is the working directory: never write results there by accident
        fail("--out is empty: name a folder for the results (e.g. --out bench-out, or --out . for this one)")
    load = _checked(check_load, background_load)
    sampling = parse_sampling(temperature, top_p, top_k)
    rules = parse_rules(sampling_rule, sampling)
    _check_counts(seed, threads, limit, max_new, turns, per_category)
    writable_dir(Path(out), "--out")  # before the first run, not after the last
    if report_to is not None:
        writable_file(report_to, "--report")
    return Path(out), load, sampling, rules, None if per_category is not None else limit


def _refuse_in_batches(rules: list[str] | None, pairs: list) -> None:
    if rules:
        fail(
            "--sampling-rule compares rules under sampling; --batch-size measures greedy throughput: use one or the other"
        )
    if pairs:
        fail("--config rows are not measured in batches yet: with --batch-size give --drafter and --builder")


def _check_counts(
    seed: int | None, threads: int | None, limit: int | None, max_new: int, turns: int | None, per_category: int | None
) -> None:
    """One line for a count that cannot run, before anything loads."""
    check_seed(seed)
    check_threads(threads)
    check_positive(limit=limit, max_new_tokens=max_new, turns=turns, per_category=per_category)


def _check_runner(runner: Any, given: list[str] | None, target: str, max_new_tokens: int) -> None:
    """One line for rows the loaded models cannot run: assisted generation without a draft model, or no
    room for a prompt in the target's context."""
    if any(b.split()[:1] == ["hf-assisted"] for b in given or []) and not any(
        c.kind == "hf-assisted" for c in runner.configs
    ):
        fail(
            "--baseline hf-assisted runs Hugging Face's assisted generation with a draft MODEL, and no --drafter names "
            "one: add a draft model (e.g. --drafter llama-68m, or the target's folder with layers=K), or drop the baseline"
        )
    context = runner.target.max_positions
    if context is not None and max_new_tokens >= context:  # no room left for any prompt
        fail(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in {target!r}'s context of {context} "
            f"tokens: use at most {context - 1}"
        )


def _result(
    ctx: typer.Context,
    names: dict[str, Any],
    dataset: str,
    category: str | None,
    max_new_tokens: int,
    seed: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    sampling: Any,
) -> dict[str, Any]:
    """results.json's header: the command that reproduces the run (every effective setting), and the settings."""
    names = {**names, "baseline": names["baseline"] or ["none"]}
    return {
        "command": shlex.join(command_line(ctx, names)),
        "dataset": dataset,
        "category": category,
        "prompts": 0,
        "truncated": 0,
        "max_new_tokens": max_new_tokens,
        "target": names["target"],
        "seed": seed,
        "temperature": temperature,
        "top_p": top_p if sampling else None,
        "top_k": top_k if sampling else None,
    }


def _runner(
    target: str,
    drafter: list[str],
    builder: list[str],
    baseline: list[str],
    max_new_tokens: int,
    device: str | None,
    dtype: str | None,
    sampling: dict | None,
    seed: int,
    threads: int | None,
    placement: dict[str, Any],
    rules: list[str] | None = None,
    pairs: list | None = None,
) -> Any:
    import torch

    from treespec.bench.runner import Bench

    torch.manual_seed(seed)
    set_threads(threads)
    try:
        return Bench(
            target,
            drafter,
            builder,
            baseline,
            max_new_tokens,
            device=device,
            dtype=dtype,
            sampling=sampling,
            seed=seed,
            placement=placement,
            rules=rules,
            pairs=pairs,
        )
    except TreespecError as exc:
        fail(str(exc))


def _measure(runner: Any, items: list, result: dict[str, Any], out: Path) -> None:
    """Run every configuration on every prompt with a progress bar. results.json and steps.jsonl are
    rewritten (atomically) after every prompt, so an interrupt or a failure keeps the finished
    prompts; the file says ``"partial": true`` until the run completes."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from treespec.bench import report

    result["environment"] = report.environment()
    n_runs = sum(len(i.turns) for i in items) * len(runner.configs)
    steps: list[dict] = []
    columns = (
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
    )
    # redrawn at each finished sample, never by rich's refresh thread: waking ten times a second beside the
    # timed forwards, it slowed them (`treespec profile`: SmolLM2's one-token forward 37 → 64 ms)
    with Progress(*columns, transient=False, auto_refresh=False) as progress:
        task = progress.add_task("warm-up", total=n_runs)

        def on_sample(config, n, sample, same):
            for i, st in enumerate(sample.steps):
                steps.append({"config": config.label, "prompt": n, "step": i, **st})
            progress.update(
                task, advance=1, description=f"{config.label[:40]}{'' if same else ' [red]differs'}", refresh=True
            )

        def on_prompt(samples):  # every configuration finished this prompt: save what we have
            report.write_results(out, _with_rows(result, runner, samples, partial=True), steps)

        try:
            samples = runner.run(items, on_sample=on_sample, on_prompt=on_prompt)
        except (KeyboardInterrupt, Interrupted):  # Ctrl-C in Hugging Face's generate, or in treespec's
            _stopped(out, "interrupted", 130)
        except TreespecError as exc:
            _stopped(out, str(exc), 1)
        except OSError as exc:  # writing the results failed (a full disk): the last complete files stay
            _stopped(out, f"cannot write into {out}: {exc.strerror or exc}; free some space or pick another --out", 1)
    final = _with_rows(result, runner, samples, partial=False)
    report.print_table(final)
    try:
        files = report.write_outputs(out, final, steps)
    except TreespecError as exc:  # a write failed (treespec.files): the last complete files stay
        _stopped(out, str(exc), 1)
    typer.echo(f"wrote {out / 'results.json'}, {out / 'steps.jsonl'}, " + ", ".join(str(f) for f in files))


def _with_rows(result: dict[str, Any], runner: Any, samples: dict, partial: bool) -> dict[str, Any]:
    rows = runner.rows(samples) if any(samples.values()) else []
    cats = runner.categories[: runner.n_prompts]
    extra = {"prompt_categories": cats} if any(cats) else {}  # per-category speed-ups (report.category_lines)
    return {
        **result,
        "prompts": runner.n_prompts,
        "truncated": runner.truncated,
        **extra,
        "rows": rows,
        "partial": partial,
    }


def _stopped(out: Path, why: str, code: int) -> None:
    saved = (out / "results.json").is_file()
    kept = (
        f"the prompts finished so far are in {out / 'results.json'} (marked partial)" if saved else "no prompt finished"
    )
    fail(f"bench stopped ({why}); {kept}", code=code)


def _checked(check: Any, value: Any) -> Any:
    try:
        return check(value)
    except TreespecError as exc:
        fail(str(exc))
