"""How much can ANY exact verifier accept at one node? The multi-draft upper bound, for tiny vocabularies.

Setting: one node of a draft tree, the target's (processed) distribution p over V tokens there, and
k children drafted from q *without replacement* (``treespec.sampling.draw_children``: x₁ ~ q,
x₂ ~ q without x₁, renormalised, ...). Write S = {x₁, …, x_k} for the drafted set. A verifier is exact
at the node when the token Y it emits next is distributed as p, whatever it does with S: it is a
coupling of Y ~ p with S. It accepts a child when Y ∈ S (the event "the first emitted token is one
of the node's children"). The best any exact verifier can do is

    α*(p, q, k) = max over couplings of P(Y ∈ S)
                = min over H ⊆ vocabulary of [ p(H) + P(S ⊄ H) ]                          (1)
                = 1 − max_H [ P(S ⊆ H) − p(H) ]

(Hu et al., "Towards optimal multi-draft speculative decoding", ICLR 2025, arXiv 2502.18779, compute
the optimal acceptance rate through the dual of this transport problem; the form (1) is derived and
checked here independently, see below.)

Why (1) bounds every verifier (weak duality): for any token set H, the drafts all land in H with
probability P(S ⊆ H) but Y does only with probability p(H); so at least P(S ⊆ H) − p(H) of the time
every draft is in H and Y is not, and Y ∉ S there. Why some verifier attains it (strong duality):
the coupling problem is a max-flow problem, source → each drafted set S (capacity P(S)) → each token
y ∈ S (unbounded) → sink (capacity p(y)); a flow of value f is a partial coupling that accepts with
probability f (the unused mass of both sides, 1 − f each, is then paired arbitrarily), and a finite
cut keeps on the source side a token set H and the drafted sets inside it, with capacity
P(S ⊄ H) + p(H). Max-flow = min-cut is (1). ``tests/test_sampling_bound.py`` checks (1) against an
exact max-flow (augmenting paths in rational arithmetic over the ordered draws) on random small
cases, and the reductions below.

* k = 1: P(S ⊄ H) = q(vocabulary∖H), and the minimum, at H = {p < q}, is Σ_y min(p(y), q(y)): the
  speculative-sampling rate, which one draft attains (SpecInfer's rule is its k = 1 case).
* Monotone in k: the first k of k + 1 draws are distributed as k draws, so a verifier for k is one
  for k + 1 (ignore the last child).
* q = p and k ≥ 1: α* = 1 (accept x₁ always); k = V (or k ≥ the size of q's support, every
  supported token drafted): α* = p(supp q).

NB the variant with P(S ∩ H = ∅) in place of P(S ⊄ H) agrees for k = 1 but is NOT a bound for k ≥ 2
(q = p uniform on 4 tokens, k = 2: it gives 2/3 at |H| = 2, while accepting x₁ always is exact and
accepts with probability 1).

Computation, exact up to float rounding (or exact with ``fractions.Fraction`` inputs): the law of
the drafted set by a recursion over subsets, P(first j draws = R) = Σ_{x ∈ R} P(R∖x) · q(x) / q(V∖(R∖x)),
then P(S ⊆ H) for every H by a subset-sum (zeta) transform, then (1) over all 2^V sets H: O(V 2^V),
so vocabularies up to 16 (``MAX_VOCAB``). If q has fewer than k tokens of positive probability, the
drafted set is its whole support (the builders drop q = 0 padding).

Trees. The drafted set at the ROOT of a tree has exactly this law whatever is drafted below it, and
every exact tree verifier emits a first token Y ~ p(root) and accepts a root child only when Y is one
of them: ``root_bound`` is therefore a bound on P(the accepted path has length ≥ 1) for every exact
rule (``specinfer``, ``traversal``, ``block``, ...). It is a per-node bound, not a bound on a whole
tree's mean accepted length. Ranked children (the draft's top-k, a point-mass proposal) need no
optimisation: Y ∈ S happens with probability p(S) under every exact verifier, and ``root_bound``
returns that.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from functools import cache
from typing import TYPE_CHECKING

import torch

from treespec.sampling import recorded_draft

if TYPE_CHECKING:
    from treespec.tree import TreeTensors

#: the largest vocabulary ``optimal_acceptance`` and ``draws_outside`` enumerate (2^V token sets)
MAX_VOCAB = 16

Number = float | Fraction
Dist = Sequence[Number] | torch.Tensor


# ----------------------------------------------------------------------------------------- helpers
def _as_dist(dist: Dist, name: str) -> list[Number]:
    """A normalised copy of ``dist`` ([V]) as Python numbers (floats in float64, or Fractions kept exact)."""
    if isinstance(dist, torch.Tensor):
        if dist.dim() != 1:
            raise ValueError(f"{name} must be one distribution of shape [V], got shape {tuple(dist.shape)}")
        values: list[Number] = [float(x) for x in dist.detach().to(torch.float64).cpu().tolist()]
    else:
        values = [x if isinstance(x, Fraction) else float(x) for x in dist]
    if not values:
        raise ValueError(f"{name} is empty")
    if len(values) > MAX_VOCAB:
        raise ValueError(
            f"{name} has a vocabulary of {len(values)} tokens: the bound enumerates all 2^V token sets and is "
            f"computed only for V <= {MAX_VOCAB} (the tiny-vocabulary harness)"
        )
    if any(not (x >= 0) for x in values):  # also NaN
        raise ValueError(f"{name} has negative or NaN entries")
    total = sum(values)
    if not total > 0:
        raise ValueError(f"{name} has no mass")
    return [x / total for x in values]


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k (the number of drafts) must be an integer >= 0, got {k!r}")
    return k


def _mask(tokens: Sequence[int] | set[int] | frozenset[int], V: int) -> int:
    out = 0
    for t in tokens:
        if not 0 <= int(t) < V:
            raise ValueError(f"token {t} is outside the vocabulary of {V}")
        out |= 1 << int(t)
    return out


def _subset_sums(values: Sequence[Number]) -> list[Number]:
    """[2^V]: entry m = Σ of values[i] over the bits i of m."""
    V = len(values)
    out: list[Number] = [values[0] * 0] * (1 << V)
    for m in range(1, 1 << V):
        low = m & -m
        out[m] = out[m ^ low] + values[low.bit_length() - 1]
    return out


def drafted_set_law(q: Dist, k: int) -> list[Number]:
    """[2^V] the law of the SET of k draws without replacement from q: entry m is the probability that
    the drafted set is exactly the token set of mask m (0 unless m has min(k, |supp q|) bits).

    P(the first j draws are R) = Σ_{x ∈ R} P(the first j − 1 draws are R∖x) · q(x) / q(V∖(R∖x)), in the
    order of increasing masks (R∖x < R). Float inputs are summed in float64; Fractions stay exact."""
    qs = _as_dist(q, "q")
    k = min(_check_k(k), sum(1 for x in qs if x > 0))
    V = len(qs)
    full = (1 << V) - 1
    qsum = _subset_sums(qs)  # [2^V] q(R)
    zero = qs[0] * 0
    law: list[Number] = [zero] * (1 << V)  # [2^V] P(first |R| draws = R), for |R| <= k
    law[0] = zero + 1
    for m in range(1, 1 << V):
        if m.bit_count() > k:
            continue
        acc = zero
        rest = m
        while rest:
            low = rest & -rest
            rest ^= low
            x = low.bit_length() - 1
            before = m ^ low
            if qs[x] > 0 and law[before] != 0:
                acc += law[before] * qs[x] / qsum[full ^ before]  # q(V∖before) >= q(x) > 0
        law[m] = acc
    return [law[m] if m.bit_count() == k else zero for m in range(1 << V)]


def _inside_table(q: Dist, k: int) -> list[Number]:
    """[2^V]: entry m = P(S ⊆ token set m), by a subset-sum (zeta) transform of the set's law."""
    law = drafted_set_law(q, k)
    V = (len(law) - 1).bit_length()
    out = list(law)
    for i in range(V):
        bit = 1 << i
        for m in range(1 << V):
            if m & bit:
                out[m] += out[m ^ bit]
    return out


