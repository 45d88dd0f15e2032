"""Traversal verification (``treespec.traversal_verify``, rule ``traversal``) is exact on ranked, sampled
and mixed trees, accepts at least what SpecInfer's token-level rule accepts on the same sampled trees
(and what block verification accepts on chains, where the two coincide), and broken variants of it
are caught by the same check.

The harness is ``test_sampling_exact``'s: random-weight float64 Llamas with V = 8, every emitted
sequence (completed by exact sampling from the target) checked against the target's exact
distribution over all V^L continuations (chi-square, α = 1e-6, fixed seeds, 40,000 trials a case)."""

from __future__ import annotations

import pytest
import torch
from sampling_stats import ALPHA, assert_exact, complete, emitted, fit
from test_sampling_exact import (
    DRAFT_NOISE,
    N_TRIALS,
    PROMPT,
    SETTINGS,
    SHAPES,
    TARGET_SEED,
    draw_trials,
    ranked_trials,
    sampled_trials,
    target_tables,
    tiny,
)

import treespec.traversal_verify as tv
from treespec.sampling import make_generator
from treespec.verify import verify_batch

SHAPES.setdefault("chain-3", [[0], [0, 0], [0, 0, 0]])
SHAPES.setdefault("binary", [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 0, 1], [1, 0, 0]])

RANKED = [  # (builder, draft, setting)
    ("opt-tree", "model", "t0.7"),
    ("opt-tree", "zero", "t1.0-top_k5"),
    ("opt-tree", "identical", "t0.7-top_p0.9"),
    ("chain", "model", "t1.5"),
    ("chain", "zero", "t0.3"),
    ("static", "model", "t1.5-top_k5-top_p0.9"),
    ("eagle2", "zero", "t1.0"),
]
SAMPLED = [  # (shape, draft, setting, draft temperature: None = the target's)
    ("chain-2", "model", "t1.0", None),
    ("chain-3", "model", "t0.7-top_p0.9", None),
    ("chain-3", "zero", "t1.5", 0.5),
    ("chain-3", "identical", "t0.3", 1.0),  # draft temperature 1: q is exactly the target's p
    ("branchy", "model", "t0.7-top_p0.9", None),
    ("branchy", "zero", "t1.0", None),
    ("branchy", "identical", "t1.5-top_k5-top_p0.9", 1.0),
    ("deep", "model", "t0.3", None),
    ("deep", "model", "t1.0-top_k5", 0.5),
    ("deep", "zero", "t0.7", 1.5),
    ("binary", "model", "t1.5", None),
    ("binary", "identical", "t1.0", 1.0),
]


def mean_depth(trials) -> tuple[float, float]:
    """(mean accepted depth, its standard error) of ``ranked_trials``/``sampled_trials``' output."""
    depth = trials[0].depths[trials[3]].double()
    return float(depth.mean()), float(depth.std() / depth.numel() ** 0.5)


@pytest.mark.parametrize("builder_key,draft,setting", RANKED)
def test_traversal_on_ranked_trees_is_exact(builder_key, draft, setting):
    _, seqs, tables, _ = ranked_trials(builder_key, draft, setting, "traversal")
    assert_exact(seqs, tables, f"{builder_key}/{draft}/{setting}/traversal")


@pytest.mark.parametrize("shape,draft,setting,draft_t", SAMPLED)
def test_traversal_on_sampled_trees_is_exact(shape, draft, setting, draft_t):
    tree, seqs, tables, best = sampled_trials(shape, draft, setting, "traversal", draft_t)
    assert_exact(seqs, tables, f"{shape}/{draft}/{setting}/traversal/draft_t={draft_t}")
    if draft == "identical":  # q = p: the first leaf in post-order (here the deepest) always passes
        assert bool((tree.depths[best] == tree.depth).all())


def mixed_trials(shape: str, draft: str, setting: str, ranked: set[int], seed: int = 0, n: int = N_TRIALS):
    """``draw_trials`` on a tree in which the nodes ``ranked`` have their draft's top-k as children
    (no recorded draw: point masses) and every other inner node children drawn without replacement;
    the same trees verified by traversal and by SpecInfer's rule."""
    tree, tt, tokens, probs, dists, tables, _ = draw_trials(
        SHAPES[shape], draft, setting, None, seed, n, frozenset(ranked)
    )
    length = tree.depth + 1
    out = {}
    for rule in ("traversal", "specinfer"):
        g = make_generator(seed + 1, "cpu")
        best, bonus = verify_batch(tt, tokens, probs.float(), g, rule, dists)
        out[rule] = (tree, complete(emitted(tt, tokens, best, bonus, length), tables, g), tables, best)
    return out


@pytest.mark.parametrize(
    "shape,draft,setting,ranked",
    [
        ("branchy", "model", "t1.0", {0}),  # the root's children ranked
        ("deep", "model", "t0.7-top_p0.9", {1, 3}),
    ],
)  # the root's sampled
def test_traversal_on_mixed_trees_is_exact(shape, draft, setting, ranked):
    """Some nodes' children ranked (point masses), the others' sampled, in one tree."""
    out = mixed_trials(shape, draft, setting, ranked)
    for rule, trials in out.items():
        assert_exact(trials[1], trials[2], f"mixed {shape}/{draft}/{setting}/{rule}")
    (t, t_se), (s, s_se) = mean_depth(out["traversal"]), mean_depth(out["specinfer"])
    assert t >= s - 2 * (t_se**2 + s_se**2) ** 0.5, (t, s)


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory) -> str:
    """The noisy draft model on disk, for the real ``model`` drafter."""
    path = tmp_path_factory.mktemp("tiny-draft")
    tiny(TARGET_SEED, DRAFT_NOISE).save_pretrained(path)
    return str(path)


