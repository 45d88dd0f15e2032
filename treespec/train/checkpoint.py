"""Writing training state so that an interrupted run never leaves a half-written file behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it over ``path`` (atomic on POSIX)."""
    import torch

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
