"""What several commands share: reading a prompt file, checking an output folder before a long run,
SIGTERM handled like Ctrl-C, a stdout that cannot be written, and the command line that reproduces a
run (the options they share are declared in cli/decode_options.py). Imports no torch."""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from treespec.cli import fail
from treespec.errors import TreespecError


def pair_options(
    target: str | None,
    drafter: str | None,
    builder: str,
    builder_option: list[str] | None,
    drafter_option: list[str] | None,
    main: bool = True,
    sampling: bool = False,
) -> tuple[str, str, dict[str, str], dict[str, str]]:
    """(target, drafter, builder options, drafter options) from the command line, the defaults (the
    main job's, or with ``main=False`` the small pair's; ``sampling``: temperature > 0) filling in what is missing; raises
    ``TreespecError`` on bad options, exits when no drafter is named."""
    from treespec import defaults
    from treespec.options import parse_pairs

    for flag, name in (("--target", target), ("--drafter", drafter)):
        if name is not None and not name.strip():  # "" read as the current folder
            fail(
                f"{flag} is empty: give a name, e.g. {flag} {'treespec-py' if flag == '--target' else 'ngram'} (or leave it out)"
            )
    b_opts = parse_pairs(builder_option, "builder")
    d_opts = parse_pairs(drafter_option, "drafter")
    target, drafter = defaults.apply(target, drafter, builder, b_opts, main=main, sampling=sampling)
    if drafter is None:
        fail("no drafter: pass --drafter NAME, a draft model (alias, hub id or directory), or -D model=PATH")
    if drafter == "model" and "model" not in d_opts:
        fail("drafter 'model' needs a draft model: --drafter MODEL (alias, hub id or directory) or -D model=PATH")
    return target, drafter, b_opts, d_opts


def write_or_print(out: Path, text: str) -> None:
    """Write a measurement's ``text`` to ``out``; if that fails, print it on stdout (the measurement is not
    lost) and exit 1 with one line."""
    from treespec.files import write_text_atomic

    try:
        write_text_atomic(out, text, "--out")
    except TreespecError as exc:
        sys.stdout.write(text)
        fail(f"{exc}; the measurements are printed on stdout instead", code=1)


