"""The block drafter under sampling is exact (``test_sampling_exact``'s enumeration harness, V = 8).

A real ``BlockDrafter`` (a random-weight block network, K = 3) drafts for the harness's tiny target,
prefilled with the target's own hidden states of PROMPT. Its marginals are path-blind: every node at
depth d is offered Q_{d+1}. Checked, each against the target's exact distribution over the first
tokens (chi-square, α = 1e-6, fixed seeds):
- ranked trees (the marginals' top-k, treated by the rules as point masses) under auto,
  deterministic and target-only;
- sampled trees (opt-tree and eagle2 with sample=true: children drawn from the marginal of their
  depth, ``distribution``) under auto, specinfer and traversal;
- and the mistake the issue warns of, verifying RANKED children with min(1, p/q) as if they had been
  drawn from the marginals, fails the same check.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from sampling_stats import ALPHA, assert_exact, complete, emitted
from test_sampled_opt_tree import build_trees, exactness, verify_trees
from test_sampling_exact import N_TRIALS, PROMPT, SETTINGS, TARGET_SEED, ranked_trials, target_tables, tiny

from treespec import DraftTree, TargetModel
from treespec.factory import make_builder
from treespec.interfaces import PrefillContext
from treespec.plugins.block import BlockDrafter
from treespec.plugins.block_head import BlockHead, BlockSpec
from treespec.plugins.configs import BlockConfig
from treespec.plugins.eagle3_head import default_layers
from treespec.plugins.eagle_head import head_config_for
from treespec.sampling import make_generator
from treespec.verify import verify_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def block_drafter(folder: str) -> BlockDrafter:
    """A random block network for the tiny target, saved to ``folder`` and loaded as drafter `block`,
    prefilled with PROMPT."""
    model = tiny(TARGET_SEED)
    cfg = model.config
    torch.manual_seed(7)
    spec = BlockSpec(3, default_layers(cfg.num_hidden_layers), cfg.hidden_size, cfg.vocab_size, cfg.vocab_size, True)
    head = BlockHead(head_config_for(cfg, layers=1), spec)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else p.add_(torch.randn_like(p))
    head.save(folder)
    target = TargetModel(model)
    d = BlockDrafter(BlockConfig(head=folder), target)
    with torch.inference_mode():
        hs = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    fused = torch.cat([hs[i][0] for i in d.target_hidden_layers], -1)[:-1]  # [len(PROMPT) − 1, k·H]
    d.prefill(PrefillContext(input_ids=torch.tensor(PROMPT), hidden=fused))
    return d


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    d = block_drafter(str(tmp_path_factory.mktemp("block")))
    q = d.distribution(DraftTree(PROMPT[-1]), torch.tensor([0]))
    assert 0.05 < float(q.max()) < 0.95  # a spread distribution: neither uniform nor one-hot
    return d


@pytest.mark.parametrize(
    "builder_key, setting, rule",
    [
        ("opt-tree", "t0.7", "auto"),
        ("chain", "t1.0", "deterministic"),
        ("eagle2", "t1.5", "target-only"),
        ("static", "t0.7-top_p0.9", "auto"),
    ],
)
def test_ranked_block_trees_are_exact(drafter, builder_key, setting, rule):
    tree, seqs, tables, best = ranked_trials(builder_key, "model", setting, rule, source=drafter)
    assert tree.size >= 3
    assert_exact(seqs, tables, f"block/{builder_key}/{setting}/{rule}")


@pytest.mark.parametrize("builder_key, setting, draft_t", [("opt-tree", "t1.0", None), ("eagle2", "t0.7", 1.0)])
def test_sampled_block_trees_are_exact(drafter, builder_key, setting, draft_t):
    trees, _ = build_trees(builder_key, "model", setting, draft_t, 3000, source=drafter)
    assert all(t.draw_row is not None for t in trees)
    out, tables = verify_trees(trees, setting)
    for rule, (seqs, depths) in out.items():
        pvalue, how = exactness(seqs, tables)
        assert pvalue >= ALPHA, f"block/{builder_key} sample=true/{setting}/{rule}: {how}"
        assert float(depths.mean()) > 0.1  # drafts do get accepted


def test_ranked_children_verified_as_draws_from_the_marginals_are_caught(drafter):
    """The top-k of the marginals are not draws from them: min(1, p/q) with q = the marginal (specinfer
    told that every node's children were drawn from its ``distribution``) is biased, and caught."""
    setting = "t1.0"
    params = SETTINGS[setting]
    builder = make_builder("opt-tree", {"nodes": 6, "threshold": 0.0, "max_depth": 2})
    builder.start(None)
    tree = builder.build(drafter, PROMPT[-1], max_depth=3)
    nodes = torch.arange(len(tree))
    dists = drafter.distribution(tree, nodes).double()  # [N, V]: what the WRONG rule takes as q
    tt = dataclasses.replace(tree.tensors(len(PROMPT) - 1, dtype=torch.float64), draw_row=nodes.clone())
    from test_sampling_exact import target_probs

    _, probs = target_probs(tree, params)
    length = tree.depth + 1
    tables = target_tables(params, length)
    gen = make_generator(3, "cpu")
    tokens = tt.input_ids[None].expand(N_TRIALS, -1)
    best, bonus = verify_batch(
        tt, tokens, probs[None].expand(N_TRIALS, -1, -1), gen, "specinfer", dists[None].expand(N_TRIALS, -1, -1)
    )
    seqs = complete(emitted(tt, tokens, best, bonus, length), tables, gen)
    pvalue, how = exactness(seqs, tables)
    assert pvalue < ALPHA, f"the wrong rule passed: {how}"
