"""`treespec export`: measure acceptance by depth and rank, and export a head with its tree to vLLM or SGLang.

Registered in ``cli/app.py`` with ``app.add_typer(export_app, name="export")``. The logic is in
``treespec/export/`` (docs/serving.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from treespec.cli import fail
from treespec.cli.common import check_positive, pair_options, set_threads, writable_file, write_or_print
from treespec.cli.decode_options import DrafterOptions
from treespec.errors import TreespecError

export_app = typer.Typer(
    help="Export a trained head and its best tree to a serving engine (vLLM, SGLang).",
    no_args_is_help=True,
    rich_markup_mode=None,
)

EPILOG = """\
Examples:

  treespec export measure --target smollm2 --drafter eagle --dataset mt-bench --limit 20 --out acc.json

  treespec export vllm --target smollm2 --head smollm2-eagle --acceptance acc.json --nodes 16 --out serve/vllm

  treespec export sglang --target smollm2 --head smollm2-eagle --acceptance acc.json --out serve/sglang

The export folder holds the head (config.json, model.safetensors), plan.json (the trees and their
expected acceptance) and launch.txt (the command that serves it), which is also printed.
"""

Target = Annotated[
    Optional[str], typer.Option(help="target model: alias, folder or hub id [default: smollm2]", show_default=False)
]
Head = Annotated[
    Optional[str],
    typer.Option(
        help="the EAGLE-1 or EAGLE-3 head: folder, alias or hub id [default: the head shipped for the target]",
        show_default=False,
    ),
]
Out = Annotated[Path, typer.Option(help="the folder to write (new or empty; --force replaces its files)")]
Acceptance = Annotated[
    Optional[Path],
    typer.Option(
        help="`treespec export measure`'s JSON: plan the trees from it [default: no tree, a chain of --tokens]",
        show_default=False,
    ),
]
Nodes = Annotated[int, typer.Option(help="node budget: drafted nodes per step at most")]
Profile = Annotated[
    Optional[list[Path]],
    typer.Option(
        help="a `treespec profile [--batch-size B] --out FILE` cost profile: pick the size with the most expected "
        "tokens per second within --nodes; repeat it with profiles of other batch sizes for a shape per batch size "
        "(SGLang: its adaptive mode's file)",
        show_default=False,
    ),
]
Tokens = Annotated[
    Optional[int], typer.Option(help="chain length without --acceptance [default: 3]", show_default=False)
]
Dtype = Annotated[str, typer.Option(help="weights' dtype: keep, float16, bfloat16, float32")]
Force = Annotated[bool, typer.Option("--force", help="write into a non-empty --out")]
M_DRAFTER_HELP = "drafter [default: eagle, with the target's shipped head]"
M_LIMIT_HELP = "prompts (first turns, chat-formatted when the target has a template)"


@export_app.command("measure", epilog=EPILOG)
def measure(
    target: Target = None,
    drafter: Annotated[Optional[str], typer.Option(help=M_DRAFTER_HELP, show_default=False)] = None,
    drafter_option: DrafterOptions = None,
    dataset: Annotated[
        str, typer.Option(help="mt-bench, spec-bench, gsm8k, humaneval, tinystories, or a file")
    ] = "mt-bench",
    limit: Annotated[int, typer.Option(help=M_LIMIT_HELP)] = 20,
    skip: Annotated[int, typer.Option(help="skip the first S prompts")] = 0,
    data_dir: Annotated[Optional[Path], typer.Option(help="folder of the dataset files", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(help="greedy tokens per prompt")] = 128,
    depth: Annotated[int, typer.Option(help="chain depth drafted per step (depths measured: 1 .. depth + 1)")] = 8,
    ranks: Annotated[int, typer.Option(help="ranks counted per depth")] = 8,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch", show_default=False)] = None,
    out: Annotated[
        Optional[Path], typer.Option(help="write the JSON here [default: print it]", show_default=False)
    ] = None,
) -> None:
    """Measure the drafter's acceptance by depth and rank on the target's greedy output (for the exports' trees)."""
    check_positive(limit=limit, max_new_tokens=max_new_tokens, depth=depth, ranks=ranks)
    if out is not None:
        writable_file(out, "--out", create_folder=True)  # before the measurement, not after it
    try:
        target, drafter, _, d_opts = pair_options(target, drafter or "eagle", "chain", None, drafter_option)
        from treespec.bench.datasets import format_turns, load_prompts
        from treespec.decoder import Decoder
        from treespec.export.acceptance import measure_depth_rank

        set_threads(threads)
        items = load_prompts(dataset, data_dir, limit + skip)[skip:]
        dec = Decoder(target, drafter, "chain", d_opts, None)
        prompts = [format_turns(dec.target.tokenizer, item, []) for item in items]
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("measuring", total=len(prompts))
            progress = lambda done, total: bar.update(task, completed=done)  # noqa: E731
            result = measure_depth_rank(dec, prompts, max_new_tokens, depth, ranks, progress=progress)
    except TreespecError as exc:
        fail(str(exc))
    result.update({"target": target, "drafter": drafter, "drafter_options": d_opts, "dataset": dataset, "skip": skip})
    text = json.dumps(result, indent=1) + "\n"
    p0 = ", ".join(f"{row[0]:.2f}" for row in result["acceptance"][:6])
    summary = (
        f"rank-0 acceptance by depth [{p0}, ...]; chain of {depth}: τ = {result['chain_tau']:.2f} over "
        f"{result['steps']} steps, {result['tokens']} tokens, {result['seconds']:.0f} s"
    )
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_or_print(out, text)
        summary += f"; wrote {out}"
    typer.secho(summary, fg=typer.colors.CYAN, err=True)


def _export(
    engine: str,
    target: str | None,
    head: str | None,
    out: Path,
    acceptance: Path | None,
    nodes: int,
    profiles: list[Path] | None,
    tokens: int | None,
    dtype: str,
    force: bool,
) -> None:
    check_positive(nodes=nodes, tokens=tokens)
    try:
        from treespec import defaults
        from treespec.export import heads

        target = target or defaults.MAIN
        head = head or _shipped_head(target)
        info = heads.read_target(target)
        files = heads.read_head(head, info)
        dt = heads.parse_dtype(dtype)
        planned, buckets = _plans(acceptance, nodes, profiles or [])
        heads.prepare_out(out, force)
        if engine == "vllm":
            written, lines = _vllm(files, info, out, dt, planned, tokens, buckets)
        else:
            written, lines = _sglang(files, info, out, dt, planned, tokens, buckets)
    except TreespecError as exc:
        fail(str(exc))
    record = _record(engine, target, info, head, files, written, acceptance, profiles, nodes, planned, buckets)
    heads.write_json(out / "plan.json", record)
    if planned:  # treespec runs the OPT-Tree optimum too: --builder static -B shape=FILE
        (out / "treespec-tree.json").write_text(json.dumps([list(p) for p in planned.optimum.paths]) + "\n")
        lines += [
            "",
            f"# treespec, the same head with the OPT-Tree optimum: --builder static -B shape={out / 'treespec-tree.json'}",
        ]
    (out / "launch.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    typer.echo("\n".join(lines))
    if planned:
        _report(planned)
    extra = ["plan.json", "launch.txt"] + (["treespec-tree.json"] if planned else [])
    typer.secho(f"wrote {out}: {', '.join(written + extra)}", fg=typer.colors.CYAN, err=True)


def _record(engine, target, info, head, files, written, acceptance, profiles, nodes, planned, buckets) -> dict:
    """plan.json: what was exported, from what, and the plans (per batch size when profiled for several)."""
    record = {
        "engine": engine,
        "target": target,
        "target_folder": info.folder,
        "head": head,
        "version": files.version,
        "files": written,
        "acceptance": str(acceptance) if acceptance else None,
        "profiles": [str(p) for p in profiles or []],
        "nodes": nodes,
    }
    if files.version == 3:
        record["feature_layers_hidden_states"] = list(files.layers or ())
    if planned:
        record["plan"] = planned.summary()
    if len(buckets) > 1:
        record["by_batch_size"] = [b.summary() for b in buckets]
    return record


def _shipped_head(target: str) -> str:
    from treespec.catalog import SHIPPED_HEADS

    if target not in SHIPPED_HEADS:
        fail(f"no head shipped for target {target!r}: pass --head DIR (a `treespec train eagle` output)")
    return SHIPPED_HEADS[target]


def _plans(acceptance: Path | None, nodes: int, profiles: list[Path]) -> tuple[Any, list[Any]]:
    """(the plan, one bucket per profiled batch size): the plan is the smallest batch size's (a single
    sequence when a profile of batch 1 is given); no plan without --acceptance."""
    costs = [_cost(p) for p in profiles]
    if acceptance is None:
        if costs:
            fail("--profile prices the trees --acceptance plans: give --acceptance FILE (`treespec export measure`)")
        return None, []
    from treespec.export.acceptance import load
    from treespec.export.plan import batch_of, buckets, plan

    sizes = [batch_of(c) for c in costs]
    if len(set(sizes)) < len(sizes):
        fail(f"two --profile files for one batch size ({sorted(sizes)}): give one profile per batch size")
    p = load(str(acceptance))["acceptance"]
    by_batch = buckets(p, nodes, costs)
    return (by_batch[0].plan if by_batch else plan(p, nodes, None)), by_batch


def _cost(path: Path) -> Any:
    from treespec.cost import CostModel

    try:
        return CostModel.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(
            f"--profile {path} is not a `treespec profile` file ({type(exc).__name__}): make one with "
            "`treespec profile --target T --drafter D [--batch-size B] --out FILE`"
        )


def _vllm(files, info, out: Path, dt, planned, tokens: int | None, buckets: list) -> tuple[list[str], list[str]]:
    """Write the vLLM export; (files written, launch lines)."""
    from treespec.export import tree as trees
    from treespec.export import vllm

    k = planned.chain.nodes if planned else (tokens or 3)
    written = vllm.write(files, info, out, k, dt)
    python, serve = vllm.launch(info, out, files.version, k, None)
    lines = [
        "# vLLM 0.32 (no tree attention): a chain of num_speculative_tokens",
        serve,
        "",
        python,
        "# vLLM CPU: add gpu_memory_utilization=0.1 (there: the share of RAM for the KV cache) and run it "
        "under if __name__ == '__main__':",
    ]
    if len(buckets) > 1:  # vLLM takes one chain length: the measured best per batch size, to choose from
        best = ", ".join(f"batch {b.batch}: {b.plan.chain.nodes}" for b in buckets)
        lines.append(f"# num_speculative_tokens by the batch size you expect ({best}); plan.json by_batch_size")
    if planned:
        tree = trees.to_vllm_string(planned.vllm_tree.paths)
        _, serve_tree = vllm.launch(info, out, files.version, planned.vllm_tree.nodes, tree)
        lines += [
            "# vLLM releases with tree attention (speculative_token_tree; one branching factor per level):",
            serve_tree,
        ]
    return written, lines


def _sglang(files, info, out: Path, dt, planned, tokens: int | None, buckets: list) -> tuple[list[str], list[str]]:
    """Write the SGLang export (and its adaptive-mode file for several batch sizes); (files, launch lines)."""
    from treespec.export import sglang
    from treespec.export.heads import write_json
    from treespec.export.plan import adaptive_steps

    written = sglang.write(files, info, out, dt)
    token_map = files.version == 1 and files.draft_vocab is not None
    if planned:
        steps, topk, n = planned.sglang.steps, planned.sglang.topk, planned.sglang.draft_tokens
    else:
        steps, topk, n = (tokens or 3), 1, (tokens or 3) + 1
    lines = [sglang.launch(info, out, files.version, steps, topk, n, token_map)]
    if len(buckets) > 1:
        slots = {b.batch: adaptive_steps(b) for b in buckets}
        start = sglang.adaptive_start(slots)
        shapes = "; ".join(
            f"batch {b.batch}: "
            + (
                "no speculation (plain decoding predicted faster)"
                if b.plain_beats_sglang()
                else f"steps {b.plan.sglang.steps}, topk {b.plan.sglang.topk}, {b.plan.sglang.draft_tokens} draft tokens"
            )
            for b in buckets
        )
        lines.append(f"# the static shape by the batch size you expect: {shapes}")
        if start is None:
            lines.append("# adaptive mode not written: at every profiled batch size plain decoding is predicted best")
        else:
            write_json(out / sglang.ADAPTIVE, sglang.adaptive_config(slots))
            written.append(sglang.ADAPTIVE)
            lines += [
                "# adaptive (topk 1; chain lengths per batch-size range from the profiles, in "
                + sglang.ADAPTIVE
                + "):",
                sglang.launch(info, out, files.version, start, 1, start + 1, token_map, out / sglang.ADAPTIVE),
            ]
    return written, lines


def _report(planned) -> None:
    s = planned.summary()
    typer.secho(
        f"E(A): chain {s['chain']['expected_accepted']:.2f} ({s['chain']['nodes']} nodes), vLLM tree "
        f"{s['vllm_tree']['expected_accepted']:.2f} ({s['vllm_tree']['nodes']}), OPT-Tree optimum "
        f"{s['optimum']['expected_accepted']:.2f} ({s['optimum']['nodes']}), SGLang "
        f"{s['sglang']['expected_accepted']:.2f} (steps {s['sglang']['steps']}, topk {s['sglang']['topk']}, "
        f"{s['sglang']['num_draft_tokens']} draft tokens)",
        fg=typer.colors.CYAN,
        err=True,
    )
    rates = {k: v for k, v in s["predicted_tokens_per_second"].items() if v is not None and k != "plain"}
    plain = s["predicted_tokens_per_second"].get("plain")
    if rates and plain is not None and plain >= max(rates.values()):
        typer.secho(
            f"note: under this profile plain decoding ({plain:.2f} tokens/s) beats every speculative shape "
            f"(best {max(rates.values()):.2f}): on this machine the head does not pay; serve without it, or "
            "train it further",
            fg=typer.colors.YELLOW,
            err=True,
        )


def _serving_command(kind: str, doc: str) -> None:
    """``treespec export <kind>``: the same options for every serving engine."""

    def command(
        target: Target = None,
        head: Head = None,
        out: Out = Path(f"export-{kind}"),
        acceptance: Acceptance = None,
        nodes: Nodes = 16,
        profile: Profile = None,
        tokens: Tokens = None,
        dtype: Dtype = "keep",
        force: Force = False,
    ) -> None:
        _export(kind, target, head, out, acceptance, nodes, profile, tokens, dtype, force)

    command.__doc__ = doc
    command.__name__ = f"export_{kind}"
    export_app.command(kind, epilog=EPILOG)(command)


_serving_command(
    "vllm", "Write the head as vLLM loads it (speculators EAGLE-3, or EAGLE-1) and the command that serves it."
)
_serving_command(
    "sglang",
    "Write the head as SGLang loads it (LlamaForCausalLMEagle3 / LlamaForCausalLMEagle) and the command that serves it.",
)
