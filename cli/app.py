"""`treespec`: run, and list plugins. Imports torch only in commands that decode."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from treespec.cli import fail as _fail

from treespec.errors import TreespecError
from treespec.models import DEFAULT_TARGET

app = typer.Typer(
    help="Lossless speculative decoding with draft trees.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts contain literal [brackets]
)

OPTION_HELP = (
    "builder option name=value, repeatable or comma-separated (e.g. -B nodes=25 -B threshold=0.3). "
    "`treespec plugins` lists every option."
)
D_OPTION_HELP = (
    "drafter option name=value, repeatable or comma-separated (e.g. -D layers=4, -D head=DIR, "
    "-D ngram.max_ngram=4 for a part of a+b). `treespec plugins` lists every option."
)

EPILOG = """\
Examples:

  treespec run --target ../shared/models/stories260K --drafter ../shared/models/stories260K -D layers=4 --builder opt-tree -B nodes=25 --prompt "Once upon a time"

  treespec run --drafter llama-68m --target meta-llama/Llama-2-7b-hf --builder chain -B k=6 --json
"""


# The default pair is treespec's own (docs/default-pair.md), shipped in the package: the target
# treespec-py drafted by its EAGLE head, with the node budget that was fastest for it on this 2-core
# CPU (docs/benchmarks.md, "humaneval-default-pair"; a tree of n nodes is far from free on a CPU).
DEFAULT_DRAFTER = "eagle"
DEFAULT_BUILDER_OPTIONS = {"opt-tree": {"nodes": "6"}, "eagle2": {"top_k": "4", "depth": "6", "total_tokens": "8"}}
DEFAULT_PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'


def _default_pair(
    target: str | None, drafter: str | None, builder: str | None = None, b_opts: dict[str, str] | None = None
) -> tuple[str, str | None]:
    """No --target: treespec's own target, with no --drafter the default drafter, and for its builders
    the measured budget unless -B sets one."""
    if target is None:
        target = DEFAULT_TARGET
        drafter = drafter or DEFAULT_DRAFTER
        if b_opts is not None:
            for key, value in DEFAULT_BUILDER_OPTIONS.get(builder or "", {}).items():
                b_opts.setdefault(key, value)
    return target, drafter


@app.command(epilog=EPILOG)
def run(
    target: Annotated[Optional[str], typer.Option(help=f"target model: hub id, alias or local directory [default: {DEFAULT_TARGET}]", show_default=False)] = None,
    drafter: Annotated[Optional[str], typer.Option(help=f"drafter name, or a draft model (alias, hub id, directory); a+b composes drafters, e.g. self+ngram with -D ngram.max_ngram=4 [default with the default target: its EAGLE head, and -B nodes=6 for opt-tree]", show_default=False)] = None,
    builder: Annotated[str, typer.Option(help="tree builder name (see `treespec plugins`)")] = "opt-tree",
    builder_option: Annotated[Optional[list[str]], typer.Option("--builder-option", "-B", help=OPTION_HELP)] = None,
    drafter_option: Annotated[Optional[list[str]], typer.Option("--drafter-option", "-D", help=D_OPTION_HELP)] = None,
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="read the prompt from this file")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="stop after this many new tokens")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy (lossless token for token); > 0 = exact speculative sampling")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling: keep the smallest set of tokens with probability >= top_p (1 = off)")] = 1.0,
    top_k: Annotated[int, typer.Option(help="keep the k likeliest tokens (0 = off; Hugging Face's generate defaults to 50)")] = 0,
    draft_temperature: Annotated[Optional[float], typer.Option(help="the draft's temperature for builders with sample=true [default: --temperature]", show_default=False)] = None,
    sampling_rule: Annotated[str, typer.Option(help="verification rule when sampling: auto, specinfer, deterministic, target-only (docs/sampling.md)")] = "auto",
    seed: Annotated[int, typer.Option(help="random seed: the same seed gives the same sampled output")] = 0,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1, mps ... (default: cpu)")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16, float16 (default: float32 on CPU)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (tiny models run fastest on 1)")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="let the target run its own code from the hub (the draft: -D trust_remote_code=true)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streaming text")] = False,
    echo: Annotated[Optional[bool], typer.Option("--echo/--no-echo", help="print the prompt (dimmed) before the completion [default: when stdout is a terminal]", show_default=False)] = None,
) -> None:
    """Generate from a prompt with tree speculative decoding; prints the text and one line of statistics."""
    from treespec.config import parse_pairs

    try:
        b_opts = parse_pairs(builder_option, "builder")
        d_opts = parse_pairs(drafter_option, "drafter")
        if prompt is not None and prompt_file is not None:
            _fail("give --prompt or --prompt-file, not both")
        if prompt_file is not None:
            if not prompt_file.is_file():
                _fail(f"--prompt-file {prompt_file}: no such file")
            text = prompt_file.read_text()
        else:
            text = prompt if prompt is not None else DEFAULT_PROMPT
        target, drafter = _default_pair(target, drafter, builder, b_opts)
        if drafter is None:
            _fail("no drafter: pass --drafter NAME, a draft model (alias, hub id or directory), or -D model=PATH")
        if drafter == "model" and "model" not in d_opts:
            _fail("drafter 'model' needs a draft model: --drafter MODEL (alias, hub id or directory) or -D model=PATH")

        import torch

        from treespec.decoder import Decoder

        torch.manual_seed(seed)
        if threads is not None:
            if threads <= 0:
                _fail(f"--threads must be > 0, got {threads}")
            torch.set_num_threads(threads)
        dec = Decoder(target, drafter, builder, d_opts, b_opts, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    except TreespecError as exc:
        _fail(str(exc))

    printed = [""]

    def stream(_new: list[int]) -> None:
        full = dec.decode(out_ids, prompt_ids)
        # print only complete characters: a token may end inside a multi-byte character
        if full.endswith("\ufffd"):
            return
        sys.stdout.write(full[len(printed[0]) :])
        sys.stdout.flush()
        printed[0] = full

    out_ids: list[int] = []
    try:
        prompt_ids = dec.encode(text)
    except TreespecError as exc:
        _fail(str(exc))

    if not as_json and (echo if echo is not None else sys.stdout.isatty()):
        # the prompt, so that the completion reads in context; stdout stays the completion alone when piped
        typer.secho(text, nl=False, dim=True)

    def collect(new: list[int]) -> None:
        out_ids.extend(new)
        if not as_json:
            stream(new)

    from treespec.errors import DecodingError

    error = None
    try:
        out = dec.generate(prompt_ids, max_new_tokens=max_new_tokens, stream=collect, temperature=temperature,
                           top_p=top_p, top_k=top_k, seed=seed, draft_temperature=draft_temperature,
                           rule=sampling_rule)
    except DecodingError as exc:
        out, error = exc.output, str(exc)
    except TreespecError as exc:
        _fail(str(exc))
    if as_json:
        payload = {"text": out.text, "token_ids": out.token_ids, "stats": out.stats.to_dict()}
        if error:
            payload["error"] = error
        print(json.dumps(payload, ensure_ascii=False))
    else:
        sys.stdout.write(out.text[len(printed[0]) :] + "\n")
        sys.stdout.flush()
        typer.secho(out.stats.summary(), fg=typer.colors.CYAN, err=True)
    if error:
        _fail(error, code=1)


BENCH_EPILOG = """\
Examples:

  treespec bench --dataset tinystories --limit 40 --target ../shared/models/stories260K --drafter "../shared/models/stories260K layers=3,4" --builder "opt-tree nodes=10,25,60" --builder "chain k=4,8" --threads 1 --out docs/bench/tinystories --report docs/benchmarks.md

  treespec bench --limit 10 --out bench/humaneval     # the default pair on HumanEval

  treespec bench-report docs/bench/tinystories bench/humaneval --out docs/benchmarks.md
