"""`treespec`: the command line, assembled from one module per command group.

    run             cli/run.py        decode one prompt
    bench           cli/bench.py      measure configurations; bench-report regenerates docs/benchmarks.md
    tree            cli/tree.py       tree show (one tree, drawn), tree presets
    plugins         cli/plugins.py    the installed builders and drafters
    profile         cli/profile.py    measure the step costs `opt-tree nodes=auto` plans with
    sequoia-measure cli/sequoia.py    a draft's per-rank acceptance vector
    calibrate       cli/calibrate.py  a draft model's temperature
    datastore       cli/datastore.py  corpora indexed for the datastore drafter
    train           cli/train.py      train eagle (cli/train.py), train pair (cli/train_pair.py)
    export          cli/export.py     export measure | vllm | sglang: a head and its tree for a serving engine

Shared helpers live in cli/common.py, the options the decoding commands share in cli/decode_options.py.
torch is imported only inside commands that decode or train: `treespec --help` and `treespec plugins`
stay light.
"""

from __future__ import annotations

import os

import typer

from treespec.cli.bench import EPILOG as BENCH_EPILOG
from treespec.cli.bench import bench
from treespec.cli.bench_report import bench_report
from treespec.cli.calibrate import EPILOG as CALIBRATE_EPILOG
from treespec.cli.calibrate import calibrate
from treespec.cli.datastore import datastore_app
from treespec.cli.export import export_app
from treespec.cli.plugins import plugins
from treespec.cli.profile import EPILOG as PROFILE_EPILOG
from treespec.cli.profile import profile
from treespec.cli.run import EPILOG as RUN_EPILOG
from treespec.cli.run import run
from treespec.cli.sequoia import EPILOG as SEQUOIA_EPILOG
from treespec.cli.sequoia import sequoia_measure
from treespec.cli.train import train_app
from treespec.cli.tree import tree_app

app = typer.Typer(
    help="Lossless speculative decoding with draft trees.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts contain literal [brackets]
)


@app.callback()
def _notes() -> None:
    """Print treespec's own warnings (what a dtype promises) as one `note:` line, not Python's two."""
    import sys
    import warnings

    from treespec.errors import PromiseNote

    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> None:
        if issubclass(category, PromiseNote):
            print(f"note: {message}", file=sys.stderr)
        else:
            default(message, category, *args, **kwargs)  # type: ignore[arg-type]

    warnings.showwarning = show


app.command("run", epilog=RUN_EPILOG)(run)
app.command("bench", epilog=BENCH_EPILOG)(bench)
app.command("bench-report")(bench_report)
app.command("plugins")(plugins)
app.command("profile", epilog=PROFILE_EPILOG)(profile)
app.command("sequoia-measure", epilog=SEQUOIA_EPILOG)(sequoia_measure)
app.command("calibrate", epilog=CALIBRATE_EPILOG)(calibrate)
app.add_typer(tree_app, name="tree")
app.add_typer(datastore_app, name="datastore")
app.add_typer(train_app, name="train")
app.add_typer(export_app, name="export")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