def test_decoder_with_the_traversal_rule(draft_path):
    """Whole seeded ``generate`` calls (static sample=true, the real model drafter): the first two
    tokens fit the target's."""
    from treespec import Decoder, TargetModel

    params = SETTINGS["t0.7-top_p0.9"]
    dec = Decoder(
        TargetModel(tiny(TARGET_SEED)),
        drafter=draft_path,
        builder="static",
        builder_options={"shape": "[[0],[1],[0,0],[0,1],[1,0]]", "sample": True},
    )
    kw = {"temperature": params.temperature, "top_p": params.top_p, "rule": "traversal"}
    seqs, accepted = [], 0
    for seed in range(1500):
        out = dec.generate(PROMPT, max_new_tokens=2, seed=seed, **kw)
        seqs.append(out.token_ids)
        accepted += out.stats.steps[0].accepted
    assert_exact(torch.tensor(seqs), target_tables(params, 2), "Decoder static sample=true/traversal")
    assert accepted > 1500 * 0.3


# ----------------------------------------------------------------------------------------- acceptance
GAINS = [  # (shape, draft, setting, draft temperature, the least gain over specinfer asserted)
    ("deep", "model", "t1.0", None, 0.03),  # measured: 1.423 vs 1.346
    ("binary", "model", "t1.5", None, 0.05),  # 1.979 vs 1.855
    ("branchy", "zero", "t1.0", None, 0.0),  # 0.548 vs 0.544
    ("branchy", "model", "t0.7-top_p0.9", None, 0.0),  # 1.143 vs 1.140
]


@pytest.mark.parametrize("shape,draft,setting,draft_t,gain", GAINS)
def test_traversal_accepts_at_least_specinfer(shape, draft, setting, draft_t, gain):
    """Same sampled trees and seeds (the trees are drawn before verification, so both rules see the
    same ones); tolerance: two standard errors of the difference (≈ 0.007 tokens)."""
    (t, t_se), (s, s_se) = (
        mean_depth(sampled_trials(shape, draft, setting, rule, draft_t)) for rule in ("traversal", "specinfer")
    )
    assert t >= s + gain - 2 * (t_se**2 + s_se**2) ** 0.5, (shape, draft, setting, t, s)


@pytest.mark.parametrize(
    "shape,draft,setting,draft_t", [("chain-3", "model", "t1.0", None), ("chain-3", "zero", "t0.7", 0.5)]
)
def test_traversal_is_block_verification_on_chains(shape, draft, setting, draft_t):
    (t, t_se), (b, b_se) = (
        mean_depth(sampled_trials(shape, draft, setting, rule, draft_t)) for rule in ("traversal", "block")
    )
    assert abs(t - b) <= 2 * (t_se**2 + b_se**2) ** 0.5, (shape, t, b)


def test_ranked_trees_accept_as_much_as_the_deterministic_rule():
    """With point-mass proposals no exact rule can accept a path more often than the target generates
    it, and the token-level rule already does: the two agree within noise."""
    (t, t_se), (d, d_se) = (
        mean_depth(ranked_trials("opt-tree", "model", "t1.0-top_k5", rule)) for rule in ("traversal", "deterministic")
    )
    assert abs(t - d) <= 2 * (t_se**2 + d_se**2) ** 0.5, (t, d)


def test_identical_drafts_keep_the_whole_chain():
    for setting in ("t0.7", "t1.5-top_k5-top_p0.9"):
        tree, _, _, best = sampled_trials("chain-3", "identical", setting, "traversal", 1.0, n=5000)
        assert bool((best == len(tree) - 1).all()), setting


# ----------------------------------------------------------------------------------------- broken variants
def _ratio_without_accumulation(m: torch.Tensor, Q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """BROKEN: min(1, R(x)/Q(x)) with the parent's normalised distribution, forgetting its kept mass α."""
    r = m / m.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    return (r.gather(1, x[:, None]).squeeze(1) / Q.gather(1, x[:, None]).squeeze(1)).clamp(max=1.0)


def _residual_keeping_alpha(m: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """BROKEN: the parent's distribution becomes the residual, but its mass α is not updated."""
    over = (m - Q).clamp(min=0.0)
    mass = over.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, over / mass.clamp(min=1e-300) * m.sum(dim=-1, keepdim=True), m)


BROKEN = {
    "parent not updated after a deletion": ("reject_child", lambda m, Q: m),
    "bonus from the target p": ("bonus_distribution", lambda res, target, inner: target),
    "ratio without the accumulated factor": ("child_ratio", _ratio_without_accumulation),
    "residual updated, mass α not": ("reject_child", _residual_keeping_alpha),
}


@pytest.mark.parametrize("kind", ["sampled", "ranked"])
def test_broken_traversal_rules_fail_the_same_checks(kind, monkeypatch):
    """Each broken variant fails the check the rule passes, on the same trees and seeds."""

    def run():
        if kind == "sampled":
            return sampled_trials("deep", "model", "t1.0", "traversal", None)
        return ranked_trials("opt-tree", "model", "t0.7", "traversal")

    ok = run()
    assert fit(ok[1], ok[2])[2] >= ALPHA
    for name, (attr, fn) in BROKEN.items():
        with monkeypatch.context() as m:
            m.setattr(tv, attr, fn)
            bad = run()
        stat, df, pvalue, _ = fit(bad[1], bad[2])
        assert pvalue < ALPHA, f"{kind}, {name}: the broken rule passed (X² = {stat:.1f} on {df} df, p = {pvalue:.3g})"