"""


@app.command(epilog=BENCH_EPILOG)
def bench(
    dataset: Annotated[str, typer.Option(help="mt-bench, spec-bench, gsm8k, humaneval, tinystories, or a .jsonl/.txt file")] = "humaneval",
    limit: Annotated[Optional[int], typer.Option(help="use the first N prompts (conversations for mt-bench)")] = 10,
    category: Annotated[Optional[str], typer.Option(help="only this category (mt-bench, spec-bench)")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="folder of the dataset files [default: $TREESPEC_DATA_DIR or ../shared/prompts]", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(help="new tokens per prompt")] = 128,
    target: Annotated[Optional[str], typer.Option(help=f"target model [default: {DEFAULT_TARGET}]", show_default=False)] = None,
    drafter: Annotated[Optional[list[str]], typer.Option(help='drafter spec, repeatable: "NAME-or-MODEL key=v1,v2 ..." (comma lists sweep) [default with the default target: treespec-py-draft, eagle]', show_default=False)] = None,
    builder: Annotated[Optional[list[str]], typer.Option(help='builder spec, repeatable: "NAME key=v1,v2 ..." [default: opt-tree, chain k=4; with the default target: opt-tree nodes=6, chain k=8]', show_default=False)] = None,
    baseline: Annotated[Optional[list[str]], typer.Option(help='Hugging Face baselines besides hf-greedy: "hf-assisted [num_assistant_tokens=..] [num_assistant_tokens_schedule=..] [assistant_confidence_threshold=..]", "hf-lookup [prompt_lookup_num_tokens=..]"; "none" for none [default: hf-assisted with its defaults, hf-assisted at each chain k (constant, no confidence stop), hf-lookup]', show_default=False)] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 = sampling in every row (treespec exact speculative sampling, Hugging Face generate(do_sample=True)); outputs are then not compared token for token")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling threshold when --temperature > 0 (1 = off)")] = 1.0,
    top_k: Annotated[int, typer.Option(help="top-k filter when --temperature > 0 (0 = off)")] = 0,
    seed: Annotated[int, typer.Option(help="random seed; prompt n is sampled with seed + n in every row")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch [default: torch's]", show_default=False)] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, ...")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16, ...")] = None,
    out: Annotated[Path, typer.Option(help="folder for results.json, steps.jsonl and the plots")] = Path("bench-out"),
    report_to: Annotated[Optional[Path], typer.Option("--report", help="then regenerate this Markdown file (e.g. docs/benchmarks.md) from every results.json in --out's parent folder")] = None,
) -> None:
    """Measure τ, tokens/s, speed-ups and exactness of treespec configurations against Hugging Face baselines."""
    from treespec.bench.datasets import load_prompts

    sampling = None
    if temperature != 0.0:
        from treespec.sampling import SamplingParams

        try:
            SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        except TreespecError as exc:
            _fail(str(exc))
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    if limit is not None and limit <= 0:
        _fail(f"--limit must be > 0, got {limit}")
    if max_new_tokens <= 0:
        _fail(f"--max-new-tokens must be > 0, got {max_new_tokens}")
    try:
        items = load_prompts(dataset, data_dir, limit, category)
    except TreespecError as exc:
        _fail(str(exc))
    if target is None:  # the default pair: its draft model and its EAGLE head, at their measured budgets
        target = DEFAULT_TARGET
        drafter = drafter or ["treespec-py-draft", DEFAULT_DRAFTER]
        builder = builder or ["opt-tree nodes=6", "chain k=8"]
    if not drafter:
        _fail('no drafter: pass --drafter "MODEL-or-NAME [key=value ...]"')
    builder = builder or ["opt-tree", "chain k=4"]
    if baseline is None:
        from treespec.bench.runner import default_baselines

        try:
            baseline = default_baselines(builder)
        except TreespecError as exc:
            _fail(str(exc))
    elif baseline == ["none"]:
        baseline = []

    import torch

    from treespec.bench import report
    from treespec.bench.runner import Bench

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # assisted generation warns about its own arguments on every call
    torch.manual_seed(seed)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        runner = Bench(target, drafter, builder, baseline, max_new_tokens, device=device, dtype=dtype,
                       sampling=sampling, seed=seed)
    except TreespecError as exc:
        _fail(str(exc))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    n_runs = sum(len(i.turns) for i in items) * len(runner.configs)
    steps: list[dict] = []
    with Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.description}"), transient=False) as progress:
        task = progress.add_task("warm-up", total=n_runs)

        def on_sample(config, n, sample, same):
            for i, st in enumerate(sample.steps):
                steps.append({"config": config.label, "prompt": n, "step": i, **st})
            progress.update(task, advance=1, description=f"{config.label[:40]}{'' if same else ' [red]differs'}")

        try:
            samples = runner.run(items, on_sample=on_sample)
        except TreespecError as exc:
            _fail(str(exc), code=1)
    command = ["treespec", "bench", "--dataset", dataset, "--limit", str(limit), "--max-new-tokens", str(max_new_tokens),
               "--target", target]
    command += [a for flag, values in (("--drafter", drafter), ("--builder", builder), ("--baseline", baseline or ["none"]))
                for v in values for a in (flag, v)]
    command += (["--category", category] if category else []) + (["--data-dir", str(data_dir)] if data_dir else [])
    if sampling:
        command += ["--temperature", str(temperature), "--top-p", str(top_p), "--top-k", str(top_k)]
    command += ["--seed", str(seed)] + (["--threads", str(threads)] if threads else []) + ["--out", str(out)]
    command += ["--report", str(report_to)] if report_to else []
    result = {
        "command": report.command_line(command),
        "dataset": dataset,
        "category": category,
        "prompts": runner.n_prompts,
        "truncated": runner.truncated,
        "max_new_tokens": max_new_tokens,
        "target": target,
        "seed": seed,
        "temperature": temperature,
        "top_p": top_p if sampling else None,
        "top_k": top_k if sampling else None,
        "environment": report.environment(),
        "rows": runner.rows(samples),
    }
    report.print_table(result)
    files = report.write_outputs(out, result, steps)
    typer.echo(f"wrote {out / 'results.json'}, {out / 'steps.jsonl'}, " + ", ".join(str(f) for f in files))
    if report_to is not None:
        _write_report(sorted(out.parent.glob("*/results.json")), report_to)


def _write_report(paths: list[Path], out: Path) -> None:
    from treespec.bench import report

    loaded = []
    for path in paths:
        if not path.is_file():
            _fail(f"{path}: no such results.json; run `treespec bench --out DIR` first")
        loaded.append((path.resolve(), json.loads(path.read_text())))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.markdown(loaded, out.resolve().parent))
    typer.echo(f"wrote {out}")


@app.command("bench-report")
def bench_report(
    runs: Annotated[list[Path], typer.Argument(help="bench output folders (or results.json files), in the order to show")],
    out: Annotated[Path, typer.Option(help="the Markdown file to write")] = Path("docs/benchmarks.md"),
) -> None:
    """Regenerate docs/benchmarks.md from the results.json of bench runs."""
    _write_report([r / "results.json" if r.is_dir() else r for r in runs], out)


tree_app = typer.Typer(help="Look at draft trees.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(tree_app, name="tree")


@tree_app.command("presets")
def tree_presets() -> None:
    """List the static builder's named tree shapes, with their size, depth and source."""
    from treespec.plugins.static import load_shape, preset_names, preset_source

    for name in preset_names():
        paths = load_shape(name)
        typer.echo(f"{name:24s} {len(paths):3d} nodes, depth {max(map(len, paths))}  {preset_source(name)}")
    typer.echo("also: chain-K (a chain of K), kary-K-D (K children per node, depth D), a JSON list of rank paths, or a JSON file")


