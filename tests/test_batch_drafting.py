"""Batched drafting: every row's frontier in one draft forward (``plugins/eagle_rows.py``,
``plugins/model_rows.py``), driven by the rows' own builders side by side (``treespec.lockstep``).

The reference is each row's own drafter alone: a batched round (EAGLE head, draft model, self-draft)
must give every row the proposals its unbatched drafter gives it for the same tree (float64: the same tokens, q to
1e-9), through catch-ups of different lengths, levels of different widths, rows that sit a round
out, expansions whose ancestors were never fed, commits, and rows leaving the batch. Decoding with a
third-party builder (the example plugin's ``best-first``) stays lossless per row; a builder failing
in one row stops the batch with every row's output and unwinds the other rows' builders."""

from __future__ import annotations

import random

import pytest
import torch

import treespec
from conftest import STORIES260K, eagle_head_dir, tinystories_prompts
from treespec.interfaces import Commit, Expansion, PrefillContext
from treespec.tree import DraftTree


@pytest.fixture(scope="module")
def prompts():
    return tinystories_prompts(4, cut_words=6)


DRAFTERS = {
    "eagle": lambda: ("eagle", {"head": str(eagle_head_dir())}),
    "model": lambda: (str(STORIES260K), {"layers": 3}),
    "self": lambda: ("self", {"layers": 2}),
}


def _same(got, want):
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.q, want.q, atol=1e-9)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_batched_rows_give_each_row_what_its_own_drafter_gives(target64, prompts, kind):
    name, options = DRAFTERS[kind]()
    dec = treespec.Decoder(target64, drafter=name, drafter_options=options, builder="chain")
    base, rng = dec.drafter, random.Random(3)
    wants = base.needs_target_hidden
    ids = [dec.encode(p) for p in prompts[:3]] + [dec.encode(prompts[3])[:1]]  # a one-token prompt too
    group, singles = base.rows(len(ids)), [base.fork() for _ in ids]
    for row, single, p in zip(group.drafters, singles, ids):
        hidden = target64.prefill(torch.tensor(p[:-1]), want_hidden=True) if len(p) > 1 and wants else None
        ctx = PrefillContext(input_ids=torch.tensor(p), hidden=hidden)
        row.prefill(ctx)
        single.prefill(ctx)
    roots = [p[-1] for p in ids]
    for step in range(3):
        trees = [DraftTree(r) for r in roots]
        for i, root in enumerate(roots):
            group.drafters[i].begin_step(root)
            singles[i].begin_step(root)
        frontier = {i: torch.zeros(1, dtype=torch.long) for i in range(len(trees))}
        for level in range(4):
            if level == 2:  # a row sits this round out; another asks for grandchildren whose parents were never fed
                frontier.pop(1, None)
                if 0 in frontier and len(frontier[0]):
                    kids = trees[0].add_children(frontier[0][:1], torch.tensor([5]), torch.tensor([0.5]))
                    frontier[0] = trees[0].add_children(kids, torch.tensor([6]), torch.tensor([0.5]))
            requests = {i: Expansion(trees[i], nodes, 3) for i, nodes in frontier.items() if len(nodes)}
            got = group.expand_together(requests)
            for i, req in requests.items():
                want = singles[i].expand(trees[i], req.nodes, 3)
                _same(got[i], want)
                width = rng.randint(1, 3)
                frontier[i] = trees[i].add_children(
                    req.nodes.repeat_interleave(width),
                    got[i].tokens[:, :width].flatten(),
                    got[i].q[:, :width].flatten().clamp(min=1e-6),
                )
        for i, tree in enumerate(trees):  # accept a random path; any features stand in for the target's
            path = tree.ancestors[rng.randrange(len(tree))].nonzero().flatten()
            tokens = tree.tokens[path[1:]].tolist() + [rng.randrange(3, 500)]
            hidden = (
                torch.randn(
                    len(tokens),
                    target64.config.hidden_size,
                    dtype=torch.float64,
                    generator=torch.Generator().manual_seed(step * 10 + i),
                )
                if wants
                else None
            )
            group.drafters[i].commit(Commit(tokens=tokens, hidden=hidden))
            singles[i].commit(Commit(tokens=tokens, hidden=hidden))
            roots[i] = tokens[-1]
        if step == 1:  # row 1 finishes: the others go on
            group.keep([0, 2, 3])
            singles, roots = [singles[0], singles[2], singles[3]], [roots[0], roots[2], roots[3]]
    assert group.batched and len(group.drafters) == 3


def test_a_third_party_builder_drafts_in_a_batch_and_stays_lossless(target64, greedy_reference, prompts):
    dec = treespec.Decoder(
        target64,
        drafter="eagle",
        drafter_options={"head": str(eagle_head_dir())},
        builder="best-first",
        builder_options={"nodes": 6},
    )
    outs = dec.generate(prompts, max_new_tokens=40)
    for prompt, out in zip(prompts, outs):
        ids = dec.encode(prompt)
        assert out.token_ids == greedy_reference(ids, 40)
        alone = dec.generate(ids, max_new_tokens=40)
        assert [s.tree_size for s in out.stats.steps] == [s.tree_size for s in alone.stats.steps]
    assert sum(s.accepted for o in outs for s in o.stats.steps) > 0