# ----------------------------------------------------------------------------------------- the API
def draws_outside(q: Dist, k: int, H: Sequence[int] | set[int] | frozenset[int]) -> Number:
    """The probability that k draws without replacement from q ([V]) ALL avoid the token set H.

    Exact (float64 rounding only; exact with Fraction entries), by the recursion
    f(R, j) = Σ_{x ∉ H ∪ R, q(x) > 0} q(x) / q(V∖R) · f(R ∪ {x}, j − 1), f(·, 0) = 1, over the set R
    of tokens drawn so far. If q has fewer than k tokens of positive probability, the draws stop when
    its support is exhausted (the drafted set is the whole support)."""
    qs = _as_dist(q, "q")
    V = len(qs)
    k = min(_check_k(k), sum(1 for x in qs if x > 0))
    avoid = _mask(H, V)
    full = (1 << V) - 1
    qsum = _subset_sums(qs)

    @cache
    def f(drawn: int, left: int) -> Number:
        if left == 0:
            return qs[0] * 0 + 1
        rest = qsum[full ^ drawn]  # q mass not drawn yet
        total = qs[0] * 0
        for x in range(V):
            bit = 1 << x
            if qs[x] > 0 and not (drawn | avoid) & bit:
                total += qs[x] / rest * f(drawn | bit, left - 1)
        return total

    return f(0, k)


