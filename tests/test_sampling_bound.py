"""The multi-draft upper bound (``treespec.sampling_bound``): the best probability with which ANY exact
verifier emits one of k children drawn without replacement from q, α*(p, q, k) = min_H p(H) + P(S ⊄ H).

(a)-(b) its reductions and properties; (c) an independent exact check: the optimal coupling is a
max-flow problem, solved here by augmenting paths in rational arithmetic over the ORDERED draws
(enumerated directly, not through the module's recursion), which must equal the subset formula
exactly; (d) on ``test_sampling_exact``'s V = 8 harness, the measured root acceptance of ``specinfer``
and ``traversal`` never exceeds α* (a verifier beating it would not be exact), and ranked top-k
children are accepted with probability p(top-k set), their bound. ``test_report_root_acceptance``
prints the table of docs/sampling.md ("How far from optimal"):

    .venv/bin/python -m pytest tests/test_sampling_bound.py -n 0 -s -k report
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from fractions import Fraction

import pytest
import torch
from test_sampling_exact import (
    SETTINGS,
    draft_tables,
    draw_trials,
    sampled_trials,
    target_tables,
)

from treespec.sampling import with_temperature
from treespec.sampling_bound import (
    MAX_VOCAB,
    drafted_set_law,
    draws_outside,
    optimal_acceptance,
    root_bound,
    tightest_set,
)
from treespec.verify import verify_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_dist(rng: random.Random, v: int, zeros: int = 0) -> list[Fraction]:
    """A random rational distribution over v tokens, ``zeros`` of them (at random) with probability 0."""
    w = [rng.randint(1, 20) for _ in range(v)]
    for i in rng.sample(range(v), zeros):
        w[i] = 0
    return [Fraction(x, sum(w)) for x in w]


# ----------------------------------------------------------------------------------------- (a), (b)
def test_one_draft_is_speculative_sampling():
    rng = random.Random(1)
    for v in (2, 3, 5, 8, 12):
        for _ in range(20):
            p, q = random_dist(rng, v, rng.randint(0, v - 1)), random_dist(rng, v, rng.randint(0, v - 1))
            assert optimal_acceptance(p, q, 1) == sum(min(a, b) for a, b in zip(p, q))  # exact, in Fractions
    g = torch.Generator().manual_seed(0)
    p, q = torch.rand(8, generator=g, dtype=torch.float64), torch.rand(8, generator=g, dtype=torch.float64)
    p, q = p / p.sum(), q / q.sum()
    assert abs(optimal_acceptance(p, q, 1) - float(torch.minimum(p, q).sum())) < 1e-12  # tensors, floats


def test_bound_is_at_most_one_monotone_in_k_and_one_for_identical_drafts():
    rng = random.Random(2)
    for v in (3, 4, 6, 8):
        for _ in range(15):
            p, q = random_dist(rng, v, rng.randint(0, 1)), random_dist(rng, v, rng.randint(0, 2))
            values = [optimal_acceptance(p, q, k) for k in range(v + 1)]
            assert values[0] == 0 and all(0 <= a <= 1 for a in values)
            assert all(a <= b for a, b in itertools.pairwise(values)), values  # more draws never hurt
            support = [i for i in range(v) if q[i] > 0]
            assert values[v] == sum(p[i] for i in support)  # every supported token drafted: P(Y ∈ S) = p(S)
            assert optimal_acceptance(p, p, v) == 1 and optimal_acceptance(p, p, 1) == 1  # q = p: accept x₁
    u = [Fraction(1, 8)] * 8
    assert all(optimal_acceptance(u, u, k) == 1 for k in range(1, 9))


def test_draws_outside_and_the_set_law():
    rng = random.Random(3)
    q = random_dist(rng, 6, 1)
    for k in range(7):
        law = drafted_set_law(q, k)
        assert sum(law) == 1
        for h in range(1 << 6):
            H = [i for i in range(6) if h >> i & 1]
            # the recursion over drawn sets agrees with the set law summed over sets avoiding H
            assert draws_outside(q, k, H) == sum(law[m] for m in range(1 << 6) if not m & h)
    assert draws_outside([Fraction(1, 4)] * 4, 2, {0, 1}) == Fraction(1, 6)
    assert draws_outside([0.5, 0.5], 2, []) == 1.0 and draws_outside([0.5, 0.5], 1, [0]) == 0.5


def test_refusals():
    with pytest.raises(ValueError, match="V <= 16"):
        optimal_acceptance([1.0] * (MAX_VOCAB + 1), [1.0] * (MAX_VOCAB + 1), 2)
    with pytest.raises(ValueError, match="V <= 16"):
        draws_outside(torch.ones(17), 1, [0])
    with pytest.raises(ValueError, match="different vocabularies"):
        optimal_acceptance([0.5, 0.5], [1 / 3] * 3, 1)
    with pytest.raises(ValueError, match="integer >= 0"):
        optimal_acceptance([0.5, 0.5], [0.5, 0.5], -1)
    with pytest.raises(ValueError, match="negative"):
        optimal_acceptance([1.5, -0.5], [0.5, 0.5], 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draws_outside([0.5, 0.5], 1, [2])
    with pytest.raises(ValueError, match="one distribution"):
        optimal_acceptance(torch.ones(2, 4), torch.ones(4), 1)


# ----------------------------------------------------------------------------------------- (c)
def ordered_draws(q: list, k: int) -> dict[tuple[int, ...], Fraction | float]:
    """Every ordered outcome of k draws without replacement from q and its probability, enumerated
    (exact for Fractions)."""
    support = [i for i in range(len(q)) if q[i] > 0]
    k = min(k, len(support))
    out = {}
    for seq in itertools.permutations(support, k):
        prob, left = q[0] * 0 + 1, q[0] * 0 + 1
        for x in seq:
            prob *= q[x] / left
            left -= q[x]
        out[seq] = prob
    return out


def max_flow_acceptance(p: list[Fraction], q: list[Fraction], k: int) -> Fraction:
    """The optimal coupling of Y ~ p with the ordered drafts, as a max-flow: source → each ordered draw
    outcome (capacity its probability) → each token it contains (capacity 2, i.e. unbounded: the flow is
    at most 1) → sink (capacity p(token)). Edmonds–Karp (shortest augmenting paths), exact in Fractions."""
    draws = ordered_draws(q, k)
    outcomes = list(draws)
    n_out = len(outcomes)
    src, sink = 0, 1 + n_out + len(p)
    cap: dict[int, dict[int, Fraction]] = {u: {} for u in range(sink + 1)}

    def edge(u: int, w: int, c: Fraction) -> None:
        cap[u][w] = cap[u].get(w, Fraction(0)) + c
        cap[w].setdefault(u, Fraction(0))

    for j, seq in enumerate(outcomes):
        edge(src, 1 + j, draws[seq])
        for x in seq:
            edge(1 + j, 1 + n_out + x, Fraction(2))
    for x in range(len(p)):
        edge(1 + n_out + x, sink, p[x])
    flow = Fraction(0)
    while True:
        parent = {src: src}
        todo = deque([src])
        while todo and sink not in parent:
            u = todo.popleft()
            for w, c in cap[u].items():
                if c > 0 and w not in parent:
                    parent[w] = u
                    todo.append(w)
        if sink not in parent:
            return flow
        path, w = [], sink
        while w != src:
            path.append((parent[w], w))
            w = parent[w]
        push = min(cap[u][w] for u, w in path)
        for u, w in path:
            cap[u][w] -= push
            cap[w][u] += push
        flow += push


def specinfer_acceptance(p: list, q: list, k: int):
    """The exact probability that SpecInfer's rule (``specinfer``) accepts one of k children drawn without
    replacement from q, by enumerating the ordered draws (stage i: accept x_i with probability
    min(1, r(x_i)/q_{i-1}(x_i)); on rejection r ← normalise([r − q_{i-1}]_+)). Fractions in, a Fraction
    out (exact); floats in, a float out."""
    zero = p[0] * 0
    total = zero
    for seq, prob in ordered_draws(q, k).items():
        r, qi, miss = list(p), list(q), zero + 1
        for x in seq:
            miss *= 1 - min(zero + 1, r[x] / qi[x])
            over = [max(zero, a - b) for a, b in zip(r, qi)]
            if sum(over) <= 0:
                break  # r = q_i: x was accepted surely
            r = [a / sum(over) for a in over]
            qi = [zero if i == x else a for i, a in enumerate(qi)]
            if sum(qi) <= 0:
                break  # the draft's support is exhausted: no further draws
            qi = [a / sum(qi) for a in qi]
        total += prob * (1 - miss)
    return total


def test_subset_formula_equals_the_max_flow_on_random_small_cases():
    rng = random.Random(4)
    cases = 0
    for v in (2, 3, 4, 5):
        for _ in range(6 if v < 5 else 3):
            p = random_dist(rng, v, rng.choice([0, 0, 1]))
            q = random_dist(rng, v, rng.choice([0, 0, 1]))
            for k in range(1, v + 1):
                best = optimal_acceptance(p, q, k)
                assert best == max_flow_acceptance(p, q, k), (p, q, k)  # exact equality, in Fractions
                assert specinfer_acceptance(p, q, k) <= best  # an exact rule stays below it
                H, value = tightest_set(p, q, k)
                assert value == best and draws_outside(q, k, [i for i in range(v) if i not in H]) >= 0
                cases += 1
    assert cases > 50


def test_the_complement_matters():
    """The variant min_H p(H) + P(S ∩ H = ∅) equals α* for one draft but is not a bound for k >= 2:
    with q = p, accepting the first draw always is exact (rate 1), yet the variant is below 1."""
    u = [Fraction(1, 4)] * 4
    variant = min(
        sum(u[i] for i in H) + draws_outside(u, 2, H) for r in range(5) for H in itertools.combinations(range(4), r)
    )
    assert variant == Fraction(2, 3)
    assert optimal_acceptance(u, u, 2) == 1 == max_flow_acceptance(u, u, 2) == specinfer_acceptance(u, u, 2)


# ----------------------------------------------------------------------------------------- (d) the harness
ROOT_SETTINGS = ["t0.7", "t1.0", "t1.5", "t0.7-top_p0.9"]
KS = [1, 2, 3, 4]
N = 20_000


def root_distributions(setting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) [V] float64 at the harness's root (after PROMPT): the target's processed distribution and
    the 'model' draft at the draft temperature (= the target's), float32 as ``sampled_trials`` draws it."""
    params = SETTINGS[setting]
    p = target_tables(params, 1).rows[0][0]
    q = with_temperature(draft_tables("model", params, 1).rows[0][0].float(), params.temperature)
    return p, q.to(torch.float64)


