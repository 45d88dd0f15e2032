"""Traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398) for any draft tree.

Token-level rules (``deterministic``, ``specinfer``) walk the tree from the root down and give up a
whole subtree as soon as its root token is rejected. Traversal verification walks it the other way:
it visits the nodes in post-order (a node's children's subtrees first, in draw order, then the node
itself) and, at each node it visits, accepts the WHOLE root-to-node path at once or deletes the node.
A deleted node hands its share of the target's mass back to its parent, which later siblings (and
finally the parent itself, once it has become a leaf) may still use.

State. Every node u carries an unnormalised sub-distribution m_u = α_u · R_u over the next token:
R_u is u's current target distribution (the target's processed p_u at first, a residual after
children were deleted) and α_u ∈ [0, 1] is the share of its path's mass that u keeps. The root
starts with α = 1, m = p_root. Child c_j of u (its j-th child, in node-id = draw order) was drawn
from Q_j: for a *sampled* node, the recorded draft q with c_1..c_{j-1} removed and renormalised; for a
*ranked* node, the point mass at c_j's token (the children are a deterministic function of the draft).

    entering c_j:   α_{c_j} = min(1, m_u(x) / Q_j(x))                 x = c_j's token; m_c = α_c · p_c
    c_j deleted:    m_u ← [m_u − Q_j]_+ / (1 − Σ_y min(m_u(y), Q_j(y)))
    testing u:      (after all its children were deleted; a leaf at once) accept the root-to-u path
                    with probability h_u = Σ_y m_u(y) (= α_u), and then draw the bonus from R_u = m_u / h_u

The step ends at the first node in post-order whose test passes (the deepest accepted node); the
root, visited last, always passes (its α stays 1). On a chain this is block verification (``treespec.block_verify``):
α is block's kept mass p_i, and the mass of u after its only child was deleted is block's stop weight
h_i = S_i / (S_i + 1 − p_i), S_i = Σ [p_i P − Q]_+. Leaves start with m = α · p, but only Σ m = α is
needed to test them, so a leaf's row of ``probs`` is read only for its bonus, after ``fill``.

Why it is exact (docs/sampling.md has the sketch). Claim, by induction from the leaves up: a node c
entered with α_c ends "accepted at or below c, then the target's own continuation" with probability
α_c · P(continuation | c's path), averaged over what its subtree drew from the draft, and is deleted
with probability 1 − α_c. A leaf: by its test. A node u with state m (mass α):
child x ~ Q is accepted with probability Q(x) · min(1, m(x)/Q(x)) = min(Q(x), m(x)) (times the target
after x), so the stage leaves [m − Q]_+ to emit and is rejected with probability 1 − Σ min(m, Q) =
1 − α + Σ [m − Q]_+; dividing the former by the latter is the update above, and the rest of u's
process (later siblings, then u's own test) emits exactly that by induction. The new state depends on
Q but not on which x was rejected, so the next sibling may be drawn from q without x (sampling
without replacement) and the induction still applies.
The root's claim with α = 1 is the target's distribution.

All states depend only on tokens and distributions, not on the uniforms (reaching a node in
post-order means everything before it was deleted), so they are computed up front, one vectorised
pass over B per child; then one uniform per node decides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treespec.sampling import drawn_from, recorded_draft, sample_rows, uniform
from treespec.tree import TreeTensors


def traversal_verify(
    tt: TreeTensors,
    tokens: torch.Tensor,  # [B, N] long, column 0 the root
    probs: torch.Tensor,  # [B, N, V] the target's processed distribution after each node
    generator: torch.Generator,
    draw_dist: torch.Tensor | None = None,  # [B, R, V'] the distributions sampled children were drawn from
    fill: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B independent traversal verifications of trees of one shape; returns the deepest accepted node
    [B] (0: none) and the bonus token [B] (``verify_batch``'s contract). Children of nodes with a
    recorded draw (``tt.draw_row`` >= 0 and ``draw_dist`` given) are treated as drawn without
    replacement from it; all other children as ranked (point-mass proposals)."""
    B, N = probs.shape[:2]
    dev = probs.device
    rows = torch.arange(B, device=dev)
    h, left, slot, rank = traversal_weights(tt, tokens, probs, draw_dist)
    passed = uniform((B, N), generator, dev) < h  # [B, N]
    passed[:, 0] = True  # the root is committed (h = 1 up to rounding)
    best = torch.where(passed, rank[None, :], N).argmin(dim=-1)  # [B] the first passing node in post-order
    probs = fill(best) if fill is not None else probs
    at = slot[best]  # [B] row of ``left`` (-1: a leaf)
    res = left[rows, at.clamp(min=0)]  # [B, V]
    out = bonus_distribution(res, probs[rows, best].to(torch.float64), at >= 0)  # [B, V]
    return best, sample_rows(out, generator)