class _Failing(treespec.TreeBuilder):
    """A chain builder (3 levels) that fails at the 12th expansion of the run: row 2's first in step 2."""

    calls: list[int] = []
    unwound: list[int] = []

    def build(self, drafter, root_token, max_depth):
        tree, node = DraftTree(root_token), torch.zeros(1, dtype=torch.long)
        try:
            for _ in range(min(3, max_depth)):
                _Failing.calls.append(1)
                if len(_Failing.calls) == 12:
                    raise RuntimeError("builder broke")
                prop = drafter.expand(tree, node, 1)
                node = tree.add_children(node, prop.tokens[:, 0], prop.q[:, 0].clamp(min=1e-6))
        finally:
            _Failing.unwound.append(1)
        return tree


def test_a_failing_builder_stops_the_batch_with_every_rows_output(target64, prompts):
    dec = treespec.Decoder(
        target64,
        drafter="eagle",
        drafter_options={"head": str(eagle_head_dir())},
        builder=_Failing(treespec.config.PluginConfig()),
    )
    _Failing.calls.clear()
    _Failing.unwound.clear()
    with pytest.raises(treespec.DecodingError, match="builder broke") as info:
        dec.generate(prompts[:3], max_new_tokens=20)
    outs = info.value.outputs
    assert len(outs) == 3 and all(o.stats.stop_reason == "error" for o in outs)
    assert all(len(o.token_ids) >= 1 for o in outs)  # the first step's tokens are kept
    assert (
        len(_Failing.unwound) == 6
    )  # 3 rows finished step 1, then all 3 builders of step 2 left (one raised, two unwound)


def test_the_rows_auto_planners_share_one_shape_per_step(target64, greedy_reference, prompts):
    """An auto batch's rows share one BatchPlan (and one calibration map): in every step every row verifies the same number of
    nodes (the chain's N, or fewer only where its drafting found fewer), no row decodes plainly while
    another speculates, and every row stays lossless."""
    import numpy as np

    dec = treespec.Decoder(
        target64,
        drafter=str(STORIES260K),
        drafter_options={"layers": 3},
        builder="opt-tree",
        builder_options={"nodes": "auto"},
    )
    outs = dec.generate(prompts, max_new_tokens=48)
    builders = dec._row_builders[len(prompts)]
    plan = builders[0].planner.plan
    assert plan is not None and all(b.planner.plan is plan for b in builders)
    # one calibration map for the batch: every row learns into it
    first = builders[0]
    assert all(b.calibration is first.calibration is b.planner.calibration for b in builders)
    assert all(b.batch_size == len(prompts) and b.planner.cost.key.get("batch") == len(prompts) for b in builders)
    steps = min(len(o.stats.steps) for o in outs)
    done = [[sum(s.emitted for s in o.stats.steps[:k]) for k in range(steps)] for o in outs]  # tokens before step k
    for k in range(steps):
        # rows with room for a tree (a row one token from its end verifies its root alone, whatever the shape)
        sizes = [o.stats.steps[k].tree_size for o, d in zip(outs, done) if 48 - d[k] > 1]
        assert not sizes or (min(sizes) == 0) == (max(sizes) == 0), (k, sizes)  # all plain or none
    assert plan.steps >= steps - 1  # the plan started a step for every step of the batch
    assert plan.predicted > 0  # and priced its chains by the batch's cost curves
    assert plan.gains.size >= 1 and np.all((plan.gains >= 0) & (plan.gains <= 1))  # p̄ at each depth drafted
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(dec.encode(prompt), 48)


def test_rows_with_long_catch_ups_feed_them_alone_and_give_the_same_proposals(
    target64, greedy_reference, prompts, monkeypatch
):
    """A prompt joining a running batch feeds its hundreds of items in a forward of its own
    (``RowsCache.alone``): with the thresholds lowered so that every longer-than-median catch-up goes
    alone, the EAGLE rounds still equal each row's own drafter, and continuous batching with EAGLE and
    draft-model rows (whose newcomers feed their prompts alone) stays lossless."""
    from treespec.plugins.eagle_rows import EagleRows
    from treespec.plugins.model_rows import ModelRows
    from treespec.rows_cache import RowsCache

    monkeypatch.setattr(RowsCache, "ALONE_MIN", 1)
    monkeypatch.setattr(RowsCache, "ALONE_RATIO", 1)
    alone = []
    for cls, name in ((EagleRows, "_catch_up_alone"), (ModelRows, "_pending_alone")):
        orig = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, i, orig=orig: (alone.append(i), orig(self, i))[1])
    test_batched_rows_give_each_row_what_its_own_drafter_gives(target64, prompts, "eagle")
    assert alone
    ids = None
    for kind in ("eagle", "model"):
        alone.clear()
        name, options = DRAFTERS[kind]()
        dec = treespec.Decoder(
            target64, drafter=name, drafter_options=options, builder="opt-tree", builder_options={"nodes": 8}
        )
        ids = ids or [dec.encode(p) for p in tinystories_prompts(5, cut_words=12)]
        outs = dec.generate(ids, max_new_tokens=30, batch_size=2)  # newcomers join with their whole prompt pending
        assert alone, kind
        for p, out in zip(ids, outs):
            assert out.token_ids == greedy_reference(p, 30), kind
