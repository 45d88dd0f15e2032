"""Training state on disk: written atomically, read back as DATA only.

Checkpoints hold plain tensors, numbers, strings, lists, tuples and dicts (weights, optimizer and
scheduler state, RNG states, settings). They are read with ``torch.load(weights_only=True)``, which
refuses anything else, so a crafted file in an output folder can never run code: it is refused with
one line, and nothing is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treespec.errors import ConfigError
from treespec.files import check_writable_dir

#: Files that make a folder a model someone saved (a target, a draft, a head): training never writes over them.
MODEL_FILES = ("config.json", "*.safetensors", "*.bin", "*.gguf", "*.pt")
#: What a treespec training run leaves in its ``--out``: a folder holding one of these is ours to resume or redo.
TRAINING_MARKERS = ("training.json", "checkpoint*.pt", "data.pt", "generated.pt", "log.jsonl")


def prepare_out(out: str | Path, what: str = "training") -> Path:
    """``--out`` as a folder this training may write into, created, or a ``ConfigError`` BEFORE any work:
    an empty name (it would write into the current folder), a file, a folder that is not writable, or
    a folder holding a model that is not an earlier treespec training's output (``train eagle --out``
    pointed at the target's own folder replaced its config.json and weights)."""
    if not str(out).strip():
        raise ConfigError(f"--out is empty: name a new folder for the {what}'s output, e.g. --out heads/my-head")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file, not a folder: pick another --out")
    if path.is_dir() and not any(any(path.glob(m)) for m in TRAINING_MARKERS):
        found = next((f.name for pattern in MODEL_FILES for f in sorted(path.glob(pattern))), None)
        if found is not None:
            raise ConfigError(
                f"--out {path} holds a model ({found}) that the {what} would overwrite: pick a new or empty folder"
            )
    return check_writable_dir(path, "--out")


def load_data(path: str | Path, mmap: bool = False) -> Any:
    """A checkpoint written by ``treespec.files.save_torch_atomic``, read as data only
    (``weights_only=True``). A file that holds anything but plain tensors and containers (an older
    treespec's, or a crafted one) is a ``ConfigError`` that says to delete it; it is never unpickled.
    ``mmap``: tensors stay in the file until read (a caller that needs a small part of a large file)."""
    import torch

    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, a truncated file, ...
        why = (
            "it holds more than plain tensors and numbers"
            if "weights_only" in str(exc) or "Unsupported" in str(exc)
            else f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else 'unreadable'}"
        )
        raise ConfigError(
            f"{path} cannot be read safely ({why}; treespec never unpickles code); delete it to start that part over"
        ) from None


def same_settings(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Equal settings, where a ``data`` prompts file named two ways (relative in one run, absolute in
    the other) is one file: a resumed run must not regenerate an hour of answers for a path's spelling."""
    return _as_new(old, new) == new


def _as_new(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with its ``data`` spelt as ``new`` spells it when both name one existing file (a dataset
    name such as ``mt-bench`` is the dataset, whatever file of that name the current folder holds)."""
    from treespec.bench.datasets import DATASETS, MIX

    a, b = old.get("data"), new.get("data")
    if not (isinstance(a, str) and isinstance(b, str)) or a == b or {a, b} & {*DATASETS, MIX}:
        return old
    if Path(a).is_file():
        try:
            if Path(a).samefile(b):
                return {**old, "data": b}
        except OSError:  # b is no file
            pass
    return old


def check_resumable(ckpt_file: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """A ``ConfigError`` naming each setting that differs (``same_settings``) between the checkpoint's
    settings ``old`` and this run's ``new``."""
    old = _as_new(old, new)
    if old != new:
        diff = ", ".join(
            f"{k} {old.get(k)} → {new.get(k)}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
        )
        raise ConfigError(
            f"{ckpt_file} was written with other settings ({diff}); pass the same options to resume, or another --out"
        )