def traversal_weights(
    tt: TreeTensors, tokens: torch.Tensor, probs: torch.Tensor, draw_dist: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything the traversal decides with, before any randomness: h [B, N] (the probability that the
    test of each node passes when the traversal reaches it), left [B, P, V] (the state m of each node
    with children at its test: its bonus distribution, unnormalised), slot [N] (each node's row in
    ``left``, -1 for leaves) and rank [N] (each node's position in post-order). Reads no leaf rows.

    The traversal stops at node v with probability h_v · Π_{w before v in post-order} (1 − h_w)."""
    B, N, V = probs.shape
    dev = probs.device
    parents = tt.parents.tolist()
    kids: list[list[int]] = [[] for _ in range(N)]
    for c in range(1, N):
        kids[parents[c]].append(c)  # in node-id (draw) order
    inner = [u for u in range(N) if kids[u]]  # in id order: parents before their children (DraftTree)
    has_draws = tt.draw_row is not None and draw_dist is not None
    draw_row = tt.draw_row.tolist() if has_draws else [-1] * N
    rows = torch.arange(B, device=dev)

    alpha = torch.ones(B, N, dtype=torch.float64, device=dev)  # [B, N] α at entry (the root: 1)
    h = torch.zeros(B, N, dtype=torch.float64, device=dev)  # [B, N]
    left = torch.zeros(B, max(len(inner), 1), V, dtype=torch.float64, device=dev)  # [B, P, V] m_u at u's test
    for k, u in enumerate(inner):
        p = probs[:, u].to(torch.float64)  # [B, V]
        m = alpha[:, u, None] * p / p.sum(dim=-1, keepdim=True).clamp(min=1e-300)  # [B, V] α · R
        q0 = recorded_draft(draw_dist, draw_row[u], V, dev) if draw_row[u] >= 0 else None  # [B, V] or None
        removed = torch.zeros(B, V, dtype=torch.bool, device=dev)  # [B, V] earlier siblings' tokens
        for c in kids[u]:
            x = tokens[:, c].to(dev)  # [B]
            Q = drawn_from(q0, x, V, removed)  # [B, V] what c was drawn from
            alpha[:, c] = child_ratio(m, Q, x)
            m = reject_child(m, Q)  # the state for the next sibling, should c's subtree be deleted
            if q0 is not None:
                removed[rows, x] = True
        left[:, k] = m
        h[:, u] = m.sum(dim=-1)
    leaves = torch.tensor([u for u in range(N) if not kids[u]], dtype=torch.long, device=dev)
    h[:, leaves] = alpha[:, leaves]

    slot = torch.full((N,), -1, dtype=torch.long, device=dev)  # [N]
    if inner:
        slot[torch.tensor(inner, device=dev)] = torch.arange(len(inner), device=dev)
    rank = torch.empty(N, dtype=torch.long, device=dev)  # [N]
    rank[torch.tensor(post_order(kids), device=dev)] = torch.arange(N, device=dev)
    return h, left, slot, rank


def post_order(kids: list[list[int]]) -> list[int]:
    """The nodes in post-order from the root (0): each child's subtree in turn, in id order, then the node."""
    out: list[int] = []
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        u, done = stack.pop()
        if done:
            out.append(u)
            continue
        stack.append((u, True))
        stack.extend((c, False) for c in reversed(kids[u]))
    return out


def child_ratio(m: torch.Tensor, Q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B] α of the child with token x: min(1, m(x) / Q(x)), m = α_parent · R_parent [B, V]."""
    mx = m.gather(1, x[:, None]).squeeze(1)  # [B]
    qx = Q.gather(1, x[:, None]).squeeze(1)  # [B], > 0 by construction
    return (mx / qx.clamp(min=1e-300)).clamp(max=1.0)


def reject_child(m: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """[B, V] the parent's state after a child drawn from Q [B, V] was deleted: [m − Q]_+ divided by the
    probability of that deletion, 1 − Σ min(m, Q) = (1 − α) + Σ [m − Q]_+. A deletion of probability 0
    (possible only through rounding) keeps m."""
    over = (m - Q).clamp(min=0.0)  # [B, V]
    gone = (1.0 - m.sum(dim=-1, keepdim=True)).clamp(min=0.0) + over.sum(dim=-1, keepdim=True)  # [B, 1] P(deletion)
    return torch.where(gone > 0, over / gone.clamp(min=1e-300), m)


def bonus_distribution(res: torch.Tensor, target: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """[B, V] what the bonus token is drawn from (unnormalised): at a node whose children were all
    deleted, what is left of its state ``res``; at a leaf (``inner`` False), the target ``target`` there.
    An empty state (rounding only) falls back to the target."""
    use = inner & (res.sum(dim=-1) > 0)  # [B]
    return torch.where(use[:, None], res, target)
