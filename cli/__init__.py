"""The `treespec` command line (installed as ``treespec.cli``)."""

import typer


def _one_line_warnings() -> None:
    """treespec's own warnings (``TreespecWarning``: a saved profile ignored, ...) print as one yellow
    ``warning: ...`` line, not Python's two (file:line, then the source line); others as before."""
    import warnings

    from treespec.errors import TreespecWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if issubclass(category, TreespecWarning):
            typer.secho(f"warning: {message}", fg=typer.colors.YELLOW, err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


_one_line_warnings()


def fail(message: str, code: int = 2) -> None:
    """Print one red ``error: ...`` line on stderr and exit with ``code`` (2: bad input, 1: a run failed)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


class TrainingProgress:
    """A rich progress display for training commands: ``with TrainingProgress() as (progress, log):``,
    where ``progress(task, done, total, info)`` draws one bar per task and ``log`` prints above them."""

    def __enter__(self):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        self.tasks: dict[str, int] = {}
        self.bar.__enter__()
        return self.progress, self.bar.console.print

    def progress(self, task: str, done: int, total: int, info: str) -> None:
        if task not in self.tasks:
            self.tasks[task] = self.bar.add_task(task, total=total, completed=done, info="")
        self.bar.update(self.tasks[task], completed=done, info=info)

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)
