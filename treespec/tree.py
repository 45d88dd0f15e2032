"""DraftTree: the tree of drafted tokens of one decoding step.

Node 0 is the root, the last committed token. Every other node carries its token, its parent, its
depth, the draft probability ``q`` of its token given its parent's path, and the path probability
``p̂ = Π q`` along the root-to-node path (the root has p̂ = 1). Nodes are appended in batches and
parents always come before their children, so node ids increase along every path.

The arrays are the source of truth and stay tensors on the device they were created on; the
networkx view (``graph``) is built on demand for validation, rendering and property tests. The step
itself (``tensors``) never walks the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import torch


@dataclass(frozen=True)
class TreeTensors:
    """What the target needs for one tree forward. N = number of nodes, root included."""

    input_ids: torch.Tensor  # [N] long
    position_ids: torch.Tensor  # [N] long, past_len + depth
    attention_mask: torch.Tensor  # [1, 1, N, past_len + N] float: 0 = attend, finfo.min = blocked
    parents: torch.Tensor  # [N] long, -1 for the root
    depths: torch.Tensor  # [N] long
    ancestors: torch.Tensor  # [N, N] bool: ancestors[i, j] = j is i or an ancestor of i
    draw_row: torch.Tensor | None = None  # [N] long: row of draw_dist node i's children were drawn from, -1: ranked
    draw_dist: torch.Tensor | None = None  # [R, V'] the draft distributions children were sampled from


class DraftTree:
    """An append-only tree of drafted tokens (see the module docstring)."""

    # Set only by builders that draw children at random (``record_draws``, docs/sampling.md).
    draw_row: torch.Tensor | None = None  # [N] long: row of draw_dist, -1 = children ranked (deterministic)
    draw_dist: torch.Tensor | None = None  # [R, V'] the distributions children were drawn from

    def __init__(self, root_token: int, device: torch.device | str | None = None):
        device = torch.device(device or "cpu")
        self.tokens = torch.tensor([int(root_token)], dtype=torch.long, device=device)  # [N]
        self.parents = torch.tensor([-1], dtype=torch.long, device=device)  # [N]
        self.depths = torch.tensor([0], dtype=torch.long, device=device)  # [N]
        self.q = torch.ones(1, dtype=torch.float32, device=device)  # [N]
        self.phat = torch.ones(1, dtype=torch.float32, device=device)  # [N]

    # ------------------------------------------------------------------ growing
    def add_children(self, parents: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Append one child per entry (``parents``/``tokens``/``q`` all [M]); returns the new ids [M].

        p̂(child) = p̂(parent) · q. With q ≤ 1 the float product never exceeds p̂(parent), so a
        selection of the top nodes by p̂ (ties broken by depth) is closed under parents.
        """
        parents = parents.to(self.tokens.device, torch.long).reshape(-1)
        tokens, q = tokens.reshape(-1), q.reshape(-1)
        if not parents.shape == tokens.shape == q.shape:
            raise ValueError("add_children: parents, tokens and q must have the same length")
        if parents.numel() and (int(parents.min()) < 0 or int(parents.max()) >= len(self)):
            raise ValueError("add_children: a parent id does not exist yet")
        start = len(self)
        q = q.to(self.q.device, torch.float32)
        self.tokens = torch.cat([self.tokens, tokens.to(self.tokens.device, torch.long)])
        self.parents = torch.cat([self.parents, parents])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.phat = torch.cat([self.phat, self.phat[parents] * q])
        self.q = torch.cat([self.q, q])
        if self.draw_row is not None:
            self.draw_row = torch.cat([self.draw_row, self.draw_row.new_full((parents.numel(),), -1)])
        self.__dict__.pop("ancestors", None)
        return torch.arange(start, len(self), device=self.tokens.device)

    def record_draws(self, nodes: torch.Tensor, dist: torch.Tensor) -> None:
        """Mark ``nodes`` ([M]) as nodes whose children are drawn at random, without replacement, from
        ``dist`` ([M, V'], the draft distribution actually sampled from). Their children must then be
        added in draw order, as a prefix of the draws, and they get no other children: the sampling
        verifier's SpecInfer rule rebuilds each child's draw probability from this (docs/sampling.md)."""
        nodes = nodes.to(self.tokens.device, torch.long).reshape(-1)
        if self.draw_row is None:
            self.draw_row = torch.full((len(self),), -1, dtype=torch.long, device=self.tokens.device)
        start = 0 if self.draw_dist is None else int(self.draw_dist.shape[0])
        dist = dist.reshape(nodes.numel(), -1)
        self.draw_dist = dist if self.draw_dist is None else torch.cat([self.draw_dist, dist.to(self.draw_dist)])
        self.draw_row[nodes] = torch.arange(start, start + nodes.numel(), device=nodes.device)

    def select(self, keep: torch.Tensor) -> "DraftTree":
        """The subtree made of the node ids in ``keep`` (which must hold the root and be closed under
        parents), re-indexed in the original order."""
        keep = torch.unique(keep.to(self.tokens.device, torch.long))  # sorted ascending
        if keep.numel() == 0 or int(keep[0]) != 0:
            raise ValueError("select: the root (node 0) must be kept")
        remap = torch.full((len(self),), -1, dtype=torch.long, device=keep.device)
        remap[keep] = torch.arange(keep.numel(), device=keep.device)
        old_parents = self.parents[keep]
        new_parents = torch.where(old_parents >= 0, remap[old_parents.clamp(min=0)], old_parents)
        if bool((new_parents[1:] < 0).any()):
            raise ValueError("select: a kept node's parent was not kept")
        out = DraftTree.__new__(DraftTree)
        out.tokens, out.parents, out.depths = self.tokens[keep], new_parents, self.depths[keep]
        out.q, out.phat = self.q[keep], self.phat[keep]
        if self.draw_row is not None:  # the caller keeps a prefix of each sampled node's draws
            out.draw_row, out.draw_dist = self.draw_row[keep], self.draw_dist
        return out

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def size(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self) - 1

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def expected_accepted(self) -> float:
        """E(A) = Σ p̂ over the drafted nodes: the expected number of accepted draft tokens if the
        draft's probabilities were the target's acceptance probabilities (OPT-Tree, eq. 3)."""
        return float(self.phat[1:].sum())

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool, ``ancestors[i, j]``: j is i or an ancestor of i.

        Pointer chasing in ``depth`` vectorised steps: cur ← parent(cur) for every node at once.
        Cached until the tree grows.
        """
        n = len(self)
        idx = torch.arange(n, device=self.tokens.device)  # [N]
        anc = torch.zeros(n, n, dtype=torch.bool, device=idx.device)  # [N, N]
        anc[idx, idx] = True
        up = self.parents.clamp(min=0)  # [N], the root points at itself
        cur = idx
        for _ in range(self.depth):
            cur = up[cur]
            anc[idx, cur] = True
        return anc

    def path(self, node: int) -> list[int]:
        """Node ids from the root to ``node``, both included."""
        return self.ancestors[node].nonzero().flatten().tolist()

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root to ``node``, both included."""
        return self.tokens[self.ancestors[node]].tolist()

    def tensors(self, past_len: int, dtype: torch.dtype = torch.float32) -> TreeTensors:
        """Inputs for one target forward over all nodes, on top of a cache of ``past_len`` tokens."""
        from treespec.kv import tree_mask

        anc = self.ancestors  # [N, N]
        mask = tree_mask(past_len, anc, dtype)  # [N, P+N]: the whole committed prefix, then own ancestors
        return TreeTensors(
            input_ids=self.tokens,
            position_ids=past_len + self.depths,
            attention_mask=mask[None, None],  # [1, 1, N, P+N]
            parents=self.parents,
            depths=self.depths,
            ancestors=anc,
            draw_row=self.draw_row,
            draw_dist=self.draw_dist,
        )

    # ------------------------------------------------------------------ graph view
    @property
    def graph(self) -> nx.DiGraph:
        """A networkx view: node attributes token, depth, q, phat; edges parent → child."""
        g = nx.DiGraph()
        toks, pars, deps = self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()
        qs, ps = self.q.tolist(), self.phat.tolist()
        for i in range(len(self)):
            g.add_node(i, token=toks[i], depth=deps[i], q=qs[i], phat=ps[i])
            if pars[i] >= 0:
                g.add_edge(pars[i], i)
        return g

    def validate(self) -> None:
        """Raise ValueError unless this is a well-formed draft tree."""
        g = self.graph
        pars = self.parents.tolist()
        if pars[0] != -1:
            raise ValueError("the root must have no parent")
        if int(self.depths[0]) != 0 or float(self.phat[0]) != 1.0:
            raise ValueError("the root must have depth 0 and p̂ = 1")
        if len(self) > 1 and not nx.is_arborescence(g):
            raise ValueError("the nodes do not form a tree rooted at node 0")
        for i in range(1, len(self)):
            p = pars[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} does not come before it")
            if g.nodes[i]["depth"] != g.nodes[p]["depth"] + 1:
                raise ValueError(f"node {i}: depth is not its parent's depth + 1")
            if not math.isclose(g.nodes[i]["phat"], g.nodes[p]["phat"] * g.nodes[i]["q"], rel_tol=1e-5, abs_tol=1e-30):
                raise ValueError(f"node {i}: p̂ is not p̂(parent)·q")
            if not 0.0 <= g.nodes[i]["q"] <= 1.0:
                raise ValueError(f"node {i}: q = {g.nodes[i]['q']} is not a probability")

    def __repr__(self) -> str:
        return f"DraftTree(nodes={len(self)}, depth={self.depth}, E(A)={self.expected_accepted():.3f})"
