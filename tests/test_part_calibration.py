"""Per-part calibration of a composed drafter (``plugins/part_calibration.py``): each part's q is
mapped to how often the target took that part's proposals, learnt from ``commit`` alone, so a
confident but wrong part loses the merge to a modest but right one. Scripted parts give known
outcomes; the expected rates are counted here from the script, not read from the code."""

from __future__ import annotations

import torch

import treespec
from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals
from treespec.plugins.compose import ComposedDrafter
from treespec.plugins.configs import ComposeConfig
from treespec.tree import DraftTree


class Fixed(Drafter):
    """Proposes the same (token, q) list below every node."""

    def __init__(self, cands: list[tuple[int, float]]):
        super().__init__(treespec.PluginConfig(), None)
        self.cands = cands

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        return Proposals.ranked([self.cands] * len(nodes), k)

    def prefill(self, context: PrefillContext) -> None:
        pass

    def commit(self, commit: Commit) -> None:
        pass


def merged(d: Drafter, tree: DraftTree, nodes: list[int], k: int = 4) -> list[list[tuple[int, float]]]:
    p = d.expand(tree, torch.tensor(nodes), k)
    return [[(int(t), float(q)) for t, q in zip(tr, qr) if q > 0] for tr, qr in zip(p.tokens, p.q)]


def step(d: ComposedDrafter, committed: list[int]) -> None:
    """One step: expand the root, then every node of the committed path, then commit."""
    d.begin_step(1)
    tree = DraftTree(1)
    d.expand(tree, torch.tensor([0]), 4)
    node = 0
    for tok in committed[:-1]:  # the accepted drafts become the tree's path
        node = int(tree.add_children(torch.tensor([node]), torch.tensor([tok]), torch.tensor([0.5]))[0])
        d.expand(tree, torch.tensor([node]), 4)
    d.commit(Commit(tokens=committed))


def test_a_confident_wrong_part_loses_to_a_modest_right_one():
    # part 1 says 5 with q 0.925, the target never takes 5; part 2 says 7 with q 0.325 (bucket
    # centres) and the target takes 7 below every node of the path
    d = ComposedDrafter([Fixed([(5, 0.925)]), Fixed([(7, 0.325)])])
    before = merged(d, DraftTree(1), [0])[0]
    assert [t for t, _ in before] == [5, 7]  # untrained: the parts' own q decide
    for _ in range(60):
        step(d, [7, 7, 7])  # two accepted drafts and a bonus: each depth 1..3 sees one outcome per part
    after = dict(merged(d, DraftTree(1), [0])[0])
    assert list(after) == [7, 5]
    # 60 tests and 60 hits for 7 at depth 1, 60 tests and no hit for 5; the map stays monotone in q,
    # so part 1's empty bucket is pooled with the prior-only buckets below it and ends above 0, and
    # the two children, exclusive, are scaled to sum to 1
    assert after[7] > 0.75 and after[5] < 0.25 and sum(after.values()) < 1 + 1e-5, after


def test_each_depth_is_scored_against_what_the_target_took_there():
    # below the root the target takes 7, below 7 it takes 8, below 7, 8 the bonus 9: part 1 always
    # proposes 8, part 2 always 7 (equal q), so part 2 is right at depth 1, part 1 at depth 2, and
    # both miss at depth 3
    d = ComposedDrafter([Fixed([(8, 0.475)]), Fixed([(7, 0.475)])])
    for _ in range(80):
        step(d, [7, 8, 9])
    tree = DraftTree(1)
    a = int(tree.add_children(torch.tensor([0]), torch.tensor([7]), torch.tensor([0.5]))[0])
    b = int(tree.add_children(torch.tensor([a]), torch.tensor([8]), torch.tensor([0.5]))[0])
    depth1, depth2, depth3 = (dict(row) for row in merged(d, tree, [0, a, b]))
    assert depth1[7] > 0.8 and depth1[8] < 0.35, depth1
    assert depth2[8] > 0.8 and depth2[7] < 0.35, depth2
    assert max(depth3.values()) < 0.35, depth3


def test_padding_stays_padding_and_untried_parts_keep_their_q_order():
    d = ComposedDrafter([Fixed([(3, 0.6), (4, 0.2)]), Fixed([])])  # part 2 never proposes anything
    row = merged(d, DraftTree(1), [0])[0]
    assert [t for t, _ in row] == [3, 4] and all(q > 0 for _, q in row)
    assert d.expand(DraftTree(1), torch.tensor([0]), 4).q[0, 2:].eq(0).all()  # k − 2 padding slots stay 0


def test_batch_rows_share_the_maps_but_not_the_step():
    d = ComposedDrafter([Fixed([(5, 0.925)]), Fixed([(7, 0.325)])])
    twin = d.fork()
    assert twin.calibration.maps is d.calibration.maps
    d.begin_step(1)
    d.expand(DraftTree(1), torch.tensor([0]), 4)
    assert d.calibration.asked and not twin.calibration.asked
    for _ in range(60):
        step(twin, [7, 7])  # only the twin decodes: the original row reads what it learnt
    assert [t for t, _ in merged(d, DraftTree(1), [0])[0]] == [7, 5]


def test_off_and_mix_keep_the_parts_q():
    for config in ({"calibrate": False}, {"merge": "mix"}):
        d = ComposedDrafter([Fixed([(5, 0.925)]), Fixed([(7, 0.325)])], ComposeConfig(**config))
        for _ in range(30):
            step(d, [7, 7])
        assert d.calibration is None
        q = dict(merged(d, DraftTree(1), [0])[0])
        assert abs(q[5] - (0.925 if config.get("merge") != "mix" else 0.4625)) < 1e-6, q


def test_a_nodes_children_never_promise_more_than_one_accepted_token():
    # untrained, the parts' own q 0.925 + 0.875 promise 1.8 accepted children of one node
    d = ComposedDrafter([Fixed([(5, 0.925)]), Fixed([(7, 0.875)])])
    row = merged(d, DraftTree(1), [0])[0]
    assert [t for t, _ in row] == [5, 7] and abs(sum(q for _, q in row) - 1) < 1e-5, row  # scaled to 1
    ratio = row[0][1] / row[1][1]
    raw = ComposedDrafter([Fixed([(5, 0.925)]), Fixed([(7, 0.875)])], ComposeConfig(calibrate=False))
    q = dict(merged(raw, DraftTree(1), [0])[0])
    assert abs(ratio - q[5] / q[7]) < 0.01  # the calibrated values keep their order and ratio
    small = ComposedDrafter([Fixed([(5, 0.325)]), Fixed([(7, 0.275)])])
    assert sum(q for _, q in merged(small, DraftTree(1), [0])[0]) < 0.7  # under 1: left as they are
