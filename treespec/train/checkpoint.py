"""Training state on disk: written atomically, read back as DATA only.

Checkpoints hold plain tensors, numbers, strings, lists, tuples and dicts (weights, optimizer and
scheduler state, RNG states, settings). They are read with ``torch.load(weights_only=True)``, which
refuses anything else, so a crafted file in an output folder can never run code: it is refused with
one line, and nothing is unpickled.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from treespec.errors import ConfigError


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it over ``path`` (atomic on POSIX)."""
    import torch

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_data(path: str | Path) -> Any:
    """A checkpoint written by ``save_atomic``, read as data only (``weights_only=True``). A file that
    holds anything but plain tensors and containers (an older treespec's, or a crafted one) is a
    ``ConfigError`` that says to delete it; it is never unpickled."""
    import torch

    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, a truncated file, ...
        why = "it holds more than plain tensors and numbers" if "weights_only" in str(exc) or "Unsupported" in str(exc) \
            else f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else 'unreadable'}"
        raise ConfigError(
            f"{path} cannot be read safely ({why}; treespec never unpickles code); delete it to start that part over"
        ) from None
