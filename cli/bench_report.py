"""``treespec bench-report``: regenerate a Markdown page (docs/benchmarks.md) from bench runs'
results.json; ``treespec bench --report`` writes it the same way after its run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from treespec.cli import fail
from treespec.cli.common import writable_file
from treespec.errors import TreespecError
from treespec.files import read_json


def write_report(paths: list[Path], out: Path, flag: str = "--out") -> None:
    from treespec.bench import report
    from treespec.files import write_text_atomic

    loaded = []
    for path in paths:
        fix = "run `treespec bench --out DIR` first" if not path.is_file() else "rerun the bench that wrote it"
        try:
            data = read_json(path, "results file", fix)
        except TreespecError as exc:
            fail(str(exc))
        if not isinstance(data.get("rows"), list):
            fail(
                f"results file {path} has no 'rows' list: it is not a treespec results.json; rerun the bench that wrote it"
            )
        try:  # every field the page reads is there (a hand-edited or older file failed half-way, KeyError)
            report.markdown([(path.resolve(), data)], out.resolve().parent, out)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            what = f"has no {exc}" if isinstance(exc, KeyError) else f"is malformed ({type(exc).__name__}: {exc})"
            fail(f"{path} {what}: it is not a complete treespec results.json; rerun the bench that wrote it")
        loaded.append((path.resolve(), data))
    writable_file(out, flag)
    try:
        write_text_atomic(out, report.markdown(loaded, out.resolve().parent, out), flag)
    except TreespecError as exc:
        fail(str(exc), code=1)
    typer.echo(f"wrote {out}")


def bench_report(
    runs: Annotated[
        list[Path], typer.Argument(help="bench output folders (or results.json files), in the order to show")
    ],
    out: Annotated[Path, typer.Option(help="the Markdown file to write")] = Path("docs/benchmarks.md"),
) -> None:
    """Regenerate docs/benchmarks.md from the results.json of bench runs."""
    write_report([r / "results.json" if r.is_dir() else r for r in runs], out)
