"""How much memory this machine can give, and refusing a request that cannot fit before allocating it
(issue 27: a 6 GiB tree mask, a config of 100,000 layers, a 10⁹-rank vector were allocated, then
failed or had the process killed). Imports no torch."""

from __future__ import annotations

import os
from typing import Any

from treespec.errors import ConfigError

GIB = 1 << 30


def available_bytes() -> int:
    """Memory a new allocation can take now without swapping: Linux's MemAvailable (free memory plus
    caches it can drop), else psutil's, else free pages (``os.sysconf``); 16 GiB when none says."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def gib(nbytes: float) -> str:
    """``nbytes`` for a message: ``"6.0 GiB"``, ``"0.3 GiB"``, ``"2,048 GiB"``, ``"9.7e+24 GiB"``."""
    if nbytes >= 1e6 * GIB:
        return f"{nbytes / GIB:.2g} GiB"
    return f"{nbytes / GIB:,.1f} GiB" if nbytes < 1000 * GIB else f"{nbytes / GIB:,.0f} GiB"


def check_fits(nbytes: float, what: str, fix: str) -> None:
    """Refuse ``what`` (e.g. "a draft tree of 80,200 nodes") in one line when its estimated ``nbytes``
    exceed the memory available now; ``fix`` says what to lower."""
    free = available_bytes()
    if nbytes > free:
        raise ConfigError(f"{what} needs about {gib(nbytes)}, more than the {gib(free)} of memory available: {fix}")


def decoder_parameters(text: dict[str, Any], layers: Any) -> int:
    """Parameters of a decoder-only transformer its config describes (embeddings once, attention and a
    gated MLP per layer), 0 if it does not say enough: a floor, never an overestimate of a standard one."""
    try:
        hidden, vocab, layers = int(text["hidden_size"]), int(text["vocab_size"]), int(layers)
        heads = int(text.get("num_attention_heads") or 1)
        kv = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        inter = int(text.get("intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * inter
    return max(0, vocab * hidden + layers * per_layer)


def max_threads() -> int:
    """The most CPU threads ``--threads`` may ask for: 4 per core, at least 64. More only slows torch
    down, and far more fails starting them (100,000 crashed)."""
    return max(64, 4 * (os.cpu_count() or 1))


def check_threads(threads: object, flag: str = "--threads") -> int | None:
    """``threads`` (None: torch's default) as a whole number in [1, ``max_threads()``], or one line."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise ConfigError(f"{flag} must be a whole number, got {threads!r}")
    if threads <= 0:
        raise ConfigError(f"{flag} must be > 0, got {threads}")
    cap = max_threads()
    if threads > cap:
        raise ConfigError(
            f"{flag} {threads} is more threads than this machine can use ({os.cpu_count()} cores): use at most {cap}"
        )
    return threads