def settings_from(cls: type, values: dict[str, Any], **override: Any) -> Any:
    """A settings dataclass from a command's parameters (its ``locals()``): the fields ``cls`` has,
    ``override`` on top (values the command checked or filled in)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in {**values, **override}.items() if k in names})


def check_threads(threads: int | None) -> int | None:
    """``--threads``: None (torch's default), or 1 .. ``treespec.memory.max_threads()``; one line otherwise
    (100,000 crashed starting threads, and the error blamed the model's files)."""
    from treespec.errors import TreespecError
    from treespec.memory import check_threads as check

    try:
        return check(threads)
    except TreespecError as exc:
        fail(str(exc))
    raise AssertionError("unreachable")


def set_threads(threads: int | None) -> None:
    """Check ``--threads`` (``check_threads``), then give torch that many (None: leave torch's default)."""
    if check_threads(threads) is not None:
        import torch

        torch.set_num_threads(threads)


def check_positive(**values: int | None) -> None:
    """``--name must be > 0`` for the first option (keyword: its name with ``_``) that is set and ≤ 0."""
    for name, value in values.items():
        if value is not None and value <= 0:
            fail(f"--{name.replace('_', '-')} must be > 0, got {value}")


def check_seed(seed: int) -> int:
    """``--seed``: a whole number torch's generators take (``treespec.inputs.seed_value``), or one line."""
    from treespec.errors import TreespecError
    from treespec.inputs import seed_value

    try:
        return seed_value(seed, "--seed")
    except TreespecError as exc:
        fail(str(exc))
    raise AssertionError("unreachable")


def check_offset_lr(offset: int, lr: float | None) -> None:
    """The training commands' ``--offset`` (prompts skipped, >= 0) and ``--lr`` (finite, > 0; ``None``:
    the command's default), or one line naming the option."""
    import math

    if offset < 0:
        fail(f"--offset must be >= 0, got {offset} (it counts prompts skipped from the start)")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        fail(f"--lr must be a finite number > 0, got {lr}")


def input_file(path: Path, flag: str, what: str = "a text file") -> None:
    """``path`` must be a regular file: one line for a folder, a pipe or device (reading one blocks or
    never ends; it was reported as "no such file"), or nothing there."""
    if path.is_dir():
        fail(f"{flag} {path} is a directory: give {what}")
    if path.exists() and not path.is_file():
        fail(f"{flag} {path} is not a regular file (a pipe or a device): give {what}")
    if not path.is_file():
        fail(f"{flag} {path}: no such file")


def read_prompt(path: Path) -> str:
    """The text of ``--prompt-file``: one line of error for a missing file, a folder, a pipe or non-UTF-8."""
    input_file(path, "--prompt-file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        fail(f"--prompt-file {path} is not UTF-8 text (byte {exc.start}): convert it to UTF-8")
    except OSError as exc:
        fail(f"--prompt-file {path} cannot be read: {exc.strerror or exc}")
    raise AssertionError("unreachable")


def writable_dir(path: Path, flag: str) -> None:
    """Make sure ``path`` is (or can become) a folder we can write into, before any work starts."""
    from treespec.files import check_writable_dir

    try:
        check_writable_dir(path, flag)
    except TreespecError as exc:
        fail(str(exc))


def writable_file(path: Path, flag: str, create_folder: bool = False) -> None:
    """``path``'s folder must exist (``create_folder``: is created) and take a new file
    (``--dot``/``--png``/``--report``/``--out``), before any work starts."""
    from treespec.files import check_writable_dir, check_writable_file

    try:
        if create_folder and not path.is_dir():
            check_writable_dir(path.parent if str(path.parent) else Path("."), flag)
        check_writable_file(path, flag)
    except TreespecError as exc:
        fail(str(exc))


def hf_errors_only(command: Callable[..., Any]) -> Callable[..., Any]:
    """The command run inside ``treespec.models.quiet_transformers`` (transformers logs errors only,
    its progress bars off: ``generate()`` warns about its own arguments on every call), so a program
    that calls the command in-process gets its own settings back."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        from treespec.models import quiet_transformers

        with quiet_transformers():
            return command(*args, **kwargs)

    return run


@contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """SIGTERM (``kill``, a job scheduler stopping the job) inside the block is handled like Ctrl-C: it
    raises ``KeyboardInterrupt`` where the program is, so what was decoded is kept and printed. The
    list it yields receives the signal's number if it came (see ``interrupt_exit``)."""
    got: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        got.append(signum)
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (an application calling the command): leave SIGTERM alone
        yield got
        return
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, old)


def interrupt_exit(message: str, term: list[int]) -> tuple[str, int]:
    """The error line and exit code of an ``Interrupted`` decode: 130 for Ctrl-C, 143 for SIGTERM."""
    if term:
        return message.replace("interrupted", "terminated (SIGTERM)", 1), 128 + signal.SIGTERM
    return message, 130


def stdout_failed(exc: OSError) -> None:
    """stdout cannot be written (a full disk behind ``> file``, a closed pipe): one line on stderr, exit 1.
    stdout then points at /dev/null, so that Python's own flush at exit does not fail a second time."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor behind stdout (a test runner's buffer)
        pass
    fail(f"cannot write the output to stdout ({exc.strerror or exc}): free some space or redirect it elsewhere", code=1)


#: environment switches that change the products a run computes with, recorded in its command when set
RECORDED_ENV = (
    "TREESPEC_ROW_MATMUL",
    "TREESPEC_PACKED_MB",
    "TREESPEC_NATIVE",
    "TREESPEC_GGUF_BLOCKS",
    "TREESPEC_LEAN_TARGET",
)


def command_line(ctx: Any, resolved: dict[str, Any] | None = None) -> list[str]:
    """The command that reproduces this invocation, every effective setting spelled out: each option
    of the command, in declaration order, with its value (``resolved`` replaces values the command
    filled in itself, e.g. default drafters). Options left at None or off are omitted."""
    resolved = resolved or {}
    from treespec.threads import enabled

    # the environment switches that change what a run measures come first, as a shell would take them
    argv = [] if enabled() or not os.path.exists("/proc/stat") else ["TREESPEC_FOLLOW_LOAD=0"]
    argv += [f"{name}={os.environ[name].strip()}" for name in RECORDED_ENV if os.environ.get(name, "").strip()]
    argv += ["treespec", *_command_path(ctx)]
    for param in ctx.command.params:
        if getattr(param, "param_type_name", "") != "option" or param.name is None:
            continue
        value = resolved.get(param.name, ctx.params.get(param.name))
        if value is None or value is False or value == []:
            continue
        flag = max(param.opts, key=len)  # the long form: --builder-option, not -B
        if value is True:
            argv.append(flag)
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            argv += [flag, str(item)]
    return argv


def _command_path(ctx: Any) -> list[str]:
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return names[::-1]
