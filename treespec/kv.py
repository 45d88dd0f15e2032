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

import contextlib
import contextvars
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# ------------------------------------------------------------------------------------------- masks


def float_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float mask of a bool ``visible`` [.., Q, K]: 0 where visible, ``finfo(dtype).min`` elsewhere
    (on ``visible``'s device)."""
    mask = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)  # [.., Q, K]
    return mask.masked_fill_(visible, 0.0)


def rows_prefill_visible(lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, S, S] (S = ``width``): batch row b's prompt, right-padded to S, sees itself causally up to
    its ``lens[b]`` tokens; a padding query sees itself only (no empty softmax)."""
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # [S, S]
    visible = causal[None] & (q[None, None, :] < lens[:, None, None])  # [B, S, S]: own prefix only
    return visible | torch.eye(width, dtype=torch.bool)[None]


def rows_tree_visible(lens: torch.Tensor, width: int, ancestors: list[torch.Tensor]) -> torch.Tensor:
    """[B, N, S+N]: row b's tree nodes (``ancestors[b]`` [N_b, N_b], padded to the largest N) see row b's
    committed prefix (its first ``lens[b]`` of S cache rows) and their own ancestors; padding nodes see
    themselves."""
    b, n = len(ancestors), max(int(a.shape[0]) for a in ancestors)
    visible = torch.zeros(b, n, width + n, dtype=torch.bool)  # [B, N, S+N]
    visible[:, :, :width] = torch.arange(width)[None, None, :] < lens[:, None, None]  # own committed prefix
    visible[:, :, width:] = torch.eye(n, dtype=torch.bool)[None]  # padding nodes: themselves
    for r, anc in enumerate(ancestors):
        size = int(anc.shape[0])
        visible[r, :size, width : width + size] = anc
    return visible


def causal_visible(past: int, n: int, extra: int = 0) -> torch.Tensor:
    """[n, past + n + extra] bool: new row i (at position past + i) sees the ``past`` cached rows and
    new rows 0..i; the ``extra`` columns after them (rows fed in the same forward, e.g. tree nodes)
    are blocked."""
    col = torch.arange(past + n + extra)  # [K]
    return col[None, :] <= past + torch.arange(n)[:, None]  # [n, K]


def causal_mask(past: int, n: int, dtype: torch.dtype, extra: int = 0) -> torch.Tensor:
    """``causal_visible`` as an additive float mask [n, past + n + extra]."""
    return float_mask(causal_visible(past, n, extra), dtype)  # [n, K]


def tree_mask(prefix: int, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[F, prefix + R]: F tree rows that see the whole committed prefix (``prefix`` cached rows) and,
    among R tree rows, their own ancestors: ``ancestors[f, r]`` is True when tree row r is row f's
    node or one of its ancestors (a slice of ``DraftTree.ancestors``)."""
    f = ancestors.shape[0]
    seen = torch.ones(f, prefix, dtype=torch.bool, device=ancestors.device)  # [F, prefix]
    return float_mask(torch.cat([seen, ancestors.to(torch.bool)], dim=1), dtype)  # [F, prefix + R]


