"""Several sequences in one target forward: per-row trees, per-row acceptance, per-row compaction.

``BatchTarget`` wraps a ``TargetModel`` (same model, its own cache) for B sequences at once. Layout of
the batched KV cache, rows of different lengths ("right padding with holes"):

    row b:  [ committed_b[:-1] (len_b rows) | garbage up to S = max len | tree block of N_max rows ]
             positions 0 .. len_b-1                                      len_b + depth

Every query sees its own row's first len_b keys (the holes between len_b and S are masked), and
inside the tree block its own ancestors; a padding node of a row whose tree is smaller than N_max
sees only itself. After verification each row copies its accepted rows from the tree block to
len_b, len_b+1, ... (``commit``), and the cache is cut to the longest row. Rows never move, so a
finished row is dropped by indexing the batch dimension (``keep``).

Why not left padding (Hugging Face's batched ``generate``): a left-padded row's accepted KV rows must
land right after its own prefix, which, with rows accepting different numbers of tokens, means
re-aligning every row's whole cache each step; here a row's prefix never moves and its accepted rows
are copied into place, as for one sequence (``kv.keep_rows``).

One row is the common case (``Decoder.generate(prompt)``), and it keeps the single sequence's fast
path: while the batch has one row, every call goes to the ``TargetModel``'s own cache and methods
(a root-only step without a mask, the prompt's logits only for its last token, sliding-window layers).
The row's cache is already this layout (row i = position i), so when rows join it becomes the
batch's cache as it is. Sliding-window layers (Mistral, Gemma 2/3, Qwen2's lower layers) get their
windows in the batched mask as one row does (``kv.AttentionWindows``): every row keeps its positions.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from treespec.errors import ConfigError, TreespecError
from treespec.inference import inference
from treespec.kv import (
    concat_caches,
    crop_cache,
    move_cache_rows,
    rows_mask,
    rows_prefill_visible,
    rows_tree_visible,
)
from treespec.slack_cache import slack_cache
from treespec.target import TargetModel
from treespec.tree import TreeTensors


class BatchTarget:
    def __init__(self, target: TargetModel, single: bool = False):
        """``single``: a view of ``target``'s own sequence as a batch of one row (as it stands: nothing
        is prefilled or reset), e.g. for ``step.step`` on a ``TargetModel``."""
        self.target = target
        self.model = target.model
        self.cache: DynamicCache | None = None  # the batched cache (None while one row uses the target's)
        self.single = single  # one row, on the TargetModel's own cache and methods
        self._lens = torch.zeros(0, dtype=torch.long)  # [B] committed[:-1] rows of each row
        self.width = 0  # S: cache rows before a tree block
        self._tree: int | None = None  # N_max of the last forward_trees, until commit

    @property
    def lens(self) -> torch.Tensor:
        """[B] the committed[:-1] rows each row has cached."""
        return torch.tensor([self.target.past_len]) if self.single else self._lens

    def row_lens(self) -> list[int]:
        """``lens`` as a list (what each row's tree positions start from)."""
        return [self.target.past_len] if self.single else self._lens.tolist()

    @property
    def rows(self) -> int:
        return 1 if self.single else len(self._lens)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        visible: torch.Tensor,
        want_hidden: Any,
        lean: bool = False,
        prefill: bool = False,
    ) -> Any:
        """ids, pos [B, T]; visible [B, T, S+T] bool → the model's output (logits [B, T, V]); ``lean``:
        the target's lean forward where it has one (tree forwards); ``prefill``: no logits are read
        (each prompt's last token is its first tree's root), so the model computes them for one
        position only where it can (a SmolLM2 prefill of 4 × 300 tokens would otherwise run 1,200 rows
        through its 49,152 × 576 output layer).
        Sliding windows are applied here as for one row: cache column j holds position j (a hole is
        masked by ``visible`` anyway), the T new columns hold ``pos``."""
        windows, kv_pos = self.target.windows, None
        if windows.smallest is not None:  # each key's position: [B, S+T]
            s = visible.shape[-1] - ids.shape[1]
            kv_pos = torch.cat([torch.arange(s).expand(ids.shape[0], -1), pos], dim=1)
        mask = rows_mask(visible.to(self.device), self.dtype, windows, pos, kv_pos)  # [B, 1, T, S+T]
        extra = self.target.last_logits_only() if prefill else {}
        try:
            return self.target.run(
                self.cache,
                lean,
                **extra,
                input_ids=ids.to(self.device),
                position_ids=pos.to(self.device),
                attention_mask=mask,
                output_hidden_states=bool(want_hidden),
            )
        except Exception as exc:
            if self.cache is not None and self.cache.get_seq_length() > self.width:
                crop_cache(self.cache, self.width)
            raise TreespecError(f"target forward failed ({type(exc).__name__}: {exc})") from exc

    @inference
    def prefill(self, prompts: list[list[int]], want_hidden: Any = False) -> list[torch.Tensor | None]:
        """Start B sequences: cache ``prompt_b[:-1]`` of each (each prompt's last token is its first root).
        Returns each row's hidden states [L_b - 1, ·] if asked (``TargetModel.hidden_of``), else Nones."""
        if min(len(p) for p in prompts) < 1:
            raise ConfigError("every prompt needs at least one token")
        self._tree, self.single = None, len(prompts) == 1
        if self.single:  # the target's own prefill (its cache, logits for the last token only)
            self.cache = None
            return [self.target.prefill(torch.tensor(prompts[0][:-1], dtype=torch.long), want_hidden)]
        return self._prefill_rows(prompts, want_hidden)

    def _prefill_rows(self, prompts: list[list[int]], want_hidden: Any) -> list[torch.Tensor | None]:
        """``prefill`` into a batched cache (right-padded rows), also for one prompt."""
        self.target.locate()
        self.cache = slack_cache()
        lens = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)  # [B]
        s = int(lens.max())
        self._lens, self.width = lens, s
        if s == 0:
            return [self.target.no_hidden(want_hidden) for _ in prompts]
        ids = torch.zeros(len(prompts), s, dtype=torch.long)  # [B, S] right-padded
        for b, p in enumerate(prompts):
            ids[b, : lens[b]] = torch.tensor(p[:-1])
        visible = rows_prefill_visible(lens, s)  # [B, S, S]
        out = self._forward(ids, torch.arange(s)[None].expand(len(prompts), -1), visible, want_hidden, prefill=True)
        hidden = TargetModel.hidden_of(out, want_hidden)  # [B, S, ·] or None
        return [hidden[b, : lens[b]] if hidden is not None else None for b in range(len(prompts))]

    @inference
    def forward_trees(self, trees: list[TreeTensors], want_hidden: Any = False) -> tuple[torch.Tensor, list[Any]]:
        """ONE forward over every row's tree (built with ``tensors(lens[b])``). Returns the logits of
        every row, padded: [B, N_max, V] (row b's tree is ``[b, :N_b]``; batched acceptance reads them
        at once), and per row its hidden states [N_b, ·] (or None)."""
        if self.single:  # the target's own tree forward (a root alone without a mask)
            logits, hidden = self.target.forward_tree(trees[0], want_hidden)  # [N, V], [N, ·] or None
            return logits[None], [hidden]
        b, s = len(trees), self.width
        sizes = [int(t.input_ids.shape[0]) for t in trees]
        n = max(sizes)
        ids = torch.zeros(b, n, dtype=torch.long)  # [B, N]
        pos = self.lens[:, None].repeat(1, n)  # [B, N] padding nodes sit at the row's length
        for r, (tt, size) in enumerate(zip(trees, sizes)):
            ids[r, :size] = tt.input_ids
            pos[r, :size] = tt.position_ids
        visible = rows_tree_visible(self.lens, s, [tt.ancestors for tt in trees])  # [B, N, S+N]
        out = self._forward(ids, pos, visible, want_hidden, lean=True)
        self._tree = n
        hidden = TargetModel.hidden_of(out, want_hidden)  # [B, N, ·] or None
        return out.logits, [hidden[r, :size] if hidden is not None else None for r, size in enumerate(sizes)]

    @inference
    def commit(self, nodes: list[torch.Tensor]) -> None:
        """Row b keeps the KV rows of ``nodes[b]`` (its root and accepted nodes, ascending) of the last
        tree block, copied to lens_b, lens_b + 1, ...; then the cache is cut to the longest row."""
        if self.single:
            self.target.commit(nodes[0])
            return
        if self._tree is None:
            raise TreespecError("BatchTarget.commit() needs a successful forward_trees() first")
        s = self.width
        counts = torch.tensor([int(x.shape[0]) for x in nodes])  # [B]
        new = self.lens + counts  # [B]
        rows = torch.repeat_interleave(torch.arange(len(nodes)), counts)  # [K] the batch row of each kept node
        src = s + torch.cat([x.cpu() for x in nodes])  # [K] its column in the tree block
        dst = torch.cat([torch.arange(int(lo), int(hi)) for lo, hi in zip(self.lens, new)])  # [K] where it goes
        move_cache_rows(self.cache, rows, src, dst)
        self._lens, self.width, self._tree = new, int(new.max()), None
        crop_cache(self.cache, self.width)

    @inference
    def add(self, prompts: list[list[int]], want_hidden: Any = False) -> list[torch.Tensor | None]:
        """New rows join the batch (a finished row's place is taken: continuous batching): their prompts
        are prefilled in a batch of their own, then their caches are appended along the batch dimension
        (the narrower side padded with masked columns). Returns their hidden states as ``prefill``."""
        if not self.rows:
            return self.prefill(prompts, want_hidden)
        if self.single:  # the one row's cache (row i = position i) becomes the batch's
            self.cache, self._lens, self.width = self.target.cache, self.lens, self.target.past_len
            self.target.reset()  # the target's own sequence is the batch's row 0 now
            self.single = False
        other = BatchTarget(self.target)
        hidden = other._prefill_rows(prompts, want_hidden)
        self.cache = concat_caches(self.cache, self.width, other.cache, other.width, len(self._lens), len(prompts))
        self._lens = torch.cat([self._lens, other.lens])
        self.width = max(self.width, other.width)
        return hidden

    def keep(self, rows: list[int]) -> None:
        """Keep only the batch rows ``rows`` (finished rows leave the batch)."""
        if self.single:
            if not rows:
                self.single, self._lens = False, torch.zeros(0, dtype=torch.long)
            return
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
            layer.values = layer.values.index_select(0, index.to(layer.values.device))
        self._lens = self._lens[index]
        width = int(self._lens.max()) if len(rows) else 0
        if width < self.width:
            crop_cache(self.cache, width)
        self.width = width