def optimal_acceptance(p: Dist, q: Dist, k: int) -> Number:
    """α*(p, q, k): the largest probability with which an exact verifier (its output Y ~ p) can emit
    one of k children drawn without replacement from q, i.e. min over token sets H of
    p(H) + P(S ⊄ H) (module docstring). p, q: [V] (normalised here), V <= ``MAX_VOCAB`` or ValueError."""
    return min(_objective(p, q, k))


def tightest_set(p: Dist, q: Dist, k: int) -> tuple[list[int], Number]:
    """(the tokens of a set H attaining the minimum in ``optimal_acceptance``, α*): where the drafts
    over-cover the target most, P(S ⊆ H) − p(H) = 1 − α*."""
    values = _objective(p, q, k)
    best = min(range(len(values)), key=lambda m: (values[m], m.bit_count()))
    return [i for i in range(best.bit_length()) if best >> i & 1], values[best]


def _objective(p: Dist, q: Dist, k: int) -> list[Number]:
    """[2^V]: p(H) + P(S ⊄ H) for every token set H (bit mask m), p and q normalised and checked."""
    ps, qs = _as_dist(p, "p"), _as_dist(q, "q")
    if len(ps) != len(qs):
        raise ValueError(f"p and q have different vocabularies ({len(ps)} and {len(qs)})")
    psum, inside = _subset_sums(ps), _inside_table(qs, k)  # [2^V] p(H), P(S ⊆ H)
    return [psum[m] + (1 - inside[m]) for m in range(1 << len(ps))]


def root_bound(
    tt: TreeTensors,
    tokens: torch.Tensor,  # [B, N] long, column 0 the root
    probs: torch.Tensor,  # [B, N, V] the target's processed distribution after each node (row 0: the root's p)
    draw_dist: torch.Tensor | None = None,  # [B, R, V'] the distributions sampled children were drawn from
) -> torch.Tensor:
    """[B] float64: for each of B trees of one shape (``verify_batch``'s inputs), the largest probability
    with which an exact verifier's first emitted token is one of the ROOT's children.

    Root children drawn without replacement (``tt.draw_row[0] >= 0`` and ``draw_dist`` given): α*(p, q, k)
    with p the root's row of ``probs``, q its recorded draft distribution and k its number of children;
    computed once per distinct (p, q) pair. Ranked root children (point-mass proposals): p(the children's
    tokens). A root without children: 0."""
    B, _, V = probs.shape
    dev = probs.device
    kids = (tt.parents.to(dev) == 0).nonzero().flatten()  # [k] the root's children
    k = int(kids.numel())
    p = probs[:, 0].to(torch.float64)  # [B, V]
    if k == 0:
        return torch.zeros(B, dtype=torch.float64, device=dev)
    sampled = tt.draw_row is not None and draw_dist is not None and int(tt.draw_row[0]) >= 0
    if not sampled:
        hit = torch.zeros(B, V, dtype=torch.bool, device=dev)  # [B, V] tokens drafted at the root
        hit.scatter_(1, tokens[:, kids].to(dev), True)
        return (p * hit).sum(dim=-1) / p.sum(dim=-1)
    q = recorded_draft(draw_dist, int(tt.draw_row[0]), V, dev)  # [B, V]
    pairs, inverse = torch.unique(torch.cat([p, q], dim=-1), dim=0, return_inverse=True)  # [U, 2V], [B]
    values = torch.tensor(
        [float(optimal_acceptance(row[:V], row[V:], k)) for row in pairs], dtype=torch.float64, device=dev
    )  # [U]
    return values[inverse]
