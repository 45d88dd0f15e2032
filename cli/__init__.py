"""The `treespec` command line (installed as ``treespec.cli``)."""

import typer


def fail(message: str, code: int = 2) -> None:
    """Print one red ``error: ...`` line on stderr and exit with ``code`` (2: bad input, 1: a run failed)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


class TrainingProgress:
    """A rich progress display for training commands: ``with TrainingProgress() as (progress, log):``,
    where ``progress(task, done, total, info)`` draws one bar per task and ``log`` prints above them."""

    def __enter__(self):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
                            TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self.tasks: dict[str, int] = {}
        self.bar.__enter__()
        return self.progress, self.bar.console.print

    def progress(self, task: str, done: int, total: int, info: str) -> None:
        if task not in self.tasks:
            self.tasks[task] = self.bar.add_task(task, total=total, completed=done, info="")
        self.bar.update(self.tasks[task], completed=done, info=info)

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)