def window_mask(mask: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Block keys at or beyond ``window`` positions behind each query (Hugging Face's sliding rule:
    key visible iff kv_pos > q_pos − window). mask: [..., Q, K]; q_pos: [..., Q]; kv_pos: [..., K]
    (one sequence's positions, or a batch's [B, Q] and [B, K] for a mask [B, Q, K])."""
    if window is None:
        return mask
    far = kv_pos.to(mask.device)[..., None, :] <= q_pos.to(mask.device)[..., :, None] - window  # [..., Q, K]
    return mask.masked_fill(far, torch.finfo(mask.dtype).min)


def rows_mask(
    visible: torch.Tensor,
    dtype: torch.dtype,
    windows: AttentionWindows | None = None,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
) -> Any:
    """A batch's [B, T, K] bool visibility → the [B, 1, T, K] additive mask its forward takes, with the
    model's sliding windows applied to the rows' positions (``q_pos`` [B, T], ``kv_pos`` [B, K]) if it
    has any: then a dict of masks per layer type where layers mix (``AttentionWindows.apply``)."""
    mask: Any = float_mask(visible, dtype)  # [B, T, K]
    if windows is not None and windows.smallest is not None:
        mask = windows.apply(mask, q_pos, kv_pos)
    return {k: m[:, None] for k, m in mask.items()} if isinstance(mask, dict) else mask[:, None]  # [B, 1, T, K]


# ------------------------------------------------------------------------------- facts of a config


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_positions(config: Any) -> int | None:
    """The context treespec decodes in, from the model's config (None if it does not say): its context
    length, capped at ``attention_chunk_size`` where layers attend within chunks (Llama 4). Inside one
    chunk, chunked attention is causal attention, so the tree masks are the model's; past it they are
    not, and a decode stops at the chunk (``stop_reason`` "context") instead of going silently wrong."""
    cfg = text_config(config)
    found = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            found = value
            break
    chunk = getattr(cfg, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0 and _chunked_layers(cfg):
        found = chunk if found is None else min(found, chunk)
    return found


def _chunked_layers(cfg: Any) -> bool:
    """Whether any layer attends within chunks (Llama 4 names them in ``layer_types``; a config without
    layer types but with a chunk size is taken to chunk)."""
    types = getattr(cfg, "layer_types", None)
    return not types or "chunked_attention" in types


@dataclass(frozen=True)
class AttentionWindows:
    """The sliding windows of a model's attention layers. Caches here keep every row at its position
    (``DynamicCache()`` without a config), so windows are applied in our own masks: one window for every
    layer (``window``; None: full attention everywhere, e.g. Llama; Mistral slides every layer), or one
    per layer type (``by_type``: ``{"full_attention": None, "sliding_attention": 4096}``) for models that
    mix them (Gemma 2/3, Qwen2 with ``max_window_layers``). Their forwards take a dict of masks, one per
    layer type (``config.layer_types``)."""

    window: int | None = None
    by_type: dict[str, int | None] | None = None

    @property
    def smallest(self) -> int | None:
        """The shortest window of any layer (None: no layer slides)."""
        found = [w for w in (self.by_type or {}).values() if w] + ([self.window] if self.window else [])
        return min(found) if found else None

    def apply(self, mask: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> Any:
        """``mask`` [..., Q, K] with every layer's window applied: a tensor, or a dict per layer type."""
        if self.by_type is None:
            return window_mask(mask, q_pos, kv_pos, self.window)
        return {kind: window_mask(mask, q_pos, kv_pos, w) for kind, w in self.by_type.items()}


def attention_windows(config: Any) -> AttentionWindows:
    """The windows of a model from its config (see ``AttentionWindows``)."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window:
        return AttentionWindows()
    if types is None:  # e.g. Mistral: every layer slides when sliding_window is set
        return AttentionWindows(window=int(window))
    sliding = {t for t in types if "sliding" in str(t)}
    if not sliding:
        return AttentionWindows()
    if len(sliding) == len(set(types)):
        return AttentionWindows(window=int(window))
    return AttentionWindows(by_type={t: (int(window) if t in sliding else None) for t in set(types)})


#: model types whose positions are ALiBi biases computed from the keys' order in the cache, not from
#: position ids: a tree's siblings share a position but not an order, so their biases would be wrong
ALIBI_TYPES = ("bloom", "mpt")
#: recurrent and hybrid models: their state is a running summary, not per-token keys a tree mask can select
RECURRENT_TYPES = (
    "mamba",
    "mamba2",
    "falcon_mamba",
    "rwkv",
    "recurrent_gemma",
    "jamba",
    "zamba",
    "zamba2",
    "bamba",
    "falcon_h1",
    "granitemoehybrid",
    "lfm2",
    "xlstm",
    "nemotron_h",
    "qwen3_next",
)


#: architectures whose forward cannot take a tree: found by tests/test_arch_sweep.py (each failed in its
#: forward on the first tree); named here so they are refused at load instead
NO_TREE_TYPES = {
    "cpmant": "it adds its own position bias and builds its attention mask from segment ids",
    "openai-gpt": "its attention takes a 2-D padding mask only",
    "xlm": "its attention takes a 2-D padding mask only",
    "xlnet": "it attends two-stream over memories, not through a causal mask",
    "dory": "its looped layers attend over keys and values shared between loops, which a tree mask does not cover",
    "prophetnet": "it attends over n-gram streams with masks of its own shape",
}
#: what a model's own code calls on its cache that treespec's cache (keys and values per token) cannot
#: answer: states that fold every token in (convolutions), compressed keys
CACHE_CALLS = {
    "get_conv_state": "it keeps convolution states in its cache, which fold tokens in order (a tree's branches cannot share them)",
    "store_compression_weights": "it compresses its cache, which treespec's per-token cache cannot hold",
}


def code_refusal(model: Any) -> str | None:
    """Why a model's own code cannot verify a tree (one phrase), read from its modeling module, or None."""
    import inspect
    import sys

    module = sys.modules.get(type(model).__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return None
    found = next((why for call, why in CACHE_CALLS.items() if f".{call}(" in source), None)
    return f"{getattr(model.config, 'model_type', type(model).__name__)}: {found}" if found else None


def tree_refusal(config: Any) -> str | None:
    """Why a model cannot verify a draft tree in one forward (one phrase), or None if it can."""
    cfg = text_config(config)
    kind = str(getattr(cfg, "model_type", ""))
    attn = getattr(cfg, "attn_config", None)  # MPT keeps its alibi flag there
    if kind in ALIBI_TYPES or bool(getattr(cfg, "alibi", False)) or (isinstance(attn, dict) and attn.get("alibi")):
        return (
            f"{kind or 'this model'} encodes positions as ALiBi biases over the order of the cached keys, which "
            "a tree's siblings (one position, different order) would break"
        )
    if kind in NO_TREE_TYPES:
        return f"{kind}'s forward cannot take a tree mask: {NO_TREE_TYPES[kind]}"
    layer_types = [str(t) for t in (getattr(cfg, "layer_types", None) or [])]
    if kind in RECURRENT_TYPES or any(t in ("linear_attention", "mamba", "conv") for t in layer_types):
        return f"{kind or 'this model'} is recurrent (state-space or linear attention): it has no per-token keys a tree mask can select"
    return None


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


def grouped_sdpa_helps(model: Any) -> bool:
    """Whether ``grouped_sdpa`` can speed up ``model``'s masked forwards: SDPA attention with grouped
    KV heads (fewer KV heads than query heads). Whether a layer runs on a CPU is decided per call."""
    cfg = text_config(model.config)
    heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    return (
        getattr(cfg, "_attn_implementation", None) == "sdpa"
        and isinstance(heads, int)
        and isinstance(kv_heads, int)
        and kv_heads < heads
    )


#: on in the thread (context) running a treespec forward that asked for grouped SDPA (``grouped_sdpa``)
_GROUPED = contextvars.ContextVar("treespec_grouped_sdpa", default=False)


def _install_grouped_sdpa() -> bool:
    """Wrap transformers' ``use_gqa_in_sdpa`` once: inside ``grouped_sdpa(True)``, attention on a CPU
    passes the grouped KV heads to torch; everywhere else (other threads, other models, GPU layers) it
    answers exactly as before. False if this transformers has no such hook (then nothing changes)."""
    try:
        from transformers.integrations import sdpa_attention as sdpa
    except ImportError:  # pragma: no cover - transformers without the SDPA integration module
        return False
    original = getattr(sdpa, "use_gqa_in_sdpa", None)
    if original is None:
        return False
    if getattr(original, "_treespec", False):
        return True

    def use_gqa_in_sdpa(*args: Any, **kwargs: Any) -> bool:
        key = kwargs.get("key", args[1] if len(args) > 1 else None)
        if _GROUPED.get() and key is not None and key.device.type == "cpu":
            return True
        return original(*args, **kwargs)

    use_gqa_in_sdpa._treespec = True  # type: ignore[attr-defined]
    sdpa.use_gqa_in_sdpa = use_gqa_in_sdpa
    return True


@contextlib.contextmanager
def grouped_sdpa(on: bool) -> Iterator[None]:
    """Let transformers' SDPA attention pass grouped KV heads to torch as they are (``enable_gqa``)
    during a masked forward on a CPU, instead of first expanding them to one copy per query head
    (``repeat_kv``: a copy of every layer's whole cache, every forward). transformers does so only
    without a mask, because CUDA's fast kernels refuse masked GQA; torch's CPU kernel takes it. Same
    arithmetic, less copying (docs/design.md, "Batches"). The switch is a context variable read by a
    wrapper of transformers' own decision (``use_gqa_in_sdpa``), so it holds only in this thread's
    forward and only for layers on a CPU; nothing process-wide changes."""
    if not on or not _install_grouped_sdpa():
        yield
        return
    token = _GROUPED.set(True)
    try:
        yield
    finally:
        _GROUPED.reset(token)


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


def move_cache_rows(cache: Any, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """For each i, copy the KV column ``src[i]`` of batch row ``rows[i]`` to column ``dst[i]`` of the same
    row, in every layer (one gather and one scatter per layer; the gather reads before anything is
    written, so source and destination ranges may overlap). rows, src, dst: [K] long."""
    for layer in cache.layers:
        dev = layer.keys.device
        r, a, b = rows.to(dev), src.to(dev), dst.to(dev)
        layer.keys[r, :, b] = layer.keys[r, :, a]  # [K, H_kv, D]
        layer.values[r, :, b] = layer.values[r, :, a]


def concat_caches(a: Any, width_a: int, b: Any, width_b: int, rows_a: int, rows_b: int) -> Any:
    """Cache ``a`` ([rows_a, ·, width_a, ·] per layer) with cache ``b``'s rows appended along the batch
    dimension; the narrower one is padded with zero columns up to the wider width (columns the rows'
    masks never show). Either may have no columns yet (prompts of one token): its rows are zeros.
    Returns the grown cache (``a``, or ``b`` if only ``b`` has tensors)."""

    def tensors(cache: Any) -> Any:
        return cache if cache.layers and getattr(cache.layers[0], "keys", None) is not None else None

    ca, cb = tensors(a), tensors(b)
    if ca is None and cb is None:
        return a
    like = ca if ca is not None else cb  # the shapes of the zero rows
    width = max(width_a if ca is not None else 0, width_b if cb is not None else 0)

    def part(cache: Any, i: int, rows: int, w: int, which: str) -> torch.Tensor:
        ref = getattr(like.layers[i], which)
        if cache is None:
            return ref.new_zeros(rows, ref.shape[1], width, ref.shape[3])
        t = getattr(cache.layers[i], which)[:, :, :w]
        return torch.nn.functional.pad(t, (0, 0, 0, width - w)) if w < width else t

    for i, layer in enumerate(like.layers):
        keys = torch.cat([part(ca, i, rows_a, width_a, "keys"), part(cb, i, rows_b, width_b, "keys")])  # [A+B, H, W, D]
        values = torch.cat([part(ca, i, rows_a, width_a, "values"), part(cb, i, rows_b, width_b, "values")])
        layer.keys, layer.values = keys, values
    return like