@tree_app.command("show", epilog="Example:\n\n  treespec tree show --builder opt-tree -B nodes=25 --png tree.png")
def tree_show(
    builder: Annotated[str, typer.Option(help="tree builder name")] = "opt-tree",
    builder_option: Annotated[Optional[list[str]], typer.Option("--builder-option", "-B", help=OPTION_HELP)] = None,
    target: Annotated[Optional[str], typer.Option(help=f"target model [default: {DEFAULT_TARGET}]", show_default=False)] = None,
    drafter: Annotated[Optional[str], typer.Option(help=f"drafter name or draft model [default with the default target: {DEFAULT_DRAFTER}]", show_default=False)] = None,
    drafter_option: Annotated[Optional[list[str]], typer.Option("--drafter-option", "-D", help=D_OPTION_HELP)] = None,
    prompt: Annotated[str, typer.Option(help="prompt text [default: a Python class opening]", show_default=False)] = DEFAULT_PROMPT,
    dot: Annotated[Optional[Path], typer.Option(help="also write the tree as Graphviz DOT")] = None,
    png: Annotated[Optional[Path], typer.Option(help="also draw the tree to a PNG (matplotlib)")] = None,
    max_nodes: Annotated[int, typer.Option(help="show at most this many nodes in the terminal")] = 200,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, ...")] = None,
) -> None:
    """Build one tree for a prompt, verify it with the target, and draw it (accepted path highlighted)."""
    from treespec.config import parse_pairs

    try:
        b_opts = parse_pairs(builder_option, "builder")
        d_opts = parse_pairs(drafter_option, "drafter")
        target, drafter = _default_pair(target, drafter, builder, b_opts)
        if drafter is None:
            _fail("no drafter: pass --drafter NAME or a draft model")
        from rich.console import Console

        from treespec.tools import render
        from treespec.decoder import Decoder

        dec = Decoder(target, drafter, builder, d_opts, b_opts, device=device)
        ids, tree, acc = dec.draft_and_verify(prompt)
    except TreespecError as exc:
        _fail(str(exc))
    show = render.token_text(dec.target.tokenizer)
    decode = dec.decode
    console = Console()
    console.print(f"prompt: {prompt!r} ({len(ids)} tokens) · builder {builder} {b_opts or ''}")
    console.print(render.rich_tree(tree, acc, show, max_nodes=max_nodes))
    console.print(
        f"{tree.size} drafted nodes, depth {tree.depth}, E(A) = Σ p̂ = {tree.expected_accepted():.2f}; "
        f"the target accepts {acc.accepted} + 1 bonus token: {decode(acc.tokens + [acc.bonus], ids)!r}"
    )
    if dot is not None:
        dot.write_text(render.to_dot(tree, acc, show))
        console.print(f"wrote {dot} (render with: dot -Tpng {dot} -o tree.png)")
    if png is not None:
        try:
            render.to_png(tree, acc, show, png)
        except TreespecError as exc:
            _fail(str(exc))
        console.print(f"wrote {png}")


