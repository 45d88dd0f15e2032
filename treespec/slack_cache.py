"""A ``DynamicCache`` whose layers append in place, into spare room, instead of ``torch.cat``.

Transformers' ``DynamicLayer.update`` appends a forward's keys and values with ``torch.cat``: every
forward copies the layer's whole cache, [B, H_kv, S, D] per layer, twice (keys and values). One
sequence of a few hundred tokens hardly notices; a batch does: for 16 rows of the default target
(8 layers, 4 KV heads of 32, S = 400) the two ``cat``s were a large share of a verification forward in
torch's profiler.

``SlackLayer`` keeps each layer's rows at the front of a larger buffer ([B, H_kv, capacity, D]) and
exposes ``keys`` / ``values`` as views of the first ``S`` rows, so a forward writes only its own new
rows (amortised: a full buffer is replaced by one a quarter larger than its rows). Everything that reads or rewrites ``layer.keys``
keeps working unchanged, because the layer trusts its buffer only while ``keys`` IS the front view
of it:

- cropping (``keys[..., :-n, :]``), in-place row copies (``keys[:, :, a:b] = ...``, advanced-index
  assignment) act on the view, i.e. on the buffer: the next append reuses the room;
- anything that *replaces* ``keys`` with another tensor (``index_select`` on the batch dimension,
  ``torch.cat`` of two caches, moving to another device) breaks the identity, and the next append
  starts a new buffer from the current contents. Correctness never depends on the fast path.

Small caches (under ``SLACK_FROM_BYTES`` of keys per layer: one short sequence of a small model) append
with ``torch.cat`` as ``DynamicLayer`` does, because copying them costs less than the view-and-copy ops
of an append into room; a layer switches to a buffer when it grows past that, and back when cropped below.

The returned keys/values are strided views (row stride = capacity · D); SDPA reads them as they are.
Rows beyond ``S`` in the buffer are stale: nothing may read them, and nothing does — the views end at ``S``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: the smallest room a buffer is given beyond its rows (cache positions)
MIN_ROOM = 64
#: below this many bytes of keys per layer, appends ``torch.cat`` as ``DynamicLayer`` does: copying a small
#: cache is cheaper than the four view-and-copy ops of an append into room (measured on this CPU: a
#: one-row append to [1, 4, 100, 8] costs 3.5 µs with ``cat``, 8 µs into room; equal near 128 KiB; at
#: [1, 48, 300, 64] 199 µs with ``cat``, 8.5 µs into room)
SLACK_FROM_BYTES = 128 * 1024


class SlackLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare room (see the module docstring)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self._vbuf: torch.Tensor | None = None
        self._kview: torch.Tensor | None = None  # the views the last update returned (identity: the fast path)
        self._vview: torch.Tensor | None = None

    def _owns(self, t: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor) -> bool:
        """``t`` is the front view of ``buf`` and ``new``'s rows fit behind it."""
        return (
            buf is not None
            and t.dim() == 4
            and t.data_ptr() == buf.data_ptr()
            and t.stride() == buf.stride()
            and t.shape[:2] == buf.shape[:2] == new.shape[:2]
            and t.shape[3] == buf.shape[3]
            and t.shape[2] + new.shape[2] <= buf.shape[2]
            and t.dtype == new.dtype
            and t.device == new.device
        )

    @staticmethod
    def _grow(t: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """A new buffer holding ``t``'s rows (if any), ``new``'s, and a quarter more room (at least
        ``MIN_ROOM``): a few steps' appends each time, for a quarter more memory than the rows need."""
        b, h, m, d = new.shape
        s = t.shape[2] if t.dim() == 4 else 0
        buf = new.new_empty(b, h, s + m + max(MIN_ROOM, (s + m) // 4), d)  # [B, H_kv, capacity, D]
        if s:
            buf[:, :, :s] = t
        return buf

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values, n = self.keys, self.values, key_states.shape[2]
        if (keys.numel() + key_states.numel()) * key_states.element_size() < SLACK_FROM_BYTES:
            self._kbuf = self._vbuf = self._kview = self._vview = None  # small: cat (and let a buffer go)
            return super().update(key_states, value_states)
        s = keys.shape[2] if keys.dim() == 4 else 0  # rows held
        # fast path: the views this layer returned last time, untouched, and room for the new rows (a plain
        # decoding step of a small model is a few microseconds per layer, so the full check is kept for
        # views someone else made, e.g. a crop)
        fast = (
            keys is self._kview
            and values is self._vview
            and s + n <= self._kbuf.shape[2]
            and key_states.shape[:2] == self._kbuf.shape[:2]
            and key_states.dtype == self._kbuf.dtype
        )
        if not fast and not (self._owns(keys, self._kbuf, key_states) and self._owns(values, self._vbuf, value_states)):
            self._kbuf, self._vbuf = self._grow(keys, key_states), self._grow(values, value_states)
        e = s + n
        self._kbuf.narrow(2, s, n).copy_(key_states)  # only the new rows are written
        self._vbuf.narrow(2, s, n).copy_(value_states)
        self.keys, self.values = self._kbuf.narrow(2, 0, e), self._vbuf.narrow(2, 0, e)  # [B, H_kv, S', D] views
        self._kview, self._vview = self.keys, self.values
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = self._kview = self._vview = None
        super().reset()


def slack_cache() -> DynamicCache:
    """An empty ``DynamicCache`` (no config: every layer full attention, row i = position i) whose
    layers are ``SlackLayer``s."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = SlackLayer
    return cache