def root_trials(k: int, setting: str, rule: str, ranked: bool = False, n: int = N, seed: int = 0):
    """n trees of one level — the root and k children — verified once each, as ``sampled_trials`` builds
    them (children drawn by Gumbel-top-k from the draft at the draft temperature), or with ``ranked`` the
    draft's top-k (point masses). Returns (deepest accepted node [n], ``root_bound`` [n])."""
    _, tt, tokens, probs, dists, _, gen = draw_trials(
        [[j] for j in range(k)], "model", setting, None, seed, n, frozenset({0}) if ranked else frozenset()
    )
    probs = probs.float()  # [n, k+1, V]
    best, _ = verify_batch(tt, tokens, probs, gen, rule, dists)
    return best, root_bound(tt, tokens, probs, dists)


def rate(best: torch.Tensor) -> tuple[float, float]:
    """(fraction of trials that accepted a root child, its standard error)."""
    hit = (best != 0).double()
    m = float(hit.mean())
    return m, max(m * (1 - m), 1.0 / hit.numel()) ** 0.5 / hit.numel() ** 0.5


def test_root_trials_are_sampled_trials():
    """The one-level helper draws and verifies exactly as ``test_sampling_exact.sampled_trials`` (same
    seed: the very same accepted nodes), so the table measures the harness's own trees."""
    from test_sampling_exact import SHAPES

    SHAPES.setdefault("root-3", [[0], [1], [2]])
    ours, _ = root_trials(3, "t1.0", "specinfer", n=5000)
    theirs = sampled_trials("root-3", "model", "t1.0", "specinfer", None, n=5000)[3]
    assert torch.equal(ours, theirs)


