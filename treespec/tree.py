"""DraftTree: the tree of drafted tokens of one decoding step.

Node 0 is the root, the last committed token. Every other node carries its token, its parent, its
depth, the draft probability ``q`` of its token given its parent's path, and the path probability
``p̂ = Π q`` along the root-to-node path (the root has p̂ = 1). Nodes are appended in batches and
parents always come before their children, so node ids increase along every path.

The arrays are the source of truth. They are host-side metadata of a few dozen to a few thousand
entries, kept in numpy buffers that grow by doubling, and read as torch tensors that share their
memory (``tree.tokens`` etc. cost no copy): growing a tree by one layer is a handful of numpy
operations, not dozens of torch dispatches, which on a CPU cost more than a small draft's forward.
The target moves what it needs to its device (``TargetModel.forward_tree``). The networkx view
(``graph``) is built on demand for validation, rendering and property tests. The step itself
(``tensors``) never walks the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx
import numpy as np
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

    def __init__(self, root_token: int, capacity: int = 16):
        self._n = 1
        self._tokens = np.zeros(capacity, dtype=np.int64)  # [C] buffers; entries [0, n) are the nodes
        self._parents = np.zeros(capacity, dtype=np.int64)
        self._depths = np.zeros(capacity, dtype=np.int64)
        self._q = np.zeros(capacity, dtype=np.float32)
        self._phat = np.zeros(capacity, dtype=np.float32)
        self._anc = np.zeros((capacity, capacity), dtype=np.bool_)  # [C, C] ancestors[i, j]
        self._tokens[0], self._parents[0], self._q[0], self._phat[0], self._anc[0, 0] = (
            int(root_token),
            -1,
            1.0,
            1.0,
            True,
        )
        self._depth = 0

    # ------------------------------------------------------------------ the arrays, as tensors
    tokens = property(
        lambda self: torch.from_numpy(self._tokens[: self._n]), lambda self, v: self._set("_tokens", v)
    )  # [N]
    parents = property(
        lambda self: torch.from_numpy(self._parents[: self._n]), lambda self, v: self._set("_parents", v)
    )  # [N]
    depths = property(
        lambda self: torch.from_numpy(self._depths[: self._n]), lambda self, v: self._set("_depths", v)
    )  # [N]
    q = property(lambda self: torch.from_numpy(self._q[: self._n]), lambda self, v: self._set("_q", v))  # [N]
    phat = property(lambda self: torch.from_numpy(self._phat[: self._n]), lambda self, v: self._set("_phat", v))  # [N]

    def _set(self, name: str, value: torch.Tensor) -> None:
        """Replace one array by hand (tests build malformed trees this way); the ancestors and the depth
        are then recomputed from ``parents`` and ``depths`` when read."""
        arr = value.detach().cpu().numpy().astype(getattr(self, name).dtype).reshape(-1)
        self._n = arr.shape[0]
        setattr(self, name, arr.copy())
        self._anc = None

    def _grow(self, need: int) -> None:
        """Make room for ``need`` nodes (capacity doubles)."""
        cap = self._tokens.shape[0]
        if need <= cap and self._anc is not None:
            return
        cap = max(need, 2 * cap)
        for name in ("_tokens", "_parents", "_depths", "_q", "_phat"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: self._n] = old[: self._n]
            setattr(self, name, new)
        anc = np.zeros((cap, cap), dtype=np.bool_)
        anc[: self._n, : self._n] = self._ancestors_np()
        self._anc = anc

    # ------------------------------------------------------------------ growing
    def add_children(self, parents: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Append one child per entry (``parents``/``tokens``/``q`` all [M]); returns the new ids [M].

        p̂(child) = p̂(parent) · q (in float32). With q ≤ 1 the product never exceeds p̂(parent), so a
        selection of the top nodes by p̂ (ties broken by depth) is closed under parents.
        """
        new = self.append(_host(parents, np.int64), _host(tokens, np.int64), _host(q, np.float32))
        return torch.from_numpy(new)

    def append(self, par: np.ndarray, tok: np.ndarray, qs: np.ndarray) -> np.ndarray:
        """``add_children`` on flat numpy arrays (int64, int64, float32): for planners that work in
        numpy; returns the new ids [M] as a numpy array."""
        if not par.shape == tok.shape == qs.shape:
            raise ValueError("add_children: parents, tokens and q must have the same length")
        start, m = self._n, par.shape[0]
        ids = par.tolist()  # a few entries: Python's min/max beat numpy's reductions here
        if m and (min(ids) < 0 or max(ids) >= start):
            raise ValueError("add_children: a parent id does not exist yet")
        depth = self.depth
        self._grow(start + m)
        end = start + m
        self._tokens[start:end] = tok
        self._parents[start:end] = par
        depths = self._depths[par] + 1  # [M]
        self._depths[start:end] = depths
        self._q[start:end] = qs
        self._phat[start:end] = self._phat[par] * qs
        # a new node's ancestors are its parent's plus itself: one gather, no walk up the tree
        self._anc[start:end, :start] = self._anc[par, :start]
        np.fill_diagonal(self._anc[start:end, start:end], True)
        self._n = end
        if m:
            self._depth = max(depth, max(depths.tolist()))
        if self.draw_row is not None:
            self.draw_row = torch.cat([self.draw_row, self.draw_row.new_full((m,), -1)])
        return np.arange(start, end)

    def record_draws(self, nodes: torch.Tensor, dist: torch.Tensor) -> None:
        """Mark ``nodes`` ([M]) as nodes whose children are drawn at random, without replacement, from
        ``dist`` ([M, V'], the draft distribution actually sampled from). Their children must then be
        added in draw order, as a prefix of the draws, and they get no other children: the sampling
        verifier's SpecInfer rule rebuilds each child's draw probability from this (docs/sampling.md)."""
        nodes = nodes.to("cpu", torch.long).reshape(-1)
        if self.draw_row is None:
            self.draw_row = torch.full((len(self),), -1, dtype=torch.long)
        start = 0 if self.draw_dist is None else int(self.draw_dist.shape[0])
        dist = dist.reshape(nodes.numel(), -1)
        self.draw_dist = dist if self.draw_dist is None else torch.cat([self.draw_dist, dist.to(self.draw_dist)])
        self.draw_row[nodes] = torch.arange(start, start + nodes.numel(), device=nodes.device)

    def select(self, keep: torch.Tensor) -> DraftTree:
        """The subtree made of the node ids in ``keep`` (which must hold the root and be closed under
        parents), re-indexed in the original order."""
        idx = np.sort(_host(keep, np.int64))  # ascending
        if idx.size > 1 and (idx[1:] == idx[:-1]).any():
            idx = np.unique(idx)
        if idx.size == 0 or idx[0] != 0:
            raise ValueError("select: the root (node 0) must be kept")
        remap = np.full(self._n, -1, dtype=np.int64)
        remap[idx] = np.arange(idx.size)
        old_parents = self._parents[idx]
        new_parents = np.where(old_parents >= 0, remap[np.maximum(old_parents, 0)], old_parents)
        if (new_parents[1:] < 0).any():
            raise ValueError("select: a kept node's parent was not kept")
        out = DraftTree.__new__(DraftTree)
        out._n = int(idx.size)
        out._tokens, out._parents, out._depths = self._tokens[idx], new_parents, self._depths[idx]
        out._q, out._phat = self._q[idx], self._phat[idx]
        out._anc = self._ancestors_np()[np.ix_(idx, idx)]  # ancestry is preserved by a parent-closed selection
        out._depth = int(out._depths.max())
        if self.draw_row is not None:  # the caller keeps a prefix of each sampled node's draws
            out.draw_row, out.draw_dist = self.draw_row[torch.from_numpy(idx)], self.draw_dist
        return out

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self._n

    @property
    def size(self) -> int:
        """Drafted nodes (the root excluded)."""
        return self._n - 1

    @property
    def depth(self) -> int:
        if self._anc is None:  # arrays set by hand (tests)
            return int(self._depths[: self._n].max())
        return self._depth

    def expected_accepted(self) -> float:
        """E(A) = Σ p̂ over the drafted nodes: the expected number of accepted draft tokens if the
        draft's probabilities were the target's acceptance probabilities (OPT-Tree, eq. 3)."""
        if self._n == 1:  # the root alone (a plain step)
            return 0.0
        return float(self._phat[1 : self._n].sum(dtype=np.float64))

    @property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool, ``ancestors[i, j]``: j is i or an ancestor of i.

        Kept up to date by ``add_children`` (a child's row is its parent's row plus itself) and
        ``select``; recomputed from ``parents`` only for arrays set by hand.
        """
        return torch.from_numpy(self._ancestors_np())

    def _ancestors_np(self) -> np.ndarray:
        n = self._n
        if self._anc is None:  # arrays set by hand: pointer chasing, cur <- parent(cur) for every node at once
            anc = np.zeros((n, n), dtype=np.bool_)
            idx = np.arange(n)
            anc[idx, idx] = True
            up, cur = np.maximum(self._parents[:n], 0), idx
            for _ in range(int(self._depths[:n].max())):
                cur = up[cur]
                anc[idx, cur] = True
            self._anc = anc
        return self._anc[:n, :n]

    def path(self, node: int) -> list[int]:
        """Node ids from the root to ``node``, both included."""
        return self.ancestors[node].nonzero().flatten().tolist()

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root to ``node``, both included."""
        return self.tokens[self.ancestors[node]].tolist()

    def suffixes(self, nodes: list[int], limit: int | None = None) -> list[list[int]]:
        """Each node's path below the root (root excluded, the node included), root side first, cut to
        its last ``limit`` tokens: the context a retrieval drafter looks up. A walk up the parents on
        Python lists: for the few nodes of an ``expand`` call it beats the ancestor matrix."""
        toks, parents = self.tokens.tolist(), self.parents.tolist()
        out = []
        for node in nodes:
            ext: list[int] = []  # leaf to root
            while node > 0 and (limit is None or len(ext) < limit):
                ext.append(toks[node])
                node = parents[node]
            out.append(ext[::-1])
        return out

    def tensors(self, past_len: int, dtype: torch.dtype = torch.float32) -> TreeTensors:
        """Inputs for one target forward over all nodes, on top of a cache of ``past_len`` tokens."""
        from treespec.kv import tree_mask

        if self._n == 1:  # the root alone (a plain step) sees every cached row and itself
            return TreeTensors(
                input_ids=self.tokens,
                position_ids=torch.tensor([past_len]),
                attention_mask=torch.zeros(1, 1, 1, past_len + 1, dtype=dtype),
                parents=self.parents,
                depths=self.depths,
                ancestors=torch.ones(1, 1, dtype=torch.bool),
            )
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


def _host(values: torch.Tensor | np.ndarray | list[int] | list[float], dtype: type) -> np.ndarray:
    """A flat host (numpy) copy or view of ``values`` with ``dtype``."""
    if isinstance(values, torch.Tensor):
        values = values.detach()
        if values.device.type != "cpu":
            values = values.cpu()
        values = values.numpy()
    return np.asarray(values, dtype=dtype).reshape(-1)
