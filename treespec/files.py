"""Files: written atomically, checked before the work, JSON read as data, and one line when it fails.

Every file treespec writes goes through here. The content goes to a temporary file beside its target
(``.NAME.XXXXXXXX.tmp``, in the same folder, so on the same filesystem), is flushed to the disk, then
renamed over the target (``os.replace``, atomic on POSIX). A reader, a disk that fills up half-way or a
Ctrl-C never leaves a half-written file: the old file stays whole until the new one is complete, and no
temporary file is left behind. An ``OSError`` (a full disk, a read-only folder, no permission) becomes a
``ConfigError`` of one line that names the file, the reason and the fix. Imports no torch.

    write_text_atomic(path, text)             text (JSON, Markdown, DOT)
    save_torch_atomic(obj, path)              torch.save (training checkpoints, data.pt)
    save_safetensors_atomic(tensors, path)    safetensors.torch.save_file (heads, draft vocabularies)
    savefig_atomic(fig, path)                 a matplotlib figure (PNG plots)
    atomic(path)                              the temporary path of any other writer, as a context manager
    writing(path)                             one line for the OSError of a write that cannot be atomic
                                              (an appended log, a model folder written by transformers)
    check_writable_dir(path) / check_writable_file(path)   before long work: can we write there at all?
    read_json(path, what, fix)                a JSON file a user gave (a device map, an acceptance file,
                                              a head's config.json, a results.json): its value, or one
                                              line for a missing file, bad JSON or the wrong kind of value
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from treespec.errors import ConfigError

_HELD = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}


def read_json(
    path: str | Path, what: str, fix: str, error: type[Exception] = ConfigError, kind: type | None = dict
) -> Any:
    """The value in the JSON file ``path`` (data, never code), or one ``error`` line that names ``what``
    (the file's role: ``"acceptance file"``, ``"--device-map"``), the file and ``fix`` when the file is
    missing or not a file, cannot be read, is not UTF-8 JSON, or holds something other than a ``kind``
    (``dict`` or ``list``; None: any value)."""
    if kind not in (dict, list, None):
        raise ValueError(f"read_json: kind is dict, list or None, not {kind!r}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise error(f"{what} {path} {'is not a file' if path.exists() else 'not found'}; {fix}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:  # no permission, an I/O error
        raise error(f"{what} {path} cannot be read ({exc.strerror or type(exc).__name__}); {fix}") from None
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not JSON (not UTF-8 text); {fix}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or a number too long to convert
        detail = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise error(f"{what} {path} is not JSON ({detail}); {fix}") from None
    if kind is not None and not isinstance(data, kind):
        raise error(f"{what} {path} holds {_HELD.get(type(data), 'null')}, not {_HELD[kind]}; {fix}")
    return data


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_error(path: str | Path, exc: OSError, option: str | None = None) -> ConfigError:
    """The one line for a write of ``path`` that failed with ``exc``: the file, the reason, the fix
    (``option``: the command-line option that names the file, e.g. ``--out``)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    elsewhere = f"pick another {option}" if option else "write it elsewhere"
    if exc.errno in _FULL:
        fix = f"free some space or {elsewhere}"
    elif exc.errno in _DENIED:
        fix = f"make {Path(path).parent} writable or {elsewhere}"
    else:
        fix = elsewhere
    return ConfigError(f"cannot write {path} ({reason}): {fix}")


@contextmanager
def writing(path: str | Path, option: str | None = None) -> Iterator[None]:
    """An ``OSError`` inside the block is the one-line ``ConfigError`` of a failed write of ``path``."""
    try:
        yield
    except OSError as exc:
        raise write_error(path, exc, option) from None


@contextmanager
def atomic(path: str | Path, option: str | None = None) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer to fill; when the block ends without an error it
    is flushed to the disk and renamed over ``path``. On any error (or Ctrl-C) it is removed and
    ``path`` is untouched; an ``OSError`` becomes a one-line ``ConfigError``."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise write_error(path, exc, option) from None
    tmp = Path(name)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would create it: mkstemp makes 0600
        os.close(fd)
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on the disk before the rename makes it the file
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise write_error(path, exc, option) from None
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)  # gone after the rename; else the half-written temporary file


def write_text_atomic(path: str | Path, text: str, option: str | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic(path, option) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_atomic_with(writer: Callable[[Path], Any], path: str | Path, option: str | None = None) -> None:
    """``writer(temporary path)`` writes the file; then it becomes ``path`` atomically."""
    with atomic(path, option) as tmp:
        writer(tmp)


def save_torch_atomic(obj: Any, path: str | Path, option: str | None = None) -> None:
    """``torch.save(obj)`` to ``path`` atomically (read it back with ``treespec.train.checkpoint.load_data``)."""
    import torch

    save_atomic_with(lambda tmp: torch.save(obj, tmp), path, option)


def save_safetensors_atomic(
    tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None, option: str | None = None
) -> None:
    """``safetensors.torch.save_file`` to ``path`` atomically."""
    from safetensors.torch import save_file

    save_atomic_with(lambda tmp: save_file(tensors, str(tmp), metadata=metadata), path, option)


def savefig_atomic(fig: Any, path: str | Path, option: str | None = None, **kwargs: Any) -> None:
    """``fig.savefig(path, **kwargs)`` atomically; the format is ``format=`` if given, else ``path``'s
    suffix (the temporary file's name has none), else PNG."""
    kwargs.setdefault("format", Path(path).suffix.lstrip(".").lower() or "png")
    save_atomic_with(lambda tmp: fig.savefig(tmp, **kwargs), path, option)


def check_writable_dir(path: str | Path, option: str) -> Path:
    """``path`` is (or can become) a folder we can write into, created; else a ``ConfigError``, before
    any work. Tries a real write: permission bits say nothing for root or a read-only filesystem."""
    path = Path(path)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"{option} {path}: {blocker} is a file, not a folder; pick another {option}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except OSError as exc:
        raise ConfigError(
            f"{option} {path} is not writable ({exc.strerror or type(exc).__name__}); pick another {option}"
        ) from None
    return path


def check_writable_file(path: str | Path, option: str) -> Path:
    """``path`` can be written: not a folder, and its folder exists and takes a new file (a real
    write, as for ``check_writable_dir``); else a ``ConfigError``, before any work."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a directory: give a file name")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"{option} {path}: {blocker} is a file, not a folder; pick another {option}")
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: the folder {parent} does not exist; create it first")
    try:
        _probe(parent)
    except OSError as exc:
        raise ConfigError(
            f"{option} {path}: the folder {parent} is not writable "
            f"({exc.strerror or type(exc).__name__}); pick another {option}"
        ) from None
    return path


def _probe(folder: Path) -> None:
    fd, name = tempfile.mkstemp(prefix=".treespec-write-test-", dir=folder)
    os.close(fd)
    os.unlink(name)
