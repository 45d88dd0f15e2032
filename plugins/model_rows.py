"""A batch's draft-model rows (drafters ``model`` and ``self``): every row's new nodes in ONE forward.

Each row is a ``ModelDrafter`` fork (made a ``ModelRow``) that keeps its own bookkeeping exactly as alone (``cache_len``
committed tokens fed, ``pending`` tokens, the tree items of this step with their *virtual* rows
``root_pos + i``, ``child_row``, ``probs``); the draft model's KV cache is one cache for all rows
(``treespec.rows_cache``), and ``cols[i]`` is the real column of tree item i.

A round appends a [B, T] block. Row b's part is its pending tokens (the step's first round only) then
the tree nodes it needs, as alone:

    pending token i    at position cache_len_b + i, sees the row's prefix and the pending tokens ≤ i
    tree node n        at position root_pos_b + depth(n), sees the prefix, all pending tokens, and
                       its ancestors among the row's tree items (earlier rounds' columns and this block's)

After the forward the pending tokens' columns are copied into place after the prefix (they are
committed); tree items stay where they are until ``commit``, which copies the root's and the accepted
nodes' columns to root_pos_b … (what ``kv.keep_rows`` does for one sequence). Draft models with
sliding windows get them in the rows' masks: every key's position is known (a prefix column j holds
position j, a tree item's column its node's), so the one-row rule applies per row (``kv.rows_mask``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treespec.inference import inference
from treespec.interfaces import Expansion, Proposals
from treespec.kv import causal_visible, move_cache_rows
from treespec.rows_cache import CacheRow, RowsCache

if TYPE_CHECKING:
    from treespec.plugins.model_drafter import ModelDrafter


class ModelRow(CacheRow):
    """A row of ``ModelRows``: ``cols[i]`` is the shared cache's column of its tree item i, and a commit
    moves its accepted items' columns into place in the shared cache."""

    def _ready(self) -> None:
        super()._ready()  # type: ignore[misc]
        self.cols: list[int] = []

    def drop_tree_rows(self) -> None:
        """Nothing of its own: the group cuts the columns a step appended (``RowsCache.cut``)."""

    def keep_path(self, keep: list[int]) -> None:
        self.group.keep_path(self.index, keep)


