"""Verifiers: which path of the tree the target accepts, and its bonus token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from treespec.block_verify import block_verify, is_chain
from treespec.sampling import RULES, drawn_from, recorded_draft, sample_rows, uniform
from treespec.traversal_verify import traversal_verify
from treespec.tree import TreeTensors

if TYPE_CHECKING:
    from treespec.sampling import SamplingParams


@dataclass(frozen=True)
class Acceptance:
    nodes: torch.Tensor  # [m+1] long: the root and the m accepted nodes, in path order
    tokens: list[int]  # the m accepted draft tokens
    bonus: int  # the target's own token after the accepted path

    @property
    def accepted(self) -> int:
        return len(self.tokens)


def greedy_verify(tt: TreeTensors, logits: torch.Tensor) -> Acceptance:
    """The longest root-to-node path whose every token equals the target's argmax at its parent,
    plus the target's argmax after that path: ``greedy_rows`` for a batch of one.

    logits: [N, V], row i = the target's logits after node i's path.
    """
    if logits.shape[0] == 1:  # the root alone (a plain step): the target's own next token
        return Acceptance(nodes=torch.zeros(1, dtype=torch.long), tokens=[], bonus=int(logits[0].argmax()))
    return greedy_rows([tt], logits[None])[0]


def greedy_rows(trees: list[TreeTensors], logits: torch.Tensor) -> list[Acceptance]:
    """Greedy acceptance for every row of a batch in one pass. logits: [B, N_max, V], row b's first
    N_b positions belong to its tree (padding after them is never accepted).

    Node i is right when its token is the target's argmax after its parent; the accepted path ends at
    the deepest node whose whole root path is right (the first such node when duplicate siblings tie);
    the bonus is the target's argmax after it. One set of tensor ops over [B, N_max], not B sets.
    """
    b, n = len(trees), int(logits.shape[1])
    dev = logits.device
    best_next = logits.argmax(dim=-1)  # [B, N] the target's token after each node
    if b == 1 and int(trees[0].input_ids.shape[0]) == n:  # one row, no padding: its own tensors
        tt = trees[0]
        tokens, parents = tt.input_ids[None].to(dev), tt.parents.clamp(min=0)[None].to(dev)  # [1, N]
        depths, anc = tt.depths[None].to(dev), tt.ancestors[None].to(dev)  # [1, N], [1, N, N]
    else:
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
    best = torch.where(path_ok, depths, -1).argmax(dim=-1)  # [B] the deepest fully right node
    rows = torch.arange(b, device=dev)
    bonus = best_next[rows, best].tolist()  # [B]
    paths = anc[rows, best].cpu()  # [B, N] the accepted path of each row
    out = []
    for r, tt in enumerate(trees):
        nodes = paths[r].nonzero().flatten()  # ids ascend along a path: root ... best
        out.append(Acceptance(nodes=nodes, tokens=tt.input_ids[nodes[1:]].tolist(), bonus=int(bonus[r])))
    return out


# ---------------------------------------------------------------------------------------- sampling
def sampling_verify(
    tt: TreeTensors,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    rule: str = "auto",
) -> Acceptance:
    """Lossless speculative *sampling* over the tree: the accepted tokens and the bonus token are
    distributed exactly as sampling from the target with ``params`` (docs/sampling.md).

    logits: [N, V], row i = the target's logits after node i's path. ``rule``: ``"auto"`` (the best exact
    rule for the tree: ``block`` on a chain, ``traversal`` on a tree with sampled children, else the
    token-level rule, which is the deterministic rule for ranked children), ``"specinfer"`` (the
    token-level rule: SpecInfer's where the tree records sampled children, deterministic for ranked
    ones), ``"deterministic"`` (every child as a deterministic proposal, q = 1), ``"target-only"``
    (sample the target at each node and follow the matching child), ``"block"`` (a chain verified
    jointly, ``treespec.block_verify``) or ``"traversal"`` (any tree verified leaf to root,
    ``treespec.traversal_verify``).
    """
    n, dev = logits.shape[0], logits.device
    # The processors (top-p sorts the vocabulary) run only on the rows the walk reads: nodes with
    # children; a leaf's row only if the walk ends there (it then gives the bonus token).
    need = torch.zeros(n, dtype=torch.bool, device=dev)
    need[tt.parents.to(dev)[1:]] = True
    need[0] = True
    if tt.draw_row is not None:
        need |= tt.draw_row.to(dev) >= 0
    if bool(need.all()):
        probs = params.probs(logits)  # [N, V] float32, the distribution generate(do_sample=True) uses
    else:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=dev)
        probs[need] = params.probs(logits[need])

    def fill(best: torch.Tensor) -> torch.Tensor:
        b = int(best[0])
        if not bool(need[b]):
            probs[b] = params.probs(logits[b])
        return probs[None]

    draw = tt.draw_dist[None] if tt.draw_dist is not None else None
    best, bonus = verify_batch(tt, tt.input_ids.to(dev)[None], probs[None], generator, rule, draw, fill)
    b = int(best[0])
    nodes = tt.ancestors[b].nonzero().flatten()  # ids ascend along a path: root ... best
    return Acceptance(nodes=nodes, tokens=tt.input_ids[nodes[1:]].tolist(), bonus=int(bonus[0]))


def verify_batch(
    tt: TreeTensors,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    generator: torch.Generator,
    rule: str = "auto",
    draw_dist: torch.Tensor | None = None,
    fill: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B independent verifications of trees of ONE shape (``tt``: parents, depths, ancestors, and which
    nodes had their children drawn, ``tt.draw_row``), each with its own tokens, target distributions
    and draft distributions. The Decoder calls it with B = 1; the exactness tests with B in the tens of
    thousands.

    tokens: [B, N] long (column 0: the root); probs: [B, N, V], row i = the target's processed
    distribution after node i's path; draw_dist: [B, R, V'] or None. Rows of leaves (nodes without
    children or recorded draws) are read only at the last accepted node: with ``fill``, they may be
    missing from ``probs`` and ``fill(best)`` returns ``probs`` with the rows at ``best`` present.
    Returns the deepest accepted node [B] (0: none accepted) and the bonus token [B].

    Children of a node are tried in node-id order (for sampled children: their draw order), and the
    first child that passes its test is accepted: a node accepts at most one child, so the accepted
    nodes form one root path.
    """
    if rule not in RULES:
        raise ValueError(f"unknown verification rule {rule!r}; rules: {', '.join(RULES)}")
    if rule == "traversal":  # any tree, leaf to root (Weng et al.)
        return traversal_verify(tt, tokens, probs, generator, draw_dist, fill)
    if rule in ("auto", "block") and probs.shape[1] > 1 and is_chain(tt):
        return block_verify(tt, tokens, probs, generator, draw_dist, fill)  # a chain: verified jointly
    if rule == "auto" and tt.draw_row is not None and bool((tt.draw_row[tt.parents[1:]] >= 0).any()):
        # sampled children: leaf to root accepts at least what SpecInfer's token-level rule does (on ranked
        # children the two are equal in expectation, and the token-level rule is cheaper)
        return traversal_verify(tt, tokens, probs, generator, draw_dist, fill)
    if rule == "target-only":
        return _target_only(tt, tokens, probs, generator, fill)
    # "block" on a tree with branches: token by token, as "auto" (treespec.block_verify is for chains)
    return _token_level(tt, tokens, probs, generator, rule == "specinfer", draw_dist, fill)


