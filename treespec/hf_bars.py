"""transformers' progress bars on or off for a block, and the caller's setting back after it.

Loading (``treespec.models.quiet_transformers``) hides them, a GGUF conversion (``treespec.gguf``)
shows them, and ``train pair``'s export hides them under treespec's own rich bars. A module of its
own because ``models`` imports ``gguf``, so ``gguf`` cannot import it from ``models`` without an
import circle (``tests/test_house.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def progress_bars(on: bool) -> Iterator[None]:
    """transformers' progress bars on (``on``) or off inside the block; the caller's setting after it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
