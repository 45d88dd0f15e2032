"""The trees an export recommends, from a depth-by-rank measurement and (optionally) a cost profile.

Without a profile the budget is ``nodes`` drafted nodes and each engine gets its best tree of at most
that many (a chain stops where one more node adds less than ``MIN_GAIN`` expected tokens). With a
profile (``treespec profile --out FILE``: treespec's measured seconds for verifying n nodes and
expanding m nodes at once on this machine) every size up to the budget is priced as

    T(tree) = verify(n) + bookkeeping(n) + first + Σ_{levels ≥ 2} expand(nodes expanded at that level)

and the one with the most expected tokens per second, (1 + E(A)) / T, is kept; plain decoding
(1 / T(0)) is reported beside it. These are treespec's costs: an engine's kernels differ, so the
figure ranks shapes, it does not predict the engine's throughput.

Batch-size buckets: a profile measured with ``treespec profile --batch-size B`` prices one row of B rows
decoded together (a verified node costs the batch's forward, shared out). Given several profiles, one
plan per batch size (``buckets``): trees shrink as the batch fills the machine. SGLang's adaptive mode
(``--speculative-adaptive``, topk 1) takes them as slots of chain lengths per batch-size range
(``adaptive_steps``; ``treespec.export.sglang.adaptive_config`` writes the file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treespec.export import tree as trees

MIN_GAIN = 0.05  # a chain's next node must add this many expected tokens (no profile)
ADAPTIVE_WITHIN = 0.9  # SGLang adaptive slots: the chain lengths predicted within 10% of the bucket's best


@dataclass
class Plan:
    chain: trees.Tree  # vLLM 0.32 (no trees) and SGLang topk = 1: num_speculative_tokens = its length
    vllm_tree: trees.Tree  # vLLM releases with tree attention: one branching factor per level
    optimum: trees.Tree  # OPT-Tree's optimum (any shape): treespec's static builder runs it
    sglang: trees.SGLangShape
    rates: dict[str, float | None]  # predicted tokens/s under treespec's profile (None: no profile)
    plain_rate: float | None

    def summary(self) -> dict[str, Any]:
        def one(t: trees.Tree) -> dict[str, Any]:
            return {
                "nodes": t.nodes,
                "depth": t.depth,
                "expected_accepted": round(t.expected_accepted, 4),
                "tau": round(1 + t.expected_accepted, 4),
                "paths": [list(p) for p in t.paths],
            }

        return {
            "chain": one(self.chain),
            "vllm_tree": {**one(self.vllm_tree), "speculative_token_tree": trees.to_vllm_string(self.vllm_tree.paths)},
            "optimum": {**one(self.optimum), "speculative_token_tree": trees.to_vllm_string(self.optimum.paths)},
            "sglang": {
                "steps": self.sglang.steps,
                "topk": self.sglang.topk,
                "num_draft_tokens": self.sglang.draft_tokens,
                **one(self.sglang.tree),
            },
            "predicted_tokens_per_second": {**self.rates, "plain": self.plain_rate},
        }


def _level_widths(t: trees.Tree) -> list[int]:
    """Nodes expanded at each level: the root, then every node that has children."""
    parents: dict[int, set[tuple[int, ...]]] = {}
    for path in t.paths:
        parents.setdefault(len(path), set()).add(path[:-1])
    return [len(parents[d]) for d in sorted(parents)]


def seconds(cost: Any, t: trees.Tree) -> float:
    """Treespec's predicted seconds for one step verifying tree ``t`` (module docstring)."""
    widths = _level_widths(t)
    draft = (cost.first.predict(1) if widths else 0.0) + sum(cost.expand.predict(w) for w in widths[1:])
    return cost.verify.predict(t.nodes) + cost.bookkeeping.predict(t.nodes) + draft


def rate(cost: Any, t: trees.Tree) -> float:
    return (1.0 + t.expected_accepted) / max(seconds(cost, t), 1e-9)