def test_root_bound_on_harness_trees():
    for setting in ("t1.0", "t0.7-top_p0.9"):
        p, q = root_distributions(setting)
        for k in (1, 3):
            _, bound = root_trials(k, setting, "specinfer", n=200)
            assert torch.allclose(bound, torch.full_like(bound, float(optimal_acceptance(p, q, k))), atol=1e-6)
            _, ranked = root_trials(k, setting, "deterministic", ranked=True, n=200)
            assert torch.allclose(ranked, p[q.topk(k).indices].sum().expand(200), atol=1e-6)
            if k == 1:
                assert abs(float(bound[0]) - float(torch.minimum(p, q).sum())) < 1e-6


def measure() -> list[dict]:
    """Every cell of the table: α*, SpecInfer's exact root acceptance (enumerated), the measured root
    acceptance of specinfer and traversal (N trials each, the same trees and seeds), and the ranked
    top-k children: p(top-k) and the measured acceptance of ``deterministic``."""
    rows = []
    for setting in ROOT_SETTINGS:
        p, q = root_distributions(setting)
        pl, ql = (p / p.sum()).tolist(), (q / q.sum()).tolist()
        for k in KS:
            row = {
                "setting": setting,
                "k": k,
                "bound": float(optimal_acceptance(p, q, k)),
                "specinfer_exact": specinfer_acceptance(pl, ql, k),
                "topk": float(p[q.topk(k).indices].sum()),
            }
            for rule in ("specinfer", "traversal"):
                best, bound = root_trials(k, setting, rule)
                assert torch.allclose(bound, torch.full_like(bound, row["bound"]))
                row[rule] = rate(best)
            row["deterministic"] = rate(root_trials(k, setting, "deterministic", ranked=True)[0])
            rows.append(row)
    return rows


