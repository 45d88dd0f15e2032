"""Builder `eagle2`: EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees", arXiv 2406.16858).

Per step, with k = ``top_k``, D = min(``depth``, the Decoder's max_depth) and n = ``total_tokens``:

    layer 1      = the root's k best children                                     (expand call 1)
    frontier     = the k nodes of the newest layer with the highest p̂
    layer d + 1  = ALL k × k children of the frontier, p̂ = p̂(parent)·q             (expand call d + 1)
    repeat until the tree has D layers (D expand calls in all)
    final tree   = the root + the n nodes with the highest p̂ among EVERY node drafted

This is what the reference code does (``SafeAILab/EAGLE``, ``eagle/model/cnets.py`` and
``cnets1.py``, ``Model.topK_genrate``): every ``cu_scores`` block of top_k × top_k candidates is
appended to ``scores_list`` and stays in the pool of the final ``torch.topk(scores_list,
total_tokens)`` ("reranking"), but only the ``topk_cs`` (the top_k of that block) are fed to the next
draft forward ("expansion"). So the candidates that are not expanded still become tree nodes here,
and any of them may be kept by the reranking; the frontier is always chosen inside the newest layer
only, never among older nodes.

How the options map onto the reference's:

* ``depth`` here is the number of layers, i.e. of ``drafter.expand`` calls, the root's included.
  The reference's ``depth`` counts the expansion loop only; its first draft forward (over the
  context, which yields the root's top_k) comes before the loop, so its trees have depth + 1 layers.
  Reference ``depth=5`` (its evaluation scripts' default) = ``depth=6`` here (our default).
* ``total_tokens`` here counts drafted nodes, the root excluded. The reference's ``total_token``
  counts the root too (``Model.__init__`` stores ``total_tokens - 1``): reference 60 = 59 here.
* ``top_k`` is the same: children per expanded node and nodes expanded per layer.

Differences from the reference, none of which changes a tree except on exact ties:

1. p̂ is a product of probabilities (``DraftTree`` keeps it), the reference sums log-probabilities;
   the order is the same up to rounding.
2. Ties are broken deterministically: the frontier by p̂, then node id (= the frontier order of the
   parent, then the child's rank); the final selection by ``top_n_by_phat`` (p̂, then shallower,
   then older). The reference uses ``torch.topk``, whose order among equal scores is unspecified,
   and finds each kept node's parent with ``searchsorted`` assuming it was kept too (the check is
   commented out), which an exact tie between a node and its child (q = 1) can break. Here a parent
   always sorts before its child, so the selection is a tree.
3. Padding (q = 0, a drafter with fewer than k children to offer) is skipped instead of being ranked
   at log 0 = −inf; if fewer than n nodes were drafted, all of them are kept (the reference would
   fail in ``topk``).
4. The Decoder's max_depth caps the number of layers (near ``max_new_tokens`` or the context end).

``calibrate=true`` ranks the frontier and the final selection by calibrated p̂ (the product of
``treespec.acceptance_map``'s f(q, depth) along the path, learnt from every verified tree) instead
of the draft's raw p̂; off by default, so that the builder is the published algorithm.

``sample=true`` (sampling with temperature > 0): every expanded node's k children are its first k
draws without replacement from the draft (``sampled_expand``, in draw order), and the frontier and
the final selection rank the j-th child of u by its slot value

    ŝ = ŝ(u) · q_u↓j      (q_u↓j: the j-th largest probability of the distribution drawn from)

instead of its own p̂ — the value rank j would have, known before the draw. So which draws are kept
never depends on what was drawn (keeping a draw for its own probability biases the verifier,
docs/sampling.md), ŝ never increases along a node's draws (the selection keeps a prefix of each
node's draws) and ŝ(child) ≤ ŝ(parent) (it is still a tree). Depth and k are as above; greedy
decoding ranks as always.
"""

from __future__ import annotations

import torch

from treespec.acceptance_map import AcceptanceMap
from treespec.interfaces import Drafter, TreeBuilder
from treespec.plugins.configs import Eagle2Config
from treespec.plugins.drafted import top_by
from treespec.plugins.opt_tree import expand_slots
from treespec.tree import DraftTree


class Eagle2Builder(TreeBuilder):
    Config = Eagle2Config
    config: Eagle2Config

    def __init__(self, config: Eagle2Config):
        super().__init__(config)
        self.calibration = AcceptanceMap() if config.calibrate else None

    @property
    def max_nodes(self) -> int:
        return self.config.total_tokens

    @property
    def max_drafted(self) -> int:
        """Every layer's candidates stay in the pool: k children of the root, then k × k per layer."""
        k = self.config.top_k
        return k + (self.config.depth - 1) * k * k

    def verified(self, tree: DraftTree, path: torch.Tensor) -> None:
        if self.calibration is not None:
            self.calibration.learn(tree, path)

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        k, n, calib, sampling = self.config.top_k, self.config.total_tokens, self.calibration, self.sampling
        tree = DraftTree(root_token)
        # [N] what the builder ranks by: p̂, or calibrated p̂ (calibrate=true); sampled: the slot values ŝ
        scores = tree.phat
        frontier = torch.zeros(1, dtype=torch.long)  # [M] node ids to expand: the root, then ≤ k per layer
        for depth in range(1, min(self.config.depth, max_depth) + 1):
            slots = expand_slots(drafter, tree, frontier, k, sampling)  # tokens, q, value: [M, k]
            q = slots.value.to(tree.phat)  # [M, k] (ranked: the children's q)
            cols = slots.cols
            real = (q > 0).flatten().nonzero().flatten()  # [C] candidates in (frontier, rank) order, padding skipped
            if real.numel() == 0:
                break
            parents = frontier[real // cols]
            child_q = slots.q.to(q)  # [M, k] what the tree stores: each child's q (ranked: q itself)
            # [C] every candidate becomes a node (the reranking pool)
            layer = tree.add_children(parents, slots.tokens.flatten()[real], child_q.flatten()[real])
            if calib is None and sampling is None:
                scores = tree.phat
            else:
                f = q.flatten()[real] if calib is None else calib(q.flatten()[real], torch.full((real.numel(),), depth))
                scores = torch.cat([scores, scores[parents] * f.to(scores)])  # [N]
            order = torch.argsort(scores[layer], descending=True, stable=True)  # ties: older first
            frontier = layer[order[:k]]  # the next expansion: the k best of this layer
        return tree.select(top_by(scores, tree.depths, n))
