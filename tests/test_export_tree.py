"""The trees `treespec export` recommends (treespec/export/tree.py, plan.py): optimal against brute
force on small budgets, in the family each engine runs, and the tree strings vLLM parses back to the
same trees (vLLM's own reading: ``ast.literal_eval`` + breadth-first sort, vllm/v1/attention/backends/
tree_attn.py ``TreeDrafterParams.from_spec_token_tree``)."""

from __future__ import annotations

import ast

import pytest

from treespec.cost import CostModel
from treespec.errors import ConfigError
from treespec.export import plan as plans
from treespec.export import tree as trees

P = [[0.62, 0.14, 0.06, 0.03, 0.01], [0.55, 0.12, 0.05, 0.02], [0.5, 0.1, 0.04], [0.45, 0.08]]


def all_trees(max_nodes: int, ranks: int = 4, depth: int = 4) -> list[tuple[tuple[int, ...], ...]]:
    """Every rank-path tree of at most ``max_nodes`` nodes (children take ranks 0, 1, ... in order)."""

    def children(budget: int, d: int, rank: int) -> list[list[tuple[int, ...]]]:
        out: list[list[tuple[int, ...]]] = [[]]  # no more children
        if d == 0 or rank >= ranks:
            return out
        for size in range(1, budget + 1):
            for below in children(size - 1, d - 1, 0):  # the rank's own subtree
                if len(below) != size - 1:
                    continue
                for rest in children(budget - size, d, rank + 1):
                    out.append([(rank,)] + [(rank,) + p for p in below] + rest)
        return out

    return [tuple(t) for t in children(max_nodes, depth, 0) if t]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_the_optimum_and_the_vllm_tree_beat_every_tree_of_their_family(n):
    best = max(trees.value(t, P) for t in all_trees(n))
    assert trees.optimal_tree(P, n).expected_accepted == pytest.approx(best)
    uniform = max(trees.value(t, P) for t in all_trees(n) if trees.uniform_branching(t))
    got = trees.vllm_tree(P, n)
    assert trees.uniform_branching(got.paths) and got.nodes <= n
    assert got.expected_accepted == pytest.approx(uniform)


@pytest.mark.parametrize("n", [1, 4, 9, 16, 30])
def test_tree_strings_parse_back_as_vllm_reads_them(n):
    for t in (trees.optimal_tree(P, n), trees.vllm_tree(P, n), trees.chain(P, min(n, 6))):
        s = trees.to_vllm_string(t.paths)
        vllm = sorted(ast.literal_eval(s), key=lambda x: (len(x), x))  # what vLLM does with the string
        assert tuple(vllm) == t.paths == trees.parse_vllm_string(s)
    assert trees.to_vllm_string(((0,), (0, 0), (1,))) == "[(0,), (1,), (0, 0)]"


def test_bad_tree_strings_are_one_line():
    for bad in ("[(0,), (1, 0)]", "[0, 1]", "((", "[]"):
        with pytest.raises(ConfigError) as exc:
            trees.parse_vllm_string(bad)
        assert "\n" not in str(exc.value)


def test_sglang_shapes_replay_eagle2_selection():
    t = trees.sglang_tree(P, steps=3, topk=2, draft_tokens=6)  # 5 drafted nodes of the 2 + 4 + 4 candidates
    assert t.nodes == 5 and all(len(p) == 1 or p[:-1] in t.paths for p in t.paths)
    chain = trees.sglang_tree(P, steps=4, topk=1, draft_tokens=5)
    assert chain.paths == trees.chain(P, 4).paths
    shape = trees.sglang_shape(P, 8)
    assert (
        shape.draft_tokens - 1 <= 8
        and shape.tree.expected_accepted >= trees.chain(P, min(8, 8)).expected_accepted - 1e-9
    )


