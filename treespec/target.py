"""TargetModel: a Hugging Face causal LM behind the three calls a step needs.

It owns the target's KV cache, which always holds ``committed[:-1]``: the last committed token is
the next tree's root and is fed by ``forward_tree``. Works with any model whose forward accepts a 4D
float ``attention_mask`` and explicit ``position_ids`` over a ``DynamicCache`` (Llama, Mistral,
Qwen2, GPT-2, ...: tested in ``tests/test_tree_forward.py``). Masks and cache surgery: ``treespec.kv``.
Devices and dtypes come from the model.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache

from treespec import gguf_blocks, threads, weight_blocks
from treespec.errors import ConfigError, TreespecError
from treespec.inference import inference
from treespec.kv import (
    attention_windows,
    cache_keyword,
    code_refusal,
    crop_cache,
    grouped_sdpa,
    grouped_sdpa_helps,
    keep_rows,
    max_positions,
    tree_refusal,
)
from treespec.lean import lean_target
from treespec.row_matmul import RowMatmul
from treespec.slack_cache import slack_cache
from treespec.tree import TreeTensors


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 16 GiB
        return 16 << 30


class TargetModel:
    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.config = model.config
        self.cache: DynamicCache | None = None
        self.cache_keyword = cache_keyword(model)  # `cache` (transformers ≥ 5.2x) or `past_key_values`
        self.lock = threading.Lock()  # one sequence at a time: Decoder.generate holds it (thread safety)
        self.decoding_thread: int | None = None
        self.past_len = 0
        self._tree_len: int | None = None
        self.forwards = 0  # forwards run through ``run`` (the model's or the lean one), ever
        params = inspect.signature(model.forward).parameters
        self.has_logits_to_keep = "logits_to_keep" in params  # a prefill asks for its last row's logits only
        reason = tree_refusal(model.config) or code_refusal(model)
        if reason is not None:
            raise ConfigError(
                f"target {self.name!r} cannot verify draft trees: {reason}; use a transformer with "
                "rotary or learned positions (Llama, Qwen, Mistral, Gemma, GPT-2, ...)"
            )
        self.windows = attention_windows(model.config)  # sliding windows, applied in our own masks
        self._max_positions = max_positions(model.config)  # read once: the Decoder asks every step
        self.locate()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold this target (its one KV cache) for one sequence: a decode, or a cost measurement. Other
        threads wait their turn; a second hold from the thread already holding it (``generate`` called
        from its own ``stream`` callback) is refused instead of deadlocking."""
        if self.decoding_thread == threading.get_ident():
            raise ConfigError(
                "this target is already decoding on this thread (generate() called from a stream "
                "callback?): use a Decoder with a target of its own"
            )
        with self.lock, threads.following():  # torch's threads follow the machine's load meanwhile
            self.decoding_thread = threading.get_ident()
            try:
                yield
            finally:
                self.decoding_thread = None

    # ------------------------------------------------------------------ facts about the model
    def locate(self) -> None:
        """Read the model's device, dtype and whether grouped SDPA helps it once: at construction and at
        every new sequence, not on every step. The device is where inputs go: the first parameter's, or for a model placed by a
        device map (accelerate: split across devices, offloaded to disk) its embedding's execution
        device; each layer then moves what it reads to its own device."""
        first = next(self.model.parameters())
        if getattr(self, "_placement", None) != (first.device, first.dtype):  # new, or moved: which layers
            gguf_blocks.prepare(self.model)  # a GGUF's blocks for the compiled product, where they are exact
            self.row_matmul = RowMatmul(self.model)  # few-row products on a CPU (treespec.row_matmul)
            self._placement, self._spot = (first.device, first.dtype), 0
        else:  # a new sequence: one row of each weight against its blocks (an edit through .data)
            self._spot += 1
            weight_blocks.spot_check([m.weight for m in self.row_matmul.layers], self._spot)
        self._device, self._dtype = first.device, first.dtype
        self.lean = lean_target(self.model)  # tree forwards without Hugging Face's per-module overhead
        self.grouped_sdpa = grouped_sdpa_helps(
            self.model
        )  # masked forwards pass grouped KV heads as they are (kv.grouped_sdpa)
        if getattr(self.model, "hf_device_map", None):
            emb = self.model.get_input_embeddings()
            hook = getattr(emb, "_hf_hook", None)
            device = getattr(hook, "execution_device", None) if hook is not None else None
            weight = emb.weight.device
            self._device = (
                torch.device(device)
                if device is not None
                else (weight if weight.type != "meta" else torch.device("cpu"))
            )

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    @property
    def max_tree_nodes(self) -> int:
        """The most drafted nodes one tree forward may have: no more than the context (no tree
        needs more), and few enough that its mask [N, C+N], logits [N, V] and ancestor matrix [N, N]
        take at most half of this machine's memory."""
        context = self.max_positions or 1 << 20
        item = torch.finfo(self.dtype).bits // 8

        def need(n: int) -> int:  # bytes of one tree forward's own tensors
            return item * n * (context + n) + 4 * n * self.vocab_size + n * n

        budget = _physical_memory() // 2
        lo, hi = 1, context
        while lo < hi:  # the largest n <= context with need(n) <= budget
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
        return lo

    @property
    def eos_token_ids(self) -> set[int]:
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return set()
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @classmethod
    def load(cls, name_or_path: str, trust_remote_code: bool = False, **kwargs: Any) -> TargetModel:
        """Load model and tokenizer by alias, local path or hub id (see ``treespec.models``); the
        model's own code from the hub runs only with ``trust_remote_code=True``. ``kwargs``: ``device``,
        ``dtype``, or ``device_map`` / ``max_memory`` / ``offload_folder`` to split the model across
        devices or offload it to disk (accelerate; ``treespec.devices.device_placement``)."""
        from treespec.models import load_causal_lm, load_tokenizer

        model = load_causal_lm(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
        return cls(model, load_tokenizer(name_or_path, trust_remote_code), name=name_or_path)

    # ------------------------------------------------------------------ the three calls
    def reset(self) -> None:
        self.locate()  # the model may have been moved (or its attention changed) since the last sequence
        self.cache = slack_cache()  # full layers: row i holds position i (windows: treespec.kv.AttentionWindows)
        self.past_len = 0
        self._tree_len: int | None = None  # nodes of the last forward_tree, until commit

    @inference
    def prefill(self, input_ids: torch.Tensor, want_hidden: bool | tuple[int, ...] = False) -> torch.Tensor | None:
        """Start a new sequence: run ``input_ids`` ([L], the prompt without its last token) into a
        fresh cache. Returns their hidden states if asked (``hidden_of``)."""
        self.reset()
        n = int(input_ids.shape[0])
        if n == 0:
            return self.no_hidden(want_hidden)
        ids = input_ids.to(self.device)[None]  # [1, L]
        out = self._forward(
            input_ids=ids,
            position_ids=torch.arange(n, device=self.device)[None],  # [1, L]
            attention_mask=None,  # plain causal
            output_hidden_states=want_hidden,
            **self.last_logits_only(),  # the root's logits come from the first tree forward
        )
        self.past_len = n
        hidden = self.hidden_of(out, want_hidden)  # [1, L, H] or [1, L, k·H]
        return hidden[0] if hidden is not None else None

    def last_logits_only(self) -> dict[str, int]:
        """Keyword arguments for a forward whose logits are read at its last position at most (a
        prefill): ``logits_to_keep=1`` where the model takes it, so its output layer runs for one row."""
        return {"logits_to_keep": 1} if self.has_logits_to_keep else {}

    @inference
    def forward_tree(
        self, tt: TreeTensors, want_hidden: bool | tuple[int, ...] = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over every tree node. Returns logits [N, V] (row i: the target's next-token
        logits after node i's path) and, if asked, hidden states (``hidden_of``)."""
        n = int(tt.input_ids.shape[0])
        past = tt.attention_mask.shape[-1] - n
        window = self.windows.smallest
        if n == 1 and (window is None or past < window):
            mask = None  # the root alone sees every cached token: the model's own causal path (a plain step)
        else:
            mask = tt.attention_mask.to(self.device, self.dtype)  # [1, 1, N, P+N]
            if window is not None:  # a tensor, or a dict of masks per layer type (Gemma 2/3)
                kv_pos = torch.cat([torch.arange(past), tt.position_ids.cpu()])  # [P+N] position of every key
                mask = self.windows.apply(mask, tt.position_ids, kv_pos)
        out = self._forward(
            lean=True,
            input_ids=tt.input_ids.to(self.device)[None],  # [1, N]
            position_ids=tt.position_ids.to(self.device)[None],  # [1, N]
            attention_mask=mask,
            output_hidden_states=want_hidden,
        )
        self._tree_len = int(tt.input_ids.shape[0])
        self.past_len += self._tree_len
        hidden = self.hidden_of(out, want_hidden)  # [1, N, H] or [1, N, k·H]
        return out.logits[0], hidden[0] if hidden is not None else None  # [N, V], [N, ·]

    @staticmethod
    def hidden_of(out: Any, want: bool | tuple[int, ...]) -> torch.Tensor | None:
        """From a forward's output: None (``want`` False), the last layer's hidden states [B, N, H]
        (after the final norm; ``want`` True), or ``hidden_states[i]`` for each i in ``want`` (0 = the
        embeddings, i = the input of decoder layer i) concatenated: [B, N, k·H] (EAGLE-3's fused feature)."""
        if not want:
            return None
        if want is True:
            return out.hidden_states[-1]  # [B, N, H]
        return torch.cat([out.hidden_states[i] for i in want], dim=-1)  # [B, N, k·H]

    def no_hidden(self, want: bool | tuple[int, ...]) -> torch.Tensor | None:
        """What ``hidden_of`` gives for zero tokens: None, or an empty [0, H] / [0, k·H]."""
        if not want:
            return None
        width = self.hidden_size * (1 if want is True else len(want))
        return torch.zeros(0, width, device=self.device, dtype=self.dtype)

    @property
    def hidden_size(self) -> int:
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return int(getattr(cfg, "hidden_size", None) or cfg.n_embd)

    @inference
    def commit(self, nodes: torch.Tensor) -> None:
        """Keep only the KV rows of ``nodes`` (the root and the accepted nodes, ascending) of the
        last tree forward: copy them into place behind the prefix and crop the rest."""
        if self._tree_len is None:
            raise TreespecError("TargetModel.commit() needs a successful forward_tree() first")
        base = self.past_len - self._tree_len
        if self._tree_len > 1:  # the root alone (a plain step) leaves nothing to drop
            keep_rows(self.cache, base, base + nodes.cpu())
        self.past_len = base + int(nodes.shape[0])
        self._tree_len = None

    # ------------------------------------------------------------------ internals
    def run(self, cache: Any, lean: bool = False, **kwargs: Any) -> Any:
        """The model's forward over ``cache``, few-row products applied; with ``lean``, the lean forward
        where the model has one (``treespec.lean.lean_target``: tree forwards, not prefills)."""
        self.forwards += 1
        if lean and self.lean is not None:
            with self.row_matmul.applied(modules=False):  # lean calls row_matmul.linear itself
                return self.lean(cache=cache, **kwargs)
        with self.row_matmul.applied(), grouped_sdpa(self.grouped_sdpa and kwargs.get("attention_mask") is not None):
            return self.model(**{self.cache_keyword: cache}, use_cache=True, return_dict=True, **kwargs)

    def _forward(self, lean: bool = False, **kwargs: Any) -> Any:
        before = self.past_len
        self._tree_len = None
        try:
            out = self.run(self.cache, lean, **kwargs)
        except Exception as exc:
            if self.cache is not None and self.cache.get_seq_length() > before:
                crop_cache(self.cache, before)  # a failed forward may have appended to the cache
            raise TreespecError(f"target forward failed ({type(exc).__name__}: {exc})") from exc
        return out
