"""Block verification (Sun et al., ICLR 2025, arXiv 2403.10444) for a chain of drafted tokens.

Token-level speculative sampling decides each draft token on its own: X_i survives with probability
min(1, p_i(X_i)/q_i(X_i)) and the first rejection ends the step. Block verification decides the
block jointly, carrying the acceptance mass forward along the chain. With P_i = the target's
distribution and Q_i = the draft's (the one X_i was drawn from) after X_1..X_{i-1}:

    p_0 = 1,   p_i = min(1, p_{i-1} · P_i(X_i) / Q_i(X_i))                       i = 1..γ
    S_i = Σ_x [p_i · P_{i+1}(x) − Q_{i+1}(x)]_+                                i = 0..γ−1
    h_i = S_i / (S_i + 1 − p_i)   (i < γ; 0 when S_i = 0),   h_γ = p_γ
    τ   = the largest i with η_i ≤ h_i   (independent uniforms η_0..η_γ; τ = 0 if none)
    emit X_1..X_τ, then Y ~ P_{γ+1} if τ = γ, else Y ∝ [p_τ · P_{τ+1} − Q_{τ+1}]_+

γ = 1 is token-level speculative sampling. Exactness (the paper's Theorem 1, sketched in
docs/sampling.md): by induction from the end of the block, the probability of emitting X_1..X_i and
then any y is P_1(X_1)…P_i(X_i)·P_{i+1}(y) times the probability the draft proposed X_1..X_i, summed
over what it proposed after — p_i is the part of that mass the path has kept so far, and h_i the share
of the path's remaining mass that stopping at i must take. The paper proves the rule optimal among
all verifiers that read only the block's own probabilities, hence never worse than token level.

Ranked chains (the draft's top-1 at every node, ``deterministic`` children) are the case Q_i = the
point mass at X_i: p_i = Π P_j(X_j), S_i = p_i (1 − P_{i+1}(X_{i+1})).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treespec.sampling import drawn_from, recorded_draft, sample_rows, uniform
from treespec.tree import TreeTensors


def is_chain(tt: TreeTensors) -> bool:
    """Every node's parent is the node before it (one child at most everywhere)."""
    n = int(tt.parents.shape[0])
    return bool((tt.parents[1:] == torch.arange(n - 1, device=tt.parents.device)).all())


def block_verify(
    tt: TreeTensors,
    tokens: torch.Tensor,  # [B, N] long, column 0 the root
    probs: torch.Tensor,  # [B, N, V] the target's processed distribution after each node
    generator: torch.Generator,
    draw_dist: torch.Tensor | None = None,  # [B, R, V'] the distributions children were drawn from
    fill: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B independent block verifications of chains of one length; returns τ [B] (the deepest accepted
    node) and the bonus token [B] (``verify_batch``'s contract)."""
    B, N, V = probs.shape
    dev = probs.device
    gamma = N - 1
    rows = torch.arange(B, device=dev)
    draw_row = tt.draw_row.to(dev) if tt.draw_row is not None and draw_dist is not None else None
    p = torch.ones(B, dtype=torch.float64, device=dev)  # p_i
    h = torch.zeros(B, N, dtype=torch.float64, device=dev)  # h_0..h_γ
    residual = []  # [B, V] unnormalised residual at each i < γ
    for i in range(gamma):
        P = probs[:, i].to(torch.float64)  # [B, V] P_{i+1}: the target after node i
        x = tokens[:, i + 1]  # [B] X_{i+1}
        q0 = (
            recorded_draft(draw_dist, int(draw_row[i]), V, dev)
            if draw_row is not None and int(draw_row[i]) >= 0
            else None
        )
        Q = drawn_from(q0, x, V)  # [B, V] Q_{i+1}: node i's child's recorded draw, else the point mass at it
        res = block_residual(p, P, Q)  # [B, V]
        h[:, i] = stop_weight(res.sum(dim=-1), p)
        residual.append(res)
        qx = Q[rows, x]
        p = torch.where(qx > 0, p * P[rows, x] / qx.clamp(min=1e-300), 0.0).clamp_(max=1.0)
    h[:, gamma] = p
    passed = uniform((B, N), generator, dev).to(torch.float64) <= h  # [B, N]
    idx = torch.arange(N, device=dev)
    tau = torch.where(passed, idx[None, :], 0).amax(dim=-1)  # [B] the largest i that passed (0 if none)
    probs = fill(tau) if fill is not None else probs
    out = probs[rows, tau].to(torch.float64)  # [B, V] τ = γ: the target after the whole chain
    if gamma:
        stacked = torch.stack(residual, dim=1)  # [B, γ, V]
        res = stacked[rows, tau.clamp(max=gamma - 1)]  # [B, V]
        use = (tau < gamma) & (res.sum(dim=-1) > 0)  # an empty residual (rounding only): the target's own
        out = torch.where(use[:, None], res, out)
    return tau, sample_rows(out, generator)


def block_residual(p: torch.Tensor, P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """[p_i · P_{i+1} − Q_{i+1}]_+ [B, V] (unnormalised): what stopping after X_i may emit next."""
    return (p[:, None] * P - Q).clamp_(min=0.0)


def stop_weight(s: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """h_i = S_i / (S_i + 1 − p_i) [B] (0 where S_i = 0: nothing could be emitted there)."""
    return torch.where(s > 0, s / (s + 1.0 - p).clamp(min=1e-300), 0.0)