def _best(candidates: Sequence[trees.Tree], cost: Any | None) -> trees.Tree:
    if cost is None:
        return candidates[-1]
    return max(candidates, key=lambda t: (round(rate(cost, t), 6), -t.nodes))


def plan(p: Sequence[Sequence[float]], nodes: int, cost: Any | None = None, max_depth: int = 12) -> Plan:
    """The recommended trees of at most ``nodes`` drafted nodes (module docstring)."""
    sizes = range(1, nodes + 1)
    chains = [trees.chain(p, k) for k in range(1, min(nodes, max_depth) + 1)]
    if cost is None:  # the longest chain whose every node still adds MIN_GAIN
        k = 1
        while k < len(chains) and chains[k].expected_accepted - chains[k - 1].expected_accepted >= MIN_GAIN:
            k += 1
        chain = chains[k - 1]
    else:
        chain = _best(chains, cost)
    optimum = _best([trees.optimal_tree(p, n, max_depth) for n in sizes], cost)
    vtree = _best([trees.vllm_tree(p, n, max_depth) for n in sizes], cost)
    step = None
    if cost is not None:

        def step(n: int, steps: int, topk: int) -> float:  # noqa: E306 - SGLang drafts steps levels of topk nodes
            draft = cost.first.predict(1) + sum(cost.expand.predict(topk) for _ in range(steps - 1))
            return cost.verify.predict(n) + cost.bookkeeping.predict(n) + draft

    sg = trees.sglang_shape(p, nodes, step)
    rates = {
        name: (rate(cost, t) if cost is not None else None)
        for name, t in (("chain", chain), ("vllm_tree", vtree), ("optimum", optimum), ("sglang", sg.tree))
    }
    plain = 1.0 / max(cost.plain_seconds(), 1e-9) if cost is not None else None
    return Plan(chain, vtree, optimum, sg, rates, plain)


def batch_of(cost: Any) -> int:
    """The batch size a profile was measured for (``treespec profile --batch-size``; 1 when unkeyed)."""
    return int((getattr(cost, "key", None) or {}).get("batch", 1))


@dataclass
class Bucket:
    """The plan for one batch size, and the predicted tokens/s of every chain length (0: plain decoding)."""

    batch: int
    plan: Plan
    chain_rates: list[float]  # [k] for k = 0 .. max chain length

    def plain_beats_sglang(self) -> bool:
        """Plain decoding is predicted at least as fast as this batch size's static SGLang shape."""
        sglang = self.plan.sglang.tokens_per_second or 0.0
        return self.plan.plain_rate is not None and self.plan.plain_rate >= sglang

    def summary(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch,
            "chain_tokens_per_second": [round(r, 3) for r in self.chain_rates],
            "adaptive_steps": adaptive_steps(self),
            **self.plan.summary(),
        }


def buckets(p: Sequence[Sequence[float]], nodes: int, costs: Sequence[Any], max_depth: int = 12) -> list[Bucket]:
    """One ``Bucket`` per profile, by batch size (module docstring); the profiles' batch sizes differ."""
    out = []
    chains = [trees.chain(p, k) for k in range(1, min(nodes, max_depth) + 1)]
    for cost in sorted(costs, key=batch_of):
        planned = plan(p, nodes, cost, max_depth)
        out.append(Bucket(batch_of(cost), planned, [planned.plain_rate] + [rate(cost, t) for t in chains]))
    return out


def adaptive_steps(bucket: Bucket, within: float = ADAPTIVE_WITHIN) -> list[int]:
    """The chain lengths (0 = no drafting) SGLang's adaptive mode may pick from at this batch size: those
    predicted within ``within`` of the best, a range with no gaps (its controller steps to neighbours)."""
    best = max(bucket.chain_rates)
    good = [k for k, r in enumerate(bucket.chain_rates) if r >= within * best]
    return list(range(min(good), max(good) + 1))