@app.command()
def plugins(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List the builders and drafters that are installed, with their package, version and options."""
    from treespec.config import describe_options
    from treespec.registry import load_plugins

    try:
        reg = load_plugins()
    except TreespecError as exc:
        _fail(str(exc))
    rows = []
    for kind, table in (("builder", reg.builders), ("drafter", reg.drafters)):
        for name in sorted(table):
            e = table[name]
            rows.append(
                {
                    "kind": kind,
                    "name": name,
                    "aliases": list(e.spec.aliases),
                    "summary": e.spec.summary,
                    "package": e.package,
                    "version": e.version,
                    "entry_point": e.source,
                    "options": describe_options(e.spec.config),
                }
            )
    failures = [{"entry_point": n, "package": p, "error": err} for n, p, err in reg.failures]
    if as_json:
        print(json.dumps({"plugins": rows, "failed": failures, "skipped": reg.skipped, "unmatched": reg.unmatched}, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="treespec plugins")
    for col in ("kind", "name", "package", "options", "summary"):
        table.add_column(col, overflow="fold")
    for r in rows:
        opts = ", ".join(
            f"{o['name']}" + (" (required)" if o["required"] else f"={o['default']}") for o in r["options"]
        )
        name = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
        table.add_row(r["kind"], name, f"{r['package']} {r['version']}", opts, r["summary"])
    console.print(table)
    for f in failures:
        console.print(f"[red]failed to load[/red] {f['entry_point']} ({f['package']}): {f['error']}")
    if reg.unmatched:
        console.print(f"[yellow]no entry point is named[/yellow] {', '.join(reg.unmatched)} (TREESPEC_LOAD_PLUGINS/TREESPEC_BLOCK_PLUGINS take entry-point names)")
    if reg.skipped:
        console.print(f"skipped by TREESPEC_LOAD_PLUGINS/TREESPEC_BLOCK_PLUGINS: {', '.join(reg.skipped)}")


from treespec.cli.sequoia import EPILOG as SEQUOIA_EPILOG, sequoia_measure  # noqa: E402

app.command("sequoia-measure", epilog=SEQUOIA_EPILOG)(sequoia_measure)

from treespec.cli.calibrate import EPILOG as CALIBRATE_EPILOG, calibrate  # noqa: E402

app.command("calibrate", epilog=CALIBRATE_EPILOG)(calibrate)

from treespec.cli.datastore import datastore_app  # noqa: E402

app.add_typer(datastore_app, name="datastore")

from treespec.cli.train import train_app  # noqa: E402

app.add_typer(train_app, name="train")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
