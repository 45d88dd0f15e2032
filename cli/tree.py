"""`treespec tree show` and `treespec tree presets`: look at draft trees."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from treespec import defaults
from treespec.cli import fail
from treespec.cli.common import pair_options, writable_file
from treespec.cli.decode_options import BuilderOptions, Device, DrafterOptions
from treespec.errors import TreespecError

tree_app = typer.Typer(help="Look at draft trees.", no_args_is_help=True, rich_markup_mode=None)
SHOW_EPILOG = "Example:\n\n  treespec tree show --builder opt-tree -B nodes=25 --png tree.png"


@tree_app.command("presets")
def tree_presets() -> None:
    """List the static builder's named tree shapes, with their size, depth and source."""
    from treespec.plugins.static import load_shape, preset_names, preset_source

    for name in preset_names():
        paths = load_shape(name)
        typer.echo(f"{name:24s} {len(paths):3d} nodes, depth {max(map(len, paths))}  {preset_source(name)}")
    typer.echo(
        "also: chain-K (a chain of K), kary-K-D (K children per node, depth D), a JSON list of rank paths, "
        "or a JSON file"
    )


@tree_app.command("show", epilog=SHOW_EPILOG)
def tree_show(
    builder: Annotated[str, typer.Option(help="tree builder name")] = "opt-tree",
    builder_option: BuilderOptions = None,
    target: Annotated[
        Optional[str], typer.Option(help=f"target model [default: {defaults.TARGET}]", show_default=False)
    ] = None,
    drafter: Annotated[
        Optional[str],
        typer.Option(
            help=f"drafter name or draft model [default with the default target: {defaults.DRAFTER}]",
            show_default=False,
        ),
    ] = None,
    drafter_option: DrafterOptions = None,
    prompt: Annotated[
        str, typer.Option(help="prompt text [default: a Python class opening]", show_default=False)
    ] = defaults.PROMPT,
    dot: Annotated[Optional[Path], typer.Option(help="also write the tree as Graphviz DOT")] = None,
    png: Annotated[Optional[Path], typer.Option(help="also draw the tree to a PNG (matplotlib)")] = None,
    max_nodes: Annotated[int, typer.Option(help="show at most this many nodes in the terminal")] = 200,
    device: Device = None,
) -> None:
    """Build one tree for a prompt, verify it with the target, and draw it (accepted path highlighted)."""
    if max_nodes <= 0:  # a slice by it kept all but the last nodes, or none
        fail(f"--max-nodes must be > 0, got {max_nodes}")
    for path, flag in ((dot, "--dot"), (png, "--png")):
        if path is not None:
            writable_file(path, flag)
    try:
        target, drafter, b_opts, d_opts = pair_options(
            target, drafter, builder, builder_option, drafter_option, main=False
        )
        from treespec.decoder import Decoder

        dec = Decoder(target, drafter, builder, d_opts, b_opts, device=device)
        ids, tree, acc = dec.draft_and_verify(prompt)
    except TreespecError as exc:
        fail(str(exc))
    _draw(dec, prompt, ids, tree, acc, f"builder {builder} {b_opts or ''}", max_nodes, dot, png)


def _draw(dec, prompt, ids, tree, acc, what: str, max_nodes: int, dot: Path | None, png: Path | None) -> None:
    from rich.console import Console

    from treespec.files import write_text_atomic
    from treespec.tools import render

    show = render.token_text(dec.target.tokenizer)
    console = Console()
    console.print(f"prompt: {prompt!r} ({len(ids)} tokens) · {what}")
    console.print(render.rich_tree(tree, acc, show, max_nodes=max_nodes))
    console.print(
        f"{tree.size} drafted nodes, depth {tree.depth}, E(A) = Σ p̂ = {tree.expected_accepted():.2f}; "
        f"the target accepts {acc.accepted} + 1 bonus token: {dec.text_of(acc.tokens + [acc.bonus], ids)!r}"
    )
    if dot is not None:
        try:
            write_text_atomic(dot, render.to_dot(tree, acc, show), "--dot")
        except TreespecError as exc:
            fail(str(exc), code=1)
        console.print(f"wrote {dot} (render with: dot -Tpng {dot} -o tree.png)")
    if png is not None:
        try:
            render.to_png(tree, acc, show, png)
        except TreespecError as exc:
            fail(str(exc), code=1)
        console.print(f"wrote {png}")
