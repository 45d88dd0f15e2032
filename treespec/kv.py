"""KV caches and the attention masks over them: the one place for cache surgery and tree masks.

Every model treespec runs (the target, a draft model, the target's first layers, an EAGLE head) keeps
a Hugging Face ``DynamicCache`` in which row i of every layer holds position i of the committed
sequence, followed during a step by rows of tree nodes. Three facts shape this module:

- Masks are **float**, ``[Q, K]`` (callers add the ``[1, 1]`` batch and head dims): 0 = attend,
  ``finfo(dtype).min`` = blocked. A bool mask is silently wrong with eager attention (it is *added*
  to the scores), so treespec never passes one.
- A tree node attends to the whole committed prefix and to its own ancestors (itself included);
  its position is prefix length + depth, so siblings share a position.
- Keeping the accepted nodes is copy-into-place then crop: about 4× faster than ``index_select`` on
  every layer on a CPU.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from treespec.errors import ConfigError

# ------------------------------------------------------------------------------------------- masks


def float_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float mask of a bool ``visible`` [Q, K]: 0 where visible, ``finfo(dtype).min`` elsewhere."""
    mask = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)  # [Q, K]
    return mask.masked_fill_(visible, 0.0)


def causal_mask(past: int, n: int, dtype: torch.dtype, extra: int = 0) -> torch.Tensor:
    """[n, past + n + extra]: new row i (at position past + i) sees the ``past`` cached rows and new
    rows 0..i; the ``extra`` columns after them (rows fed in the same forward, e.g. tree nodes) are
    blocked."""
    col = torch.arange(past + n + extra)  # [K]
    return float_mask(col[None, :] <= past + torch.arange(n)[:, None], dtype)  # [n, K]


def tree_mask(prefix: int, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[F, prefix + R]: F tree rows that see the whole committed prefix (``prefix`` cached rows) and,
    among R tree rows, their own ancestors: ``ancestors[f, r]`` is True when tree row r is row f's
    node or one of its ancestors (a slice of ``DraftTree.ancestors``)."""
    f = ancestors.shape[0]
    seen = torch.ones(f, prefix, dtype=torch.bool, device=ancestors.device)  # [F, prefix]
    return float_mask(torch.cat([seen, ancestors.to(torch.bool)], dim=1), dtype)  # [F, prefix + R]


def window_mask(mask: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Block keys at or beyond ``window`` positions behind each query (Hugging Face's sliding rule:
    key visible iff kv_pos > q_pos − window). mask: [..., Q, K]; q_pos: [Q]; kv_pos: [K]."""
    if window is None:
        return mask
    far = kv_pos.to(mask.device)[None, :] <= q_pos.to(mask.device)[:, None] - window  # [Q, K]
    return mask.masked_fill(far, torch.finfo(mask.dtype).min)


# ------------------------------------------------------------------------------- facts of a config


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_positions(config: Any) -> int | None:
    """The model's context length from its config, or None if the config does not say."""
    cfg = text_config(config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def attention_window(config: Any) -> int | None:
    """The sliding-attention window every layer uses, or None. Caches here keep every row at its
    position (``DynamicCache()`` without a config), so the window is applied in our own masks."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is None:  # e.g. Mistral: every layer slides when sliding_window is set
        return int(window)
    sliding = ["sliding" in str(t) for t in types]
    if not any(sliding):
        return None
    if not all(sliding):
        raise ConfigError(
            f"{getattr(cfg, 'model_type', 'this model')} mixes sliding-window and full attention layers, which "
            "treespec does not support yet (one tree mask serves every layer); pick another model"
        )
    return int(window)


# ---------------------------------------------------------------------------------- cache surgery


def cache_keyword(module: Any) -> str:
    """The keyword ``module``'s forward takes the KV cache by: ``cache`` where transformers has
    renamed it (``past_key_values`` is deprecated there and warns on every call), else
    ``past_key_values``. Decide once per model, not per call."""
    forward = getattr(module, "forward", module)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"



def crop_cache(cache: Any, length: int) -> None:
    """Drop every cached position from ``length`` on, layer by layer: a forward that failed part-way
    may have appended to its first layers only (transformers 5 crops by a negative count)."""
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or getattr(layer, "keys", None) is None:
            continue
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


def keep_rows(cache: Any, base: int, rows: list[int] | torch.Tensor) -> None:
    """Keep cache positions ``rows`` (ascending, all ≥ base) at base, base+1, ... and drop the rest:
    copy into place, then crop (a contiguous run from ``base``, e.g. a chain's, needs no copy)."""
    rows = torch.as_tensor(rows)
    m = int(rows.shape[0])
    if m and int(rows[-1]) != base + m - 1:
        for layer in cache.layers:
            src = rows.to(layer.keys.device)
            layer.keys[:, :, base : base + m] = layer.keys[:, :, src]  # [B, H_kv, m, D]
            layer.values[:, :, base : base + m] = layer.values[:, :, src]
    crop_cache(cache, base + m)
