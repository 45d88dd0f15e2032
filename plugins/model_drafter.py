"""Drafter `model`: an independent Hugging Face causal LM that shares the target's tokenizer.

It keeps its own KV cache across steps. Cache layout during a step:

    rows [0, cache_len)           committed tokens already fed (the draft's prefix)
    rows [cache_len, root_pos)    pending: committed tokens not fed yet (fed in the step's first forward)
    rows [root_pos, ...)          tree nodes, in the order they were fed

``begin_step`` drops the tree rows of an earlier tree (if any) and puts the new root at root_pos.
Each ``expand`` feeds the requested nodes and any of their ancestors not fed yet in ONE forward with a
tree mask; positions are root_pos + depth. ``commit`` keeps the rows of the accepted nodes it had fed
and queues the rest of the accepted tokens (and the bonus) as pending.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from treespec.errors import ConfigError
from treespec.inference import inference
from treespec.interfaces import Commit, Drafter, DraftRows, PrefillContext, Proposals
from treespec.kv import (
    attention_windows,
    cache_keyword,
    causal_mask,
    code_refusal,
    crop_cache,
    keep_rows,
    max_positions,
    tree_mask,
    tree_refusal,
)
from treespec.lean import LeanCausalLM, lean_reason
from treespec.models import check_same_tokenizer, load_causal_lm, load_tokenizer
from treespec.plugins.configs import ModelDrafterConfig
from treespec.slack_cache import slack_cache
from treespec.target import TargetModel
from treespec.tree import DraftTree


class ModelDrafter(Drafter):
    Config = ModelDrafterConfig
    config: ModelDrafterConfig

    def __init__(self, config: ModelDrafterConfig, target: TargetModel, loaded: torch.nn.Module | None = None):
        """``loaded``: a draft model the user already loaded (``Decoder(drafter=model)``), used as it is."""
        super().__init__(config, target)
        self.model = (self.load_model() if loaded is None else self.adopt(loaded)).eval()
        self._check_embeddings()
        self.vocab = min(target.vocab_size, self.model.get_output_embeddings().weight.shape[0])
        self.max_positions = max_positions(self.model.config)
        reason = tree_refusal(self.model.config) or code_refusal(self.model)
        if reason is not None:
            raise ConfigError(f"draft model {self.name!r} cannot draft trees: {reason}; use a transformer draft")
        self.windows = attention_windows(self.model.config)  # sliding windows, applied in our own masks
        # the draft's forward: treespec.lean where the architecture allows (same math, less overhead)
        self.forward = LeanCausalLM(self.model) if config.lean and lean_reason(self.model) is None else self.model
        self.cache_keyword = cache_keyword(self.forward)
        first = next(self.model.parameters())
        self.device, self.dtype = first.device, first.dtype  # read once: not on every forward
        # per sequence (prefill) and per step (begin_step); see the module docstring for the layout
        self.cache: DynamicCache | None = None
        self.cache_len = 0  # rows in the cache
        self.pending: list[int] = []  # committed tokens not fed yet
        self.root_token = -1  # the next tree's root (the last committed token)
        self._ready()

    def _check_embeddings(self) -> None:
        """Every token the target can commit must have a row in the draft's input embeddings."""
        rows = self.model.get_input_embeddings().weight.shape[0]
        needed = len(self.target.tokenizer) if self.target.tokenizer is not None else self.target.vocab_size
        if rows < needed:
            raise ConfigError(
                f"draft model {self.name!r} embeds {rows} tokens but the target's tokenizer has {needed}: "
                "use a draft model trained with the target's vocabulary"
            )

    @property
    def name(self) -> str:
        """The draft model in messages (a self-draft has no ``model`` option: it is the target's)."""
        return str(getattr(self.config, "model", None) or self.target.name)

    def adopt(self, model: torch.nn.Module) -> torch.nn.Module:
        """A loaded draft model, as it is: on the target's device and in its dtype (treespec moves no
        one's model), whole (``layers`` cuts a model treespec loads)."""
        first = next(model.parameters())
        if (first.device, first.dtype) != (self.target.device, self.target.dtype):
            raise ConfigError(
                f"the draft model is on {first.device} in {first.dtype} but the target on {self.target.device} in "
                f"{self.target.dtype}: move it first (draft.to(device, dtype))"
            )
        if getattr(self.config, "layers", None) is not None:
            raise ConfigError("layers=k cuts a draft model treespec loads; the draft was passed loaded: drop layers")
        return model

    def load_model(self) -> torch.nn.Module:
        """The draft model: ``config.model`` with the target's tokenizer, device and dtype."""
        config, target = self.config, self.target
        if target.tokenizer is not None:
            check_same_tokenizer(
                target.tokenizer,
                load_tokenizer(config.model, config.trust_remote_code, "draft model's tokenizer"),
                target.name,
                config.model,
            )
        return load_causal_lm(
            config.model,
            device=target.device,
            dtype=target.dtype,
            num_hidden_layers=config.layers,
            attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
            what="draft model",
        )

    # ------------------------------------------------------------------ lifecycle
    def keep_path(self, keep: list[int]) -> None:
        """Keep the cache rows ``keep`` (the root's and the accepted nodes', ascending) of this step's
        tree rows, moved to root_pos, root_pos + 1, … (a batch row's live in its group's cache)."""
        keep_rows(self.cache, self.root_pos, keep)

    def prefill(self, context: PrefillContext) -> None:
        self.cache = slack_cache()  # full layers: committed row i holds position i
        self.cache_len = 0
        self.pending = context.input_ids[:-1].tolist()
        self.root_token = int(context.input_ids[-1])
        self._ready()

    def rows(self, n: int) -> DraftRows:
        """``n`` rows whose new nodes are fed in one draft forward per round (``model_rows.py``)."""
        from treespec.plugins.model_rows import ModelRows

        return ModelRows(self, n)

    def begin_step(self, root_token: int) -> None:
        if self.row_nodes:  # tree rows of an earlier tree of this step: drop them
            self.drop_tree_rows()
        self._ready()

    def drop_tree_rows(self) -> None:
        """Crop the draft cache back to the committed tokens (a batch row's live in its group's cache)."""
        crop_cache(self.cache, self.root_pos)
        self.cache_len = self.root_pos

    def _ready(self) -> None:
        """No tree rows; the next tree's root goes after the cache and the pending tokens."""
        self.root_pos = self.cache_len + len(self.pending)
        self.row_of: dict[int, int] = {}  # tree node id -> cache row
        self.row_nodes: list[int] = []  # tree node id of each tree row, in row order
        self.child_row: dict[tuple[int, int], int] = {}  # (parent row, token) -> row
        self.probs: torch.Tensor | None = None  # [R, V] draft distribution after each tree row

    @inference
    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        k = min(k, self.vocab)
        wanted = nodes.tolist()
        if not wanted or (self.max_positions and self.root_pos + int(tree.depths[nodes].max()) >= self.max_positions):
            # the draft's context is full: propose nothing (the target still makes progress)
            return Proposals(torch.zeros(len(wanted), k, dtype=torch.long), torch.zeros(len(wanted), k))
        new = self.unfed(tree, wanted)
        if new:
            self._feed(tree, new)
        rows = torch.tensor([self.row_of[n] - self.root_pos for n in wanted])  # [M]
        q, tokens = self.probs[rows].topk(k, dim=-1)  # [M, k]
        return Proposals(tokens=tokens.cpu(), q=q.float().cpu())

    def unfed(self, tree: DraftTree, wanted: list[int]) -> list[int]:
        """The requested nodes and their ancestors that have no row yet, ascending (parents first)."""
        row_of = self.row_of
        missing = [n for n in wanted if n not in row_of]
        if not missing:
            return []
        parents = tree.parents[torch.tensor(missing)].tolist()
        if all(p < 0 or p in row_of for p in parents):  # the usual case: their parents are fed
            return sorted(missing)
        need = tree.ancestors[torch.tensor(missing)].any(dim=0)  # [N] nodes on the requested paths
        if row_of:
            need[torch.tensor(list(row_of))] = False
        return need.nonzero().flatten().tolist()

    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """The draft's softmax [M, V'] after each of ``nodes`` (fed by an earlier ``expand`` of this
        step); zeros for nodes it could not feed (the draft's context is full)."""
        out = torch.zeros(nodes.shape[0], self.vocab, device=self.device)
        if self.probs is None:
            return out
        rows = [self.row_of.get(int(n), -1) for n in nodes]
        fed = torch.tensor([r >= 0 for r in rows], dtype=torch.bool)
        if bool(fed.any()):
            idx = torch.tensor([r - self.root_pos for r in rows if r >= 0], device=self.probs.device)
            out[fed.to(out.device)] = self.probs[idx].to(out)
        return out

    def _feed(self, tree: DraftTree, new: list[int]) -> None:
        """One forward over the pending tokens (first call of a step only) and the tree nodes ``new``."""
        index = torch.tensor(new)  # [F]
        p, f = len(self.pending), len(new)
        past = self.cache_len  # rows already in the cache (root_pos = past + p)
        depths = tree.depths[index]  # [F]
        pos = self.root_pos + depths  # [F]
        ids = tree.tokens[index]  # [F]
        if p:
            ids = torch.cat([torch.tensor(self.pending, dtype=torch.long), ids])  # [P+F]
            pos = torch.cat([torch.arange(past, past + p), pos])  # [P+F]
        if f == 1 and len(self.row_nodes) == int(depths[0]) and self.windows.smallest is None:
            # the root, or a node whose ancestors are all the tree rows so far (a chain): what it sees is
            # causal, every cached row and pending token in order
            mask = causal_mask(past, p + 1, self.dtype)[None, None] if p else None
        else:
            row_nodes = torch.tensor(self.row_nodes + new, dtype=torch.long)  # [R_old + F]
            mask = torch.cat(
                [
                    causal_mask(past, p, self.dtype, extra=f),  # pending rows (only before any tree row): causal
                    tree_mask(
                        self.root_pos, tree.ancestors[index][:, row_nodes], self.dtype
                    ),  # tree rows: prefix + ancestors
                ]
            )  # [P+F, root_pos + R_old + F]
            mask = mask[None, None].to(self.device)  # [1, 1, P+F, cols]
            if self.windows.smallest is not None:  # a tensor, or a dict of masks per layer type
                kv_pos = torch.cat([torch.arange(self.root_pos), self.root_pos + tree.depths[row_nodes]])  # [cols]
                mask = self.windows.apply(mask, pos, kv_pos)
        out = self.forward(
            input_ids=ids[None].to(self.device),
            position_ids=pos[None].to(self.device),
            attention_mask=mask,
            **{self.cache_keyword: self.cache},
            use_cache=True,
        )
        # q = softmax(logits / T): T calibrates q to greedy acceptance (treespec.train.calibration), 1 = raw
        probs = torch.softmax(out.logits[0, p:, : self.vocab].float() / self.config.temperature, dim=-1)  # [F, V]
        self.probs = probs if self.probs is None else torch.cat([self.probs, probs])
        self.pending = []
        for node, parent, token in zip(new, tree.parents[index].tolist(), tree.tokens[index].tolist()):
            row = self.root_pos + len(self.row_nodes)
            self.row_of[node] = row
            self.row_nodes.append(node)
            if parent >= 0:
                self.child_row[(self.row_of[parent], token)] = row
        self.cache_len = self.root_pos + len(self.row_nodes)

    @inference
    def commit(self, commit: Commit) -> None:
        root, self.root_token = self.root_token, commit.tokens[-1]
        if not self.row_nodes:  # nothing was fed this step: the root joins the pending tokens
            self.pending += [root] + commit.tokens[:-1]
            self._ready()
            return
        keep = [self.root_pos]  # cache rows of the root and the accepted nodes fed this step
        for token in commit.tokens[:-1]:
            row = self.child_row.get((keep[-1], token))
            if row is None:
                break
            keep.append(row)
        m = len(keep)
        self.keep_path(keep)
        self.cache_len = self.root_pos + m
        self.pending = commit.tokens[m - 1 : -1]  # accepted tokens not fed; the bonus is the next root
        self._ready()
