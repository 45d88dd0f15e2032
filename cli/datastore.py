"""`treespec datastore build`: index a corpus for the `datastore` drafter.

Registered in ``cli/app.py`` with ``app.add_typer(datastore_app, name="datastore")``. Imports no torch
until a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from treespec.cli import fail as _fail
from treespec.cli.common import writable_file
from treespec.errors import TreespecError

EPILOG = """\
Examples:

  treespec datastore build ../shared/prompts/tinystories_val.txt --target ../shared/models/stories260K

  treespec run --target ../shared/models/stories260K --drafter datastore -D corpus=../shared/prompts/tinystories_val.txt --builder opt-tree -B nodes=25
"""

datastore_app = typer.Typer(
    help="Corpora indexed for the `datastore` drafter.", no_args_is_help=True, rich_markup_mode=None
)


@datastore_app.command("build", epilog=EPILOG)
def build(
    corpus: Annotated[
        Path,
        typer.Argument(
            help=".txt (documents separated by blank lines), .jsonl or .jsonl.gz (a 'text' field or a 'turns' list)"
        ),
    ],
    target: Annotated[
        Optional[str],
        typer.Option(help="the target model whose tokenizer the index uses [default: treespec-py]", show_default=False),
    ] = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="write the index here (use it with -D corpus=PATH) [default: the cache, where -D corpus=CORPUS finds it]",
            show_default=False,
        ),
    ] = None,
    cache_dir: Annotated[
        Optional[Path],
        typer.Option(
            help="the cache folder [default: $XDG_CACHE_HOME/treespec/datastore or ~/.cache/treespec/datastore]",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Tokenise and index a corpus (a suffix array), then print: tokens, documents, seconds, path."""
    from treespec.catalog import DEFAULT_TARGET
    from treespec.files import check_writable_dir, check_writable_file
    from treespec.models import load_tokenizer
    from treespec.plugins.datastore_index import Index, cache_path

    if corpus.exists() and not corpus.is_file():
        kind = "a directory" if corpus.is_dir() else "not a regular file (a pipe or a device)"
        _fail(f"corpus {str(corpus)!r} is {kind}; pass a .txt, .jsonl or .jsonl.gz file")
    if not corpus.is_file():
        _fail(f"corpus {str(corpus)!r} not found; pass an existing .txt, .jsonl or .jsonl.gz file")
    if out is not None:
        writable_file(out, "--out", create_folder=True)
    try:
        tokenizer = load_tokenizer(target or DEFAULT_TARGET)
        path = (out if out is not None else cache_path(corpus, tokenizer, cache_dir)).expanduser()
        flag = "--out" if out is not None else "--cache-dir"
        check_writable_dir(path.parent, flag)  # before the build, not after it
        check_writable_file(path, flag)
        index = Index.build(corpus, tokenizer)
    except TreespecError as exc:
        _fail(str(exc))
    try:
        index.save(path)
    except TreespecError as exc:
        _fail(str(exc), code=1)
    h = index.header
    typer.echo(f"{h['tokens']} tokens, {h['documents']} documents, {h['build_seconds']:.2f} s, {path}")
