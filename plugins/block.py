"""Drafter `block`: every depth of the tree from ONE forward of a block drafter (``block_head.py``).

Per step the network reads the committed context (the target's fused features, cached as keys and
values) and the block [root, m×K], and returns marginals Q_d for the next K positions at once:
Q_d(x) ≈ P(x_{a+d} = x | committed tokens), d = 1..K, each blind to the tokens drafted before it.

``expand(tree, nodes, k)`` answers a node at depth d with the top-k tokens of Q_{d+1} and their
probabilities (calibrated: ``softmax(logits / T_{d+1})``, fitted per depth by `treespec train
block`); every node at depth d is offered the same candidates, and nodes at depth ≥ K get none
(q = 0), so builders stop there by themselves. A builder's p̂ (the product of q along a path) is
then Π_d Q_d(x_d): DDTree's surrogate for the path's probability, which ignores that a rank-2
branch makes deeper guesses less likely (docs/drafters.md). The first ``expand`` of a step runs the
forward; later ones index the marginals, so a tree costs one forward whatever its shape, and a step
that drafts nothing (a plain step of ``nodes=auto``) costs nothing.

Sampling: ``distribution`` is Q_{d+1} at temperature 1, fixed by the committed context before any
child is drawn, so children drawn from it are verified exactly by the rules that take q = the
distribution drawn from (docs/sampling.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.catalog import SHIPPED_BLOCKS
from treespec.errors import ConfigError
from treespec.inference import inference
from treespec.interfaces import Commit, PrefillContext, Proposals
from treespec.plugins.block_head import load_block_head
from treespec.plugins.configs import BlockConfig
from treespec.plugins.eagle_head import shipped_drafter
from treespec.plugins.head_drafter import HeadDrafter
from treespec.target import TargetModel
from treespec.tree import DraftTree


class BlockDrafter(HeadDrafter):
    Config = BlockConfig
    config: BlockConfig
    drafter = "block"

    def __init__(self, config: BlockConfig, target: TargetModel):
        super().__init__(config, target)
        name = config.head or shipped_drafter(target, SHIPPED_BLOCKS, "block", "block drafter", "treespec train block")
        self.meta = self.load(target, name, load_block_head)
        self.target_hidden_layers = tuple(self.head.spec.target_layers)  # type: ignore[misc]  # per instance
        self.K = self.head.spec.block_size
        self.fused = self.head.fused()  # the decoding forward's concatenated weights (block_head.Fused)
        self.ids = self.head.draft_ids  # [Vd] target ids
        inside = torch.zeros(self.vocab, dtype=torch.bool)
        inside[self.ids.cpu()] = True
        # [V] distinct target ids: the draft vocabulary's, then the others. A row keeps them with q = 0
        # where the marginals propose nothing (depth ≥ K; columns past the draft vocabulary), so the
        # marginals' top-kd, written over the first kd columns, never repeat a column after them.
        self.padding = torch.cat([self.ids.cpu(), (~inside).nonzero().flatten()])
        embed, out = target.model.get_input_embeddings(), target.model.get_output_embeddings()
        if embed.weight.device.type == "meta" or out.weight.device.type == "meta":
            raise ConfigError("drafter 'block' needs the target's embedding and output layer in memory (not offloaded)")
        self.embed_weight = embed.weight  # [V, H] shared, no copy
        self.out_weight = out.weight[self.ids].detach()  # [Vd, H]
        bias = getattr(out, "bias", None)
        self.out_bias = bias[self.ids].detach() if bias is not None else None
        temps = config.temperature or self.meta.get("calibration_temperatures") or [1.0]
        temps = [float(t) for t in (temps if isinstance(temps, list) else [temps])]
        self.temperatures = torch.tensor((temps + temps[-1:] * self.K)[: self.K], device=self.device)  # [K]
        self._new_sequence()

    def _new_sequence(self) -> None:
        self.ctx = [
            (torch.zeros(1, self.head.shape[1], 0, self.head.shape[2], device=self.device, dtype=self.dtype),) * 2
            for _ in self.head.layers
        ]  # per layer: context keys, values [1, Hkv, S, D]
        self.stable = 0  # context rows cached: x_0..x_{stable-1}; the root sits at position `stable`
        self.pending: list[torch.Tensor] = []  # committed features not projected yet
        self.root: int | None = None
        self.last: torch.Tensor | None = None  # [1, H] c of the newest context row (None: no context yet)
        self._drop_block()

    def _drop_block(self) -> None:
        self.logits: torch.Tensor | None = None  # [K, Vd] this step's block output
        self.q_raw: torch.Tensor | None = None  # [K, Vd] its softmax at temperature 1, made when asked (draws)
        self.q_cal: torch.Tensor | None = None  # [K, Vd] calibrated marginals (what trees are shaped by)
        self.top: tuple[torch.Tensor, torch.Tensor] | None = None  # their top-k per depth (``_top``)

    # ------------------------------------------------------------------ lifecycle
    @inference
    def prefill(self, context: PrefillContext) -> None:
        self._new_sequence()
        ids = context.input_ids
        if ids.shape[0] > 1:
            self.pending.append(self.target_hidden(context))
        self.root = int(ids[-1])

    def begin_step(self, root_token: int) -> None:
        if root_token != self.root:  # never after prefill/commit, which set the root; kept for safety
            self.root = root_token
            self._drop_block()

    @inference
    def commit(self, commit: Commit) -> None:
        self.pending.append(self.target_hidden(commit))  # the old root and the accepted nodes: [m+1, k·H]
        self.root = int(commit.tokens[-1])
        self._drop_block()

    # ------------------------------------------------------------------ drafting
    @inference
    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        m, k = int(nodes.shape[0]), min(k, self.vocab)
        kd = min(k, int(self.ids.numel()))  # from the marginals; the rest: tokens outside the draft vocabulary, q = 0
        if m == 0 or k == 0:
            return Proposals(self.padding[:k].expand(m, k).clone(), torch.zeros(m, k))
        top_tokens, top_q = self._top(kd)  # [K, kd] each: every depth's candidates, best first
        depths = tree.depths[nodes]  # [M]
        if kd == k and int(depths.max()) < self.K:  # every node answered in full (a chain's, a frontier)
            return Proposals(top_tokens[depths], top_q[depths])  # [M, k] gathered copies, nothing to pad
        tokens, q = self.padding[:k].expand(m, k).clone(), torch.zeros(m, k)
        rows = (depths < self.K).nonzero().flatten()  # nodes at depth ≥ K get nothing (q = 0)
        d = depths[rows]  # [M'] depths of the nodes answered
        tokens[rows, :kd], q[rows, :kd] = top_tokens[d], top_q[d]
        return Proposals(tokens, q)

    def _top(self, kd: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's top-kd target ids and calibrated probabilities for every depth ([K, kd] each, on the
        CPU), from one top-k over the marginals; kept for the step (a tree asks once per depth)."""
        if self.top is None or self.top[0].shape[1] < kd:
            q, index = self._marginals().topk(kd)  # [K, kd] best first, distinct
            self.top = (self.ids[index].cpu(), q.float().cpu())
        tokens, q = self.top
        return tokens[:, :kd], q[:, :kd]

    @inference
    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """Q_{d+1} at temperature 1 over target ids [M, V] for nodes at depth d (zeros for d ≥ K)."""
        self._marginals()
        out = torch.zeros(int(nodes.shape[0]), self.vocab, device=self.device)
        depths = tree.depths[nodes].to(self.device)  # [M]
        inside = depths < self.K
        if inside.any():
            if self.q_raw is None:
                self.q_raw = torch.softmax(self.logits, -1)
            out[inside.nonzero().flatten()[:, None], self.ids[None]] = self.q_raw[depths[inside]]
        return out

    def _marginals(self) -> torch.Tensor:
        """The step's calibrated marginals [K, Vd], running the block forward on the first call."""
        if self.q_cal is None:
            self._project_pending()
            root = F.embedding(torch.tensor([self.root], device=self.device), self.embed_weight)  # [1, H]
            x = self.head.block_input(root, self.last)[0]  # [K+1, H]
            positions = torch.arange(self.stable, self.stable + self.K + 1, device=self.device)  # [K+1]
            out = self.head.forward_one(x, positions, self.ctx, self.fused)  # [K+1, H]
            self.logits = self.head.logits(out[1:], self.out_weight, self.out_bias).float()  # [K, Vd]
            self.q_cal = torch.softmax(self.logits / self.temperatures[:, None], -1)
        return self.q_cal

    def _project_pending(self) -> None:
        """Append the committed features not yet in the context cache (one projection for all)."""
        if not self.pending:
            return
        feats = torch.cat(self.pending).to(self.device, self.dtype)  # [n, k·H]
        self.pending = []
        n = feats.shape[0]
        positions = torch.arange(self.stable, self.stable + n, device=self.device)[None]  # [1, n]
        c = self.head.fuse(feats[None])  # [1, n, H]
        new = self.head.context_one(c, positions, self.fused)
        self.last = c[:, -1]  # [1, H] the newest context row
        self.ctx = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.ctx, new)]
        self.stable += n