def test_plan_prices_sizes_with_a_cost_profile():
    cost = CostModel()
    for n in (0, 1, 2, 4, 8, 16, 32):
        cost.verify.observe(n, 0.05 + 0.004 * n)  # seconds: a step that grows with its tree
        cost.bookkeeping.observe(n, 0.0005)
    for m in (1, 2, 4, 8, 16):
        cost.expand.observe(m, 0.004 + 0.0002 * m)
    cost.first.observe(1, 0.005)
    got = plans.plan(P, 32, cost)
    sizes = [plans.rate(cost, trees.optimal_tree(P, n)) for n in range(1, 33)]
    assert got.rates["optimum"] == pytest.approx(max(sizes))
    assert got.plain_rate == pytest.approx(1 / 0.0505)
    free = plans.plan(P, 32)  # no profile: the budget, and a chain cut where a node adds < 0.05
    assert free.optimum.nodes == 32 and free.chain.nodes == 4  # gains .62, .34, .17, .077, then .035


def _cost(batch: int, fixed: float, per_node: float) -> CostModel:
    cost = CostModel(key={"batch": batch} if batch > 1 else {})
    for n in (0, 1, 2, 4, 8, 16, 32):
        cost.verify.observe(n, fixed + per_node * n)
        cost.bookkeeping.observe(n, 0.0005)
    for m in (1, 2, 4, 8, 16):
        cost.expand.observe(m, 0.002)
    cost.first.observe(1, 0.002)
    return cost


def test_batch_buckets_shrink_trees_as_nodes_get_dearer_and_slots_follow_sglang_s_rules():
    """One plan per profiled batch size: where a node costs more (a fuller batch), the best chain is no
    longer; SGLang's adaptive slots hold the chain lengths within ADAPTIVE_WITHIN of the bucket's best,
    without gaps, and the file reads as SGLang reads it (digit keys; a batch of bs takes the largest key
    ≤ bs; --speculative-num-steps one of the candidates; adaptive_spec_params.py, SGLang 0.5.23)."""
    from treespec.export import sglang

    costs = [_cost(8, 0.05, 0.02), _cost(1, 0.05, 0.0005), _cost(4, 0.05, 0.004)]  # any order
    got = plans.buckets(P, 8, costs)
    assert [b.batch for b in got] == [1, 4, 8]
    chains = [b.plan.chain.nodes for b in got]
    assert chains == sorted(chains, reverse=True) and chains[0] > chains[-1], chains
    for b in got:
        cost = next(c for c in costs if plans.batch_of(c) == b.batch)
        rates = [1 / cost.plain_seconds()] + [plans.rate(cost, trees.chain(P, k)) for k in range(1, 9)]
        assert b.chain_rates == pytest.approx(rates)
        steps = plans.adaptive_steps(b)
        best = max(range(len(rates)), key=rates.__getitem__)
        assert best in steps and steps == list(range(steps[0], steps[-1] + 1))
        assert all(rates[k] >= plans.ADAPTIVE_WITHIN * rates[best] for k in (steps[0], steps[-1]))
        assert all(rates[k] < plans.ADAPTIVE_WITHIN * rates[best] for k in (steps[0] - 1, steps[-1] + 1) if 0 <= k < 9)
    slots = {b.batch: plans.adaptive_steps(b) for b in got}
    config = sglang.adaptive_config(slots)
    assert all(k.isdigit() and v["candidate_steps"] for k, v in config.items())

    def route(bs: int) -> list[int]:  # SGLang's rule: the largest key <= bs, else the smallest key
        keys = sorted(int(k) for k in config)
        return config[str(max([k for k in keys if k <= bs], default=keys[0]))]["candidate_steps"]

    assert route(1) == slots[1] and route(3) == slots[1] and route(7) == slots[4] and route(64) == slots[8]
    start = sglang.adaptive_start(slots)
    assert start in {s for v in slots.values() for s in v} and start == max(slots[1])
    assert sglang.adaptive_start({1: [0], 4: [0]}) is None  # nothing pays: no adaptive mode
