"""Drafter `eagle`: an EAGLE-1/EAGLE-2 head drafting from the target's own features.

The head's sequence (see ``eagle_head.py``) has one item per committed token pair: item j =
(f_j, x_{j+1}) at position j, where f_j is the target's feature at x_j. With C committed tokens
(the last one is the tree's root) the head's KV cache holds the C−1 *stable* items 0..C−2, all built
from the target's true features; the output of item C−2 (the root's item) is f̂_root, whose
distribution proposes the root's children.

A tree node n below the root is fed as the item (f̂_parent(n), token(n)) at position C−2 + depth(n),
attending to the stable items and its own ancestors' items: the head's own predicted feature stands
in for the target's, which is unknown until the target verifies the tree. Items are fed one tree
level per forward (a child needs its parent's output), only for nodes a builder asks to expand.

``begin_step`` drops the tree items of an earlier tree of the step; ``commit`` drops every tree item
and queues the accepted tokens and the bonus with the target's TRUE features of the old root and the
accepted nodes (``Commit.hidden``); the next step's first ``expand`` feeds the queue in one forward
(``_flush``), so the stable part never holds a prediction — exactly what a fresh prefill of the
committed sequence would hold — and a step that drafts nothing (a plain step) costs the head nothing.
A level of one node whose ancestors are all the tree items so far (a chain) is fed without a mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from treespec import weight_blocks
from treespec.catalog import SHIPPED_HEADS
from treespec.errors import ConfigError
from treespec.inference import inference
from treespec.interfaces import Commit, PrefillContext, Proposals
from treespec.kv import causal_mask, crop_cache, tree_mask
from treespec.plugins.configs import EagleConfig
from treespec.plugins.eagle_head import load_head, shipped_drafter
from treespec.plugins.head_drafter import HeadDrafter
from treespec.row_matmul import linear
from treespec.slack_cache import slack_cache
from treespec.target import TargetModel
from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.plugins.eagle_rows import EagleRows


class EagleDrafter(HeadDrafter):
    Config = EagleConfig
    config: EagleConfig
    drafter = "eagle"

    def __init__(self, config: EagleConfig, target: TargetModel):
        super().__init__(config, target)
        head = config.head or shipped_drafter(target, SHIPPED_HEADS, "eagle", "head", "treespec train eagle")
        self.meta = self.load(target, head, load_head)
        if config.attn_implementation:
            self.head.config._attn_implementation = config.attn_implementation
        # the head's forward: treespec.lean unless switched off (same math, less per-call overhead)
        self.forward = self.head.lean() if config.lean else self.head
        self.embed = target.model.get_input_embeddings()  # shared with the target: no copy
        self.lm_head = target.model.get_output_embeddings()
        # their weights, read directly (cheaper than a module call), unless a device map offloaded them:
        # then the modules' own hooks load them
        offloaded = any(m.weight.device.type == "meta" for m in (self.embed, self.lm_head))
        self.embed_ids = self.embed if offloaded else (lambda ids: F.embedding(ids, self.embed.weight))
        self._head = self.lm_head if offloaded else (lambda x: linear(x, self.lm_head.weight, self.lm_head.bias))
        # [N] target ids of a reduced draft vocabulary, or None
        self.ids = self._draft_ids(config, head, self.vocab, self.meta)
        if self.ids is not None:
            self.ids = self.ids.to(self.device)
            bias = self.lm_head.bias[self.ids].detach() if getattr(self.lm_head, "bias", None) is not None else None
            weight = (
                self.lm_head.weight[self.ids].detach() if not offloaded else None
            )  # [N, H]: N/V of the output layer
            full = self._head
            self._head = (lambda x: full(x)[..., self.ids]) if offloaded else (lambda x: linear(x, weight, bias))
            source = weight_blocks.find(self.lm_head.weight)  # the target's output layer read from a GGUF's blocks
            if weight is not None and source is not None:
                weight_blocks.attach(weight, source.rows(self.ids))  # so are its draft rows (checked exact)
        # greedy acceptance calibration (eagle_train.fit_temperature): q = softmax(logits / T)
        self.temperature = float(config.temperature or self.meta.get("calibration_temperature") or 1.0)
        self._new_sequence()

    def cost_options(self) -> dict[str, Any]:
        """The options, and the draft vocabulary's size when the head has one (its default cut comes from
        the head's config.json, not from an option, and halves the output layer's cost)."""
        extra = {"vocab": int(self.ids.numel())} if self.ids is not None else {}
        return {**super().cost_options(), **extra}

    @staticmethod
    def _draft_ids(config: EagleConfig, head: str, vocab: int, meta: dict) -> torch.Tensor | None:
        """The head's draft vocabulary (``draft_vocab.py``), cut to ``config.vocab``, else to the cut its
        metadata names (``"vocab"`` in config.json's ``treespec`` section: the size measured fastest for
        it), else whole; None: all V tokens."""
        from treespec.plugins import draft_vocab
        from treespec.plugins.eagle_head import read_config

        ids = draft_vocab.load(read_config(head)[1], vocab, head)
        want = config.vocab
        if want is None:  # the cut the head names (vocab= overrides it, broken or not)
            named = meta.get("vocab")
            if named is not None and (isinstance(named, bool) or not isinstance(named, int) or named < 0):
                raise ConfigError(
                    f"EAGLE head {head!r}: its config.json's treespec.vocab is {named!r}, not a token count; "
                    "fix it, or give the drafter vocab=N"
                )
            want = named if ids is not None else None
        if want is None or ids is None and want >= vocab:
            return ids
        if want == 0 or want >= vocab:
            return None
        if ids is None:
            raise ConfigError(
                f"drafter 'eagle': vocab={want} needs a head trained with --draft-vocab "
                f"(its folder holds {draft_vocab.FILE}); drop vocab= to draft over all {vocab} tokens"
            )
        return ids[:want]

    def _new_sequence(self) -> None:
        """Per-sequence state (``prefill``; the per-step part: ``clear_tree``)."""
        self.cache = slack_cache()
        self.stable = 0  # committed items in the cache: item j at row j, position j
        self.root_feature: torch.Tensor | None = None  # [H] f̂ at the root (None: one-token prompt)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # committed items not fed yet: (features, tokens)
        self.clear_tree()

    # ------------------------------------------------------------------ lifecycle
    @inference
    def prefill(self, context: PrefillContext) -> None:
        self._new_sequence()
        ids = context.input_ids
        if ids.shape[0] > 1:
            self.pending.append((self.target_hidden(context), ids[1:]))

    def rows(self, n: int) -> EagleRows:
        """``n`` rows whose frontiers are expanded in one head forward per level (``eagle_rows.py``)."""
        from treespec.plugins.eagle_rows import EagleRows

        return EagleRows(self, n)

    def begin_step(self, root_token: int) -> None:
        if self.row_nodes:  # items of an earlier tree of this step
            self.drop_tree_rows()
        self.clear_tree()

    def drop_tree_rows(self) -> None:
        """Crop the head's cache back to the committed items (a batch row's live in its group's cache)."""
        crop_cache(self.cache, self.stable)

    def clear_tree(self) -> None:
        # predicted features f̂ of the step's fed nodes: row 0 = the root's, then one row per tree item
        self.feats = self.root_feature[None] if self.root_feature is not None else None  # [1 + R, H]
        self.node_row: list[int] = [
            0 if self.root_feature is not None else -1
        ]  # tree node -> row of feats (-1: not fed)
        self.row_nodes: list[int] = []  # tree node of each tree item, in cache order after the stable rows

    @inference
    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        k = min(k, self.vocab)
        m = int(nodes.shape[0])
        if m == 0 or (self.feats is None and not self.pending):  # a one-token prompt: no feature before the root yet
            return Proposals(torch.zeros(m, k, dtype=torch.long), torch.zeros(m, k))
        wanted = nodes.tolist()
        if self.pending:  # the step's first expand: feed what was committed since the last one
            self._flush()
        self._feed_missing(tree, wanted)
        rows = self.feats[torch.tensor([self.node_row[n] for n in wanted])]  # [M, H]
        q, tokens = self.top(rows, k)  # [M, k]
        return Proposals(tokens=tokens.cpu(), q=q.cpu())

    def top(self, feats: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely next tokens (target ids) after each of ``feats`` [M, H] and their q: [M, k] each."""
        if self.ids is None:
            return self._q(feats).topk(k, dim=-1)
        n = int(self.ids.numel())
        q, index = self._q_draft(feats).topk(min(k, n), dim=-1)  # over the draft vocabulary
        tokens = self.ids[index]
        if k > n:  # asked for more than the draft vocabulary holds: the rest with q = 0, as a full softmax gives
            rest = min(k, self.vocab) - n
            outside = torch.ones(self.vocab, dtype=torch.bool, device=self.ids.device)
            outside[self.ids] = False
            pad = outside.nonzero().flatten()[:rest].expand(q.shape[0], rest)  # [M, rest]
            tokens, q = torch.cat([tokens, pad], 1), torch.cat([q, q.new_zeros(q.shape[0], rest)], 1)
        return q, tokens

    def _feed_missing(self, tree: DraftTree, wanted: list[int]) -> None:
        """Feed the requested nodes that have no feature yet, and their unfed ancestors, one tree level
        per forward (a child needs f̂ of its parent)."""
        for level in self.missing_levels(tree, wanted):
            self._feed_tree(tree, level)

    def missing_levels(self, tree: DraftTree, wanted: list[int]) -> list[list[int]]:
        """The nodes to feed before ``wanted`` have features: the unfed ones and their unfed
        ancestors, one list per tree level, shallowest first."""
        rows = self.node_row
        rows += [-1] * (len(tree) - len(rows))
        missing = [n for n in wanted if rows[n] < 0]
        if not missing:
            return []
        parents = tree.parents[missing].tolist()
        if all(rows[p] >= 0 for p in parents):  # the usual case: one level whose parents are fed
            return [sorted(missing)]
        need = tree.ancestors[torch.tensor(missing)].any(dim=0)  # [N] nodes on the requested paths
        need[torch.tensor([n for n, r in enumerate(rows) if r >= 0])] = False
        new = need.nonzero().flatten()  # [F] ascending: parents first
        depths = tree.depths[new]
        return [new[depths == depth].tolist() for depth in depths.unique().tolist()]

    @inference
    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """The head's own softmax [M, V] after each of ``nodes`` (fed by this step's ``expand`` calls),
        at temperature 1: what the head predicts the target says next, the proposal sampled children
        are drawn from (at the draft temperature). Not the calibration temperature of ``_q``: that one
        is fitted so that q ranks nodes by their greedy acceptance (the default pair's head: T = 0.15,
        nearly a point mass), and drawing from it would propose the top-1 token almost every time.
        Zeros where there is no feature (a one-token prompt's first step)."""
        out = torch.zeros(int(nodes.shape[0]), self.vocab, device=self.device)
        rows = self.node_row
        have = [i for i, n in enumerate(nodes.tolist()) if n < len(rows) and rows[n] >= 0]
        if have:
            index = torch.tensor([rows[int(nodes[i])] for i in have])
            out[have] = self._q(self.feats[index], temperature=1.0)  # [M', V]
        return out

    def _q(self, feats: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """The draft distribution [M, V] from predicted features [M, H], at the calibration temperature
        (or ``temperature``)."""
        if self.ids is not None:
            out = torch.zeros(
                feats.shape[0], self.vocab, device=feats.device
            )  # [M, V]: zero outside the draft vocabulary
            out[:, self.ids] = self._q_draft(feats, temperature)
            return out
        logits = self._head(feats)[:, : self.vocab]  # [M, V]
        return torch.softmax(logits.float() / (temperature or self.temperature), dim=-1)

    def _q_draft(self, feats: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """The draft distribution over the draft vocabulary [M, N] (``self.ids``)."""
        return torch.softmax(self._head(feats).float() / (temperature or self.temperature), dim=-1)

    @inference
    def commit(self, commit: Commit) -> None:
        hidden = self.target_hidden(commit)
        if self.row_nodes:
            self.drop_tree_rows()  # drop every tree item: they were built on predictions
        tokens = torch.tensor(commit.tokens, dtype=torch.long)  # [m+1] accepted + bonus
        self.pending.append((hidden, tokens))  # items (f(root), a1), (f(a1), a2), ..., (f(am), bonus)
        self.root_feature = None
        self.clear_tree()

    # ------------------------------------------------------------------ forwards
    def _flush(self) -> None:
        """Feed the pending committed items in one forward (lazily: a step that drafts nothing, e.g. a
        plain step of `opt-tree nodes=auto`, costs the head nothing), then start the tree from f̂_root."""
        features = torch.cat([f for f, _ in self.pending])  # [n, H]
        tokens = torch.cat([t for _, t in self.pending])  # [n]
        self.pending = []
        self._feed_committed(features, tokens)
        self.clear_tree()

    def _feed_committed(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append stable items (features[i], next_tokens[i]) at positions stable, stable+1, ..."""
        n, dev, dtype = int(next_tokens.shape[0]), self.device, self.dtype
        out = self.forward(
            features.to(dev, dtype)[None],  # [1, n, H]
            self.embed_ids(next_tokens.to(dev))[None],  # [1, n, H]
            torch.arange(self.stable, self.stable + n, device=dev)[None],  # [1, n]
            causal_mask(self.stable, n, dtype)[None, None].to(dev),  # [1, 1, n, stable + n]
            self.cache,
        )[0]  # [n, H]
        self.stable += n
        self.root_feature = out[-1]

    def _feed_tree(self, tree: DraftTree, level: list[int]) -> None:
        """Feed one tree level: items (f̂_parent, token) at position stable − 1 + depth."""
        dev, dtype = self.device, self.dtype
        index = torch.tensor(level)  # [F]
        parents = tree.parents[index].tolist()
        feats = self.feats[torch.tensor([self.node_row[p] for p in parents])]  # [F, H]
        depths = tree.depths[index]  # [F]
        if len(level) == 1 and len(self.row_nodes) == int(depths[0]) - 1:
            mask = None  # a chain: the tree items fed so far are exactly this node's ancestors
        else:
            rows = torch.tensor(self.row_nodes + level, dtype=torch.long)  # [R + F]
            mask = tree_mask(self.stable, tree.ancestors[index][:, rows], dtype)[None, None].to(dev)  # [1, 1, F, S+R+F]
        out = self.forward(
            feats[None],  # [1, F, H]
            self.embed_ids(tree.tokens[index].to(dev))[None],  # [1, F, H]
            (self.stable - 1 + depths).to(dev)[None],  # [1, F]
            mask,
            self.cache,
        )[0]  # [F, H]
        first = self.feats.shape[0]
        self.feats = torch.cat([self.feats, out])
        for i, node in enumerate(level):
            self.node_row[node] = first + i
        self.row_nodes += level