def test_report_root_acceptance():
    """(d): sampled rules stay at or below α* (4 standard errors; above it would mean an inexact
    verifier), SpecInfer's measured rate matches its exact one, one draft reaches the bound (k = 1:
    speculative sampling is optimal), and ranked children are accepted with probability p(top-k).
    Prints the docs table."""
    rows = measure()
    print(
        "\n| setting | k | α* (sampled, optimal) | specinfer exact | specinfer measured | traversal measured "
        "| ranked top-k: p(top-k) | deterministic measured |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        (s, s_se), (t, t_se), (d, d_se) = r["specinfer"], r["traversal"], r["deterministic"]
        print(
            f"| {r['setting']} | {r['k']} | {r['bound']:.4f} | {r['specinfer_exact']:.4f} | {s:.4f} ± {s_se:.4f} "
            f"| {t:.4f} ± {t_se:.4f} | {r['topk']:.4f} | {d:.4f} ± {d_se:.4f} |"
        )
    for r in rows:
        what = f"{r['setting']} k={r['k']}"
        for rule in ("specinfer", "traversal"):
            m, se = r[rule]
            assert m <= r["bound"] + 4 * se, f"{what}: {rule} accepts {m:.4f} > α* = {r['bound']:.4f}"
            assert abs(m - r["specinfer_exact"]) <= 4 * se, (
                f"{what}: {rule} {m:.4f} vs exact {r['specinfer_exact']:.4f}"
            )
        assert r["specinfer_exact"] <= r["bound"] + 1e-9
        if r["k"] == 1:
            assert abs(r["specinfer_exact"] - r["bound"]) < 1e-9, what
        d, d_se = r["deterministic"]
        assert abs(d - r["topk"]) <= 4 * d_se, f"{what}: ranked children accepted {d:.4f}, p(top-k) = {r['topk']:.4f}"


@pytest.mark.parametrize("shape,k", [("branchy", 3), ("deep", 2)])
def test_deeper_trees_keep_the_root_bound(shape, k):
    """The bound is per node: on trees two and three levels deep (``test_sampling_exact.SHAPES``) the
    root is still accepted at most α*(k_root) of the time, by both rules; traversal's gains lie below
    the root (a child it enters with α is accepted at or below it with probability α, as SpecInfer's
    child is accepted), so at the root the two rules accept alike: SpecInfer's exact one-level rate."""
    p, q = root_distributions("t1.0")
    bound = optimal_acceptance(p, q, k)
    exact = specinfer_acceptance((p / p.sum()).tolist(), (q / q.sum()).tolist(), k)
    for rule in ("specinfer", "traversal"):
        tree, _, _, best = sampled_trials(shape, "model", "t1.0", rule, None, n=N)
        assert int((tree.parents == 0).sum()) == k
        m, se = rate(best)
        assert m <= bound + 4 * se and abs(m - exact) <= 4 * se, (shape, rule, m, exact, bound)


def test_an_inexact_verifier_beats_the_bound(monkeypatch):
    """The check has teeth: SpecInfer without its residual (keep p after a rejection, a rule that is
    not exact: test_sampling_exact's first broken verifier) accepts MORE than any exact verifier can."""
    from treespec import verify

    p, q = root_distributions("t0.7")
    monkeypatch.setattr(verify, "_residual", lambda r, q: r)
    for k in (2, 3):
        m, se = rate(root_trials(k, "t0.7", "specinfer")[0])
        assert m > optimal_acceptance(p, q, k) + 4 * se, (k, m)  # measured: 0.892 > 0.878, 0.968 > 0.951