def _token_level(
    tt: TreeTensors,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    generator: torch.Generator,
    specinfer: bool,
    draw_dist: torch.Tensor | None,
    fill: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, root to leaf: each child passes with its ranked rate (SpecInfer's rate for sampled
    children under ``specinfer``); the bonus is drawn from the deepest accepted node's residual."""
    dev = probs.device
    B, N, V = probs.shape
    parents = tt.parents.to(dev)
    par = parents.clamp(min=0)  # [N] the root points at itself
    # (auto reaches here with sampled nodes only as leaves: SpecInfer's residual there is p, the same)
    sampled = specinfer and tt.draw_row is not None and bool((tt.draw_row >= 0).any())
    rows = torch.arange(B, device=dev)
    a = _ranked_rates(parents, tokens, probs)  # [B, N] acceptance probability of each child
    if sampled:
        rates, residual, sampled_nodes = _specinfer_rates(tt, tokens, probs, draw_dist)
        a = torch.where((tt.draw_row.to(dev)[par] >= 0)[None, :], rates, a)
    best = _deepest_accepted(tt, uniform((B, N), generator, dev) < a)
    probs = fill(best) if fill is not None else probs
    res = _bonus_rows(parents, tokens, probs, best)  # [B, V] p at the best node, children removed
    if sampled:
        pos = torch.full((N,), -1, dtype=torch.long, device=dev)
        pos[sampled_nodes] = torch.arange(sampled_nodes.numel(), device=dev)
        at = pos[best]  # [B] row of the best node among the sampled parents, -1 if ranked
        hit = at >= 0
        res = torch.where(hit[:, None], residual[rows, at.clamp(min=0)].to(res), res)
    empty = res.sum(dim=-1) <= 0  # rounding only: the children held all the mass, yet none passed
    res = torch.where(empty[:, None], probs[rows, best], res)
    return best, sample_rows(res, generator)


def _target_only(
    tt: TreeTensors,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    generator: torch.Generator,
    fill: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_batch`` with rule ``target-only``: the target samples its own token after every node,
    and a child is accepted when it is its parent's sample (exact for any tree: the draft's q is never
    read). Returns the deepest accepted node [B] and the bonus token [B]."""
    dev = probs.device
    B, N, _ = probs.shape
    parents = tt.parents.to(dev)
    par, rows = parents.clamp(min=0), torch.arange(B, device=dev)  # [N] the root points at itself
    if B > 1 and probs.stride(0) == 0:  # one distribution for every trial (tests: a fixed tree)
        t = sample_rows(probs[0], generator, n=B).T  # [B, N]
    else:
        t = sample_rows(probs, generator)  # [B, N] the target's own token after each node
    best = _deepest_accepted(tt, t[:, par] == tokens)  # child i matches its parent's sample
    probs = fill(best) if fill is not None else probs
    # at a node with children, its sample matched none of them: it is the bonus token; at a leaf,
    # a sample of the leaf's distribution drawn now is the same thing
    inner = torch.zeros(N, dtype=torch.bool, device=dev)
    inner[parents[1:]] = True
    return best, torch.where(inner[best], t[rows, best], sample_rows(probs[rows, best], generator))


def _deepest_accepted(tt: TreeTensors, passed: torch.Tensor) -> torch.Tensor:
    """[B] the deepest node of the single accepted path, given which children passed their test
    (``passed`` [B, N]): each node accepts only its FIRST passing child (lowest id), and a node is
    accepted when it and all its ancestors are."""
    B, N = passed.shape
    dev = passed.device
    par = tt.parents.to(dev).clamp(min=0)  # [N]
    ids = torch.arange(N, device=dev)
    # the first passing child of every node: scatter-min of the passing children's ids over parents
    cand = torch.where(passed, ids[None, :], N)  # [B, N]
    cand[:, 0] = N  # the root is nobody's child
    first = torch.full((B, N), N, dtype=torch.long, device=dev).scatter_reduce(
        1, par[None, :].expand(B, N), cand, reduce="amin", include_self=True
    )  # [B, N] first[b, u] = the id of u's accepted child, N if none
    ok = first[:, par] == ids[None, :]  # [B, N]
    ok[:, 0] = True  # the root is committed
    anc = tt.ancestors.to(dev)  # [N, N]
    bad = (~ok).to(torch.float32) @ anc.T.to(torch.float32)  # [B, N] rejected nodes on each path
    depth = torch.where(bad == 0, tt.depths.to(dev)[None, :], -1)  # [B, N]
    return depth.argmax(dim=-1)  # [B]


def _ranked_rates(parents: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Acceptance probabilities [B, N] of children treated as deterministic proposals (q = 1).

    Trying children c_1, c_2, ... of a node in turn, with target distribution p there: after c_1..c_{i-1}
    were rejected the residual is p with their tokens removed and renormalised, so c_i is accepted with
    probability p(c_i) / (1 − Σ_{j<i} p(c_j)). A token repeated among siblings gets 0.
    """
    B, N, V = probs.shape
    dev = probs.device
    par = parents.clamp(min=0)
    ids = torch.arange(N, device=dev)
    child = parents >= 0  # [N]
    sib_before = (
        (par[:, None] == par[None, :]) & (ids[None, :] < ids[:, None]) & child[:, None] & child[None, :]
    )  # [N, N]
    rows = torch.arange(B, device=dev)[:, None]
    pt = probs[rows, par[None, :], tokens].to(torch.float64)  # [B, N] p_parent(token)
    dup = ((tokens[:, :, None] == tokens[:, None, :]) & sib_before[None]).any(dim=-1)  # [B, N]
    pt = torch.where(dup | ~child[None, :], 0.0, pt)
    before = pt @ sib_before.T.to(pt)  # [B, N] mass of the earlier siblings' tokens
    shared = B > 1 and probs.stride(0) == 0  # one distribution for every trial (tests: a fixed tree)
    mass = (probs[:1] if shared else probs).sum(dim=-1).to(torch.float64).expand(B, N)  # [B, N] ≈ 1
    left = mass[:, par] - before  # [B, N] residual mass before child i
    return torch.where(left > 0, pt / left.clamp(min=1e-300), 0.0).clamp_(0.0, 1.0)


def _bonus_rows(parents: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """[B, V]: the target's distribution at node ``best[b]`` with the tokens of all its children
    removed (unnormalised): the residual after every child was rejected as a deterministic proposal."""
    B, N, V = probs.shape
    rows = torch.arange(B, device=probs.device)
    res = probs[rows, best].to(torch.float64)  # [B, V]
    kids = parents[None, :] == best[:, None]  # [B, N]
    drop = torch.zeros(B, V + 1, dtype=torch.bool, device=probs.device)  # column V: a sink for non-children
    drop.scatter_(1, torch.where(kids, tokens, V), True)
    return res.masked_fill(drop[:, :V], 0.0)


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """SpecInfer's residual after a rejection: max(0, r − q), normalised; a row with no mass left
    (possible only through rounding) keeps r."""
    out = (r - q).clamp_(min=0.0)
    mass = out.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, out / mass.clamp(min=1e-300), r)


def _specinfer_rates(
    tt: TreeTensors, tokens: torch.Tensor, probs: torch.Tensor, draw_dist: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SpecInfer/Sequoia's rule for children drawn without replacement from a recorded distribution.

    At node u with target distribution r_0 = p and draft distribution q_0 = q, the children x_1, x_2, ...
    in draw order: x_i was drawn from q_{i-1} (q with x_1..x_{i-1} removed, renormalised); it is
    accepted with probability min(1, r_{i-1}(x_i) / q_{i-1}(x_i)); after a rejection
    r_i = normalise(max(0, r_{i-1} − q_{i-1})). None of this depends on the uniforms, so every stage of
    every sampled node is computed up front, one vectorised pass per sibling rank.

    Returns the acceptance probability of every child [B, N] (meaningful for children of sampled nodes),
    the final residual [B, P, V] of each sampled node (the bonus distribution if all its children are
    rejected) and the sampled nodes' ids [P].
    """
    B, N, V = probs.shape
    dev = probs.device
    parents = tt.parents.to(dev)
    par = parents.clamp(min=0)
    draw_row = tt.draw_row.to(dev)
    nodes = (draw_row >= 0).nonzero().flatten()  # [P]
    P = nodes.numel()
    pos = torch.full((N,), -1, dtype=torch.long, device=dev)
    pos[nodes] = torch.arange(P, device=dev)
    ids = torch.arange(N, device=dev)
    child = (parents >= 0) & (pos[par] >= 0)  # [N] children of sampled nodes
    sib_before = (par[:, None] == par[None, :]) & (ids[None, :] < ids[:, None])  # [N, N]
    rank = (sib_before & child[None, :]).sum(dim=1)  # [N] position among its siblings
    kmax = int(rank[child].max()) + 1 if bool(child.any()) else 0
    table = torch.full((P, max(kmax, 1)), -1, dtype=torch.long, device=dev)  # [P, K] children in draw order
    table[pos[par[child]], rank[child]] = ids[child]

    r = probs[:, nodes].to(torch.float64)  # [B, P, V] r_0 = p
    q0 = recorded_draft(draw_dist, draw_row[nodes], V, dev)  # [B, P, V]
    removed = torch.zeros(B, P, V + 1, dtype=torch.bool, device=dev)  # column V: a sink for absent children
    rates = torch.zeros(B, N, dtype=torch.float64, device=dev)
    for j in range(kmax):
        c = table[:, j]  # [P]
        valid = c >= 0
        x = tokens[:, c.clamp(min=0)]  # [B, P]
        q = drawn_from(q0, x, V, removed[..., :V])  # [B, P, V] q_j: earlier draws removed (a token it
        # could not draw: a deterministic proposal, q = 1)
        qx = q.gather(-1, x[..., None]).squeeze(-1)  # [B, P]
        rx = r.gather(-1, x[..., None]).squeeze(-1)
        rate = (rx / qx).clamp(max=1.0)
        rates[:, c[valid]] = rate[:, valid]
        r = torch.where(valid[None, :, None], _residual(r, q), r)
        removed.scatter_(-1, torch.where(valid[None, :], x, V)[..., None], True)
    return rates, r, nodes
