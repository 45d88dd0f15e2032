"""Greedy acceptance for every row of a batch at once (``verify.greedy_verify``, vectorised over rows).

One batched target forward returns logits [B, N_max, V] for the rows' trees, each padded to N_max
nodes. Per row, the rule is ``greedy_verify``'s: node i is right when its token is the target's argmax
after its parent; the accepted path is the deepest node whose whole root path is right; the bonus is
the target's argmax after it. Done row by row, that is a handful of small tensor ops per row, a cost
that grows with B; here it is the same ops once over [B, N_max] (padding nodes are
never right), and only the per-row results are split out.
"""

from __future__ import annotations

import torch

from treespec.tree import TreeTensors
from treespec.verify import Acceptance


def greedy_rows(trees: list[TreeTensors], logits: torch.Tensor) -> list[Acceptance]:
    """``greedy_verify(trees[b], logits[b, :N_b])`` for every row b; logits: [B, N_max, V]."""
    b, n = len(trees), int(logits.shape[1])
    dev = logits.device
    best_next = logits.argmax(dim=-1)  # [B, N] the target's token after each node
    tokens = torch.full((b, n), -1, dtype=torch.long)  # [B, N] padding: no token
    parents = torch.zeros(b, n, dtype=torch.long)  # [B, N]
    depths = torch.full((b, n), -1, dtype=torch.long)  # [B, N] padding: never the deepest
    anc = torch.zeros(b, n, n, dtype=torch.bool)  # [B, N, N]
    for r, tt in enumerate(trees):
        m = int(tt.input_ids.shape[0])
        tokens[r, :m], parents[r, :m], depths[r, :m] = tt.input_ids, tt.parents.clamp(min=0), tt.depths
        anc[r, :m, :m] = tt.ancestors
    tokens, parents, depths, anc = tokens.to(dev), parents.to(dev), depths.to(dev), anc.to(dev)
    ok = tokens == best_next.gather(1, parents)  # [B, N] node i is what the target says after its parent
    ok[:, 0] = True  # the root is committed
    path_ok = ~(anc & ~ok[:, None, :]).any(dim=-1)  # [B, N] every node on the path is right
    best = torch.where(path_ok, depths, -1).argmax(dim=-1)  # [B] the deepest fully right node (one per depth)
    rows = torch.arange(b, device=dev)
    bonus = best_next[rows, best].tolist()  # [B]
    paths = anc[rows, best].cpu()  # [B, N] the accepted path of each row
    out = []
    for r, tt in enumerate(trees):
        nodes = paths[r].nonzero().flatten()  # ids ascend along a path: root ... best
        out.append(Acceptance(nodes=nodes, tokens=tt.input_ids[nodes[1:]].tolist(), bonus=int(bonus[r])))
    return out
