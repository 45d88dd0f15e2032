"""Block verification (``treespec.block_verify``, rule ``block``; ``auto`` on chains) is exact, accepts at
least as much as token-level verification on the same chains, and broken variants of it are caught.

The harness is ``test_sampling_exact``'s: random-weight float64 Llamas with V = 8, every emitted
sequence (completed by exact sampling from the target) checked against the target's exact
distribution over all V^L continuations (chi-square, α = 1e-6, fixed seeds); chains with ranked
children (the draft's top-1: Q = a point mass) and with children drawn from the draft."""

from __future__ import annotations

import pytest
import torch
from sampling_stats import ALPHA, fit
from test_sampling_exact import SHAPES, ranked_trials, sampled_trials

import treespec.block_verify as bv

SHAPES.setdefault("chain-3", [[0], [0, 0], [0, 0, 0]])

RANKED = [  # (builder, draft, setting, rule)
    ("chain", "model", "t0.7", "block"),
    ("chain", "zero", "t1.0-top_k5", "auto"),
    ("chain", "identical", "t1.5", "block"),
    ("chain", "model", "t0.7-top_p0.9", "block"),
    ("opt-tree", "model", "t1.0-top_k5", "block"),  # a tree with branches: token by token, still exact
]
SAMPLED = [  # (shape, draft, setting, rule, draft temperature)
    ("chain-2", "model", "t1.0", "block", None),
    ("chain-3", "model", "t0.7-top_p0.9", "auto", None),
    ("chain-3", "zero", "t1.5", "block", 0.5),
    ("chain-3", "identical", "t0.3", "block", 1.0),  # draft temperature 1: q is exactly p
    ("branchy", "model", "t1.0", "block", None),
]


@pytest.mark.parametrize("builder_key,draft,setting,rule", RANKED)
def test_block_rule_on_ranked_chains_is_exact(builder_key, draft, setting, rule):
    tree, seqs, tables, _ = ranked_trials(builder_key, draft, setting, rule)
    assert fit(seqs, tables)[2] >= ALPHA, f"{builder_key}/{draft}/{setting}/{rule}"


@pytest.mark.parametrize("shape,draft,setting,rule,draft_t", SAMPLED)
def test_block_rule_on_sampled_chains_is_exact(shape, draft, setting, rule, draft_t):
    tree, seqs, tables, best = sampled_trials(shape, draft, setting, rule, draft_t)
    assert fit(seqs, tables)[2] >= ALPHA, f"{shape}/{draft}/{setting}/{rule}"
    if draft == "identical":  # q = p: the whole block is always kept
        assert bool((tree.depths[best] == tree.depth).all())


@pytest.mark.parametrize(
    "case", [("chain-3", "model", "t1.0", None), ("chain-3", "zero", "t0.7", 0.5), ("chain-2", "model", "t1.5", None)]
)
def test_block_accepts_at_least_what_token_level_accepts(case):
    """The paper's optimality: never worse than token-level speculative sampling (same chains, same
    seeds; 40,000 trials each, a standard error of about 0.005 tokens)."""
    shape, draft, setting, draft_t = case
    block = sampled_trials(shape, draft, setting, "block", draft_t)
    token = sampled_trials(shape, draft, setting, "specinfer", draft_t)
    depth_block = block[0].depths[block[3]].double().mean()
    depth_token = token[0].depths[token[3]].double().mean()
    assert depth_block >= depth_token - 0.02, (case, float(depth_block), float(depth_token))


def test_ranked_chain_block_accepts_at_least_the_deterministic_rule():
    block = ranked_trials("chain", "model", "t1.0-top_k5", "block")
    token = ranked_trials("chain", "model", "t1.0-top_k5", "deterministic")
    assert block[0].depths[block[3]].double().mean() >= token[0].depths[token[3]].double().mean() - 0.02


def test_broken_block_rules_fail_the_same_checks(monkeypatch):
    """Each broken variant fails the check the rule passes, on the same chain and seeds."""
    case = ("chain-3", "model", "t0.7-top_p0.9", "block", None)
    ok = sampled_trials(*case)
    assert fit(ok[1], ok[2])[2] >= ALPHA
    broken = {
        # stop wherever a residual exists, ignoring the mass the path kept (h_i = 1)
        "stop weight without 1 - p": ("stop_weight", lambda s, p: torch.where(s > 0, 1.0, 0.0).to(s)),
        # after stopping, emit from the target's distribution instead of the residual
        "bonus from P": ("block_residual", lambda p, P, Q: P.clone()),
        # the residual without the path's mass: token level's [P - Q]+ with block's stop weights
        "residual without p": ("block_residual", lambda p, P, Q: (P - Q).clamp(min=0.0)),
    }
    for name, (attr, fn) in broken.items():
        with monkeypatch.context() as m:
            m.setattr(bv, attr, fn)
            bad = sampled_trials(*case)
        stat, df, pvalue, _ = fit(bad[1], bad[2])
        assert pvalue < ALPHA, f"{name}: the broken rule passed (X² = {stat:.1f} on {df} df, p = {pvalue:.3g})"