class ModelRows(RowsCache):
    drafters: list[ModelDrafter]
    row_class = ModelRow

    @inference
    def expand_together(self, requests: dict[int, Expansion]) -> dict[int, Proposals]:
        rows = self.drafters
        self.new_step(r.cache_len for r in rows)
        answers: dict[int, Proposals] = {}
        feed: dict[int, list[int]] = {}  # row -> tree nodes to feed this round
        for i, req in requests.items():
            r, k = rows[i], min(req.k, rows[i].vocab)
            wanted = req.nodes.tolist()
            if not wanted or (
                r.max_positions and r.root_pos + int(req.tree.depths[req.nodes].max()) >= r.max_positions
            ):
                answers[i] = Proposals(torch.zeros(len(wanted), k, dtype=torch.long), torch.zeros(len(wanted), k))
                continue  # the draft's context is full: propose nothing (the target still makes progress)
            new = r.unfed(req.tree, wanted)
            if new:
                feed[i] = new
        if feed:
            for i in self.alone(list(feed), lambda i: len(rows[i].pending)):
                self._pending_alone(i)
            self._feed({i: (requests[i].tree, new) for i, new in feed.items()})
        for i, req in requests.items():
            if i in answers:
                continue
            r, k = rows[i], min(req.k, rows[i].vocab)
            index = torch.tensor([r.row_of[n] - r.root_pos for n in req.nodes.tolist()])  # [M]
            q, tokens = r.probs[index].topk(k, dim=-1)  # [M, k]
            answers[i] = Proposals(tokens=tokens.cpu(), q=q.float().cpu())
        return answers

    def _pending_alone(self, i: int) -> None:
        """Row i's pending tokens in a forward of its own (a prompt that just joined the batch: in the
        rows' block it would pad every other row to its length), into place after its prefix
        (``RowsCache.prefix_cache`` / ``splice``)."""
        r, base = self.drafters[i], self.base
        p, past = len(r.pending), r.cache_len
        cache = self.prefix_cache(i, past)
        pos = torch.arange(past, past + p)[None]  # [1, P]
        base.forward(
            input_ids=torch.tensor([r.pending], dtype=torch.long).to(base.device),
            position_ids=pos.to(base.device),
            attention_mask=self.float_mask(
                causal_visible(past, p)[None], base.dtype, base.device, base.windows, pos, torch.arange(past + p)[None]
            ),
            **{base.cache_keyword: cache},
            use_cache=True,
        )
        self.splice(i, cache, past, p)
        r.cache_len += p
        r.pending = []

    def _feed(self, feed: dict) -> None:
        """One forward: each row's pending tokens (first round of its step) and its new tree nodes."""
        rows, base, w = self.drafters, self.base, self.width
        sizes = {i: len(rows[i].pending) + len(new) for i, (_, new) in feed.items()}
        ids, pos, visible = self.block(sizes)
        windowed = base.windows.smallest is not None  # then every key's position, for the windows:
        kv_pos = torch.arange(visible.shape[-1]).repeat(len(rows), 1) if windowed else None  # [B, W+T] prefix col j: j
        for i, (tree, new) in feed.items():
            r = rows[i]
            p, f, past = len(r.pending), len(new), r.cache_len
            index = torch.tensor(new)  # [F]
            ids[i, :p] = torch.tensor(r.pending, dtype=torch.long)
            ids[i, p : p + f] = tree.tokens[index]
            pos[i, :p] = torch.arange(past, past + p)
            pos[i, p : p + f] = r.root_pos + tree.depths[index]
            visible[i, : p + f, :past] = True  # the committed prefix
            visible[i, :p, w : w + p] = torch.ones(p, p, dtype=torch.bool).tril()  # pending: causal
            visible[i, p : p + f, w : w + p] = True  # tree nodes: every pending token
            items = torch.tensor(r.row_nodes + new, dtype=torch.long)  # [R + F] tree items, old then new
            cols = torch.tensor(r.cols + list(range(w + p, w + p + f)), dtype=torch.long)  # [R + F]
            visible[i, p : p + f, cols] = tree.ancestors[index][:, items]  # its ancestors (itself included)
            if kv_pos is not None:
                kv_pos[i, r.cols] = r.root_pos + tree.depths[items[: len(r.row_nodes)]]  # earlier rounds' items
        if kv_pos is not None:
            kv_pos[:, w:] = pos  # this block's keys
        out = base.forward(
            input_ids=ids.to(base.device),
            position_ids=pos.to(base.device),
            attention_mask=self.float_mask(visible, base.dtype, base.device, base.windows, pos, kv_pos),
            **{base.cache_keyword: self.cache},
            use_cache=True,
        )
        moved = [(i, len(rows[i].pending)) for i in feed if rows[i].pending]
        if moved:  # the pending tokens are committed: into place after each row's prefix
            move_cache_rows(
                self.cache,
                torch.repeat_interleave(torch.tensor([i for i, _ in moved]), torch.tensor([p for _, p in moved])),
                torch.cat([torch.arange(w, w + p) for _, p in moved]),
                torch.cat([torch.arange(rows[i].cache_len, rows[i].cache_len + p) for i, p in moved]),
            )
        for i, (tree, new) in feed.items():
            r = rows[i]
            p, f = len(r.pending), len(new)
            # q = softmax(logits / T), as ModelDrafter._feed
            probs = torch.softmax(out.logits[i, p : p + f, : r.vocab].float() / r.config.temperature, dim=-1)  # [F, V]
            r.probs = probs if r.probs is None else torch.cat([r.probs, probs])
            r.cache_len += p  # = root_pos: the prefix now holds the pending tokens
            r.pending = []
            index = torch.tensor(new)
            for j, (node, parent, token) in enumerate(
                zip(new, tree.parents[index].tolist(), tree.tokens[index].tolist())
            ):
                row = r.root_pos + len(r.row_nodes)
                r.row_of[node] = row
                r.row_nodes.append(node)
                r.cols.append(w + p + j)
                if parent >= 0:
                    r.child_row[(r.row_of[parent], token)] = row

    def keep_path(self, i: int, rows: list[int]) -> None:
        """Row i's commit: its tree items at virtual rows ``rows`` (root first) go to root_pos, root_pos + 1, …"""
        r = self.drafters[i]
        src = torch.tensor([r.cols[v - r.root_pos] for v in rows], dtype=torch.long)
        move_cache_rows(
            self.cache,
            torch.full((len(rows),), i, dtype=torch.long),
            src,
            torch.arange(r.root_pos, r.root_pos + len(rows)),
        )
