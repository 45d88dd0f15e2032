"""opt-tree and eagle2 with sampled children (``sample=true``): the p̂-ranked shape filled by draws
without replacement is exact under every rule that reads the draws (``auto`` = traversal on such
trees, ``specinfer``, ``traversal``), keeps a prefix of each node's draws, is caught when broken,
and leaves greedy decoding alone.

The harness is ``test_sampling_exact``'s: random-weight float64 Llamas with V = 8, the drafts read
from exact tables, every emitted sequence (completed by exact sampling from the target) checked
against the target's exact distribution over the V^L continuations of its first 1, 2 and L tokens
(chi-square, α = 1e-6, fixed seeds; the short prefixes see a bias in the first tokens with far fewer
trials). The trees come from the builders' real ``build`` with ``sample=true``; their shapes depend
on the draws (the slot values ŝ are read at the drawn contexts), so the verifications are batched
by shape: the grouping is only batching, the pooled trials are n independent runs of
build-then-verify.

``test_report_mean_accepted_depth`` measures (it asserts nothing about which wins) the mean accepted
depth of the ranked trees under the deterministic rule against the sampled trees under specinfer
and traversal, at equal budgets (docs/sampling.md has the numbers).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

import pytest
import torch
from sampling_stats import ALPHA, Tables, complete, emitted, fit
from test_sampling_exact import PROMPT, SETTINGS, TARGET_SEED, TableDrafter, draft_tables, target_tables, tiny

import treespec.plugins.eagle2 as eagle2_module
import treespec.plugins.opt_tree as opt_tree_module
import treespec.sampling as sampling_module
from treespec import DraftTree
from treespec.errors import ConfigError
from treespec.factory import make_builder
from treespec.plugins.opt_tree import Slots
from treespec.sampling import DraftSampling, IgnoredOptionWarning, make_generator
from treespec.verify import verify_batch

MAX_DEPTH = 3  # trees of depth ≤ 3: L = 4 emitted tokens, 8^4 = 4096 cells
LENGTH = MAX_DEPTH + 1
BUILDERS = {  # the same budgets ranked and sampled
    "opt-tree": ("opt-tree", {"nodes": 6, "threshold": 0.0, "max_depth": MAX_DEPTH}),
    "eagle2": ("eagle2", {"top_k": 2, "depth": MAX_DEPTH, "total_tokens": 5}),
}
RULES = ("auto", "specinfer", "traversal")
N_TREES = 3000


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FastTableDrafter(TableDrafter):
    """``TableDrafter`` with each node's table row found from its parent's (row index = parent's · V +
    token) instead of from its whole path: the same numbers, several times faster."""

    def __init__(self, tables: Tables):
        super().__init__(tables)
        self.rows = [r.float() for r in tables.rows]  # [V^l, V] per level l
        self._tree: DraftTree | None = None
        self._index: list[int] = []  # row of each node of ``_tree`` in the table of its depth

    def _dist(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        if tree is not self._tree:
            self._tree, self._index = tree, [0]
        if len(self._index) < len(tree):
            parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
            for u in range(len(self._index), len(tree)):
                self._index.append(self._index[parents[u]] * self.tables.vocab + tokens[u])
        depths = tree.depths[nodes].tolist()
        return torch.stack([self.rows[d][self._index[u]] for u, d in zip(nodes.tolist(), depths)])  # [M, V]


@functools.cache
def drafter(draft: str, setting: str) -> FastTableDrafter:
    return FastTableDrafter(draft_tables(draft, SETTINGS[setting], MAX_DEPTH + 1))


class DrawLog:
    """Records every ``draw_children`` call of a build: row r of the tree's ``draw_dist`` was drawn by
    call r (``sampled_expand`` draws and records its nodes in the same order)."""

    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []  # [M, k] per call, in draw order
        self._draw = sampling_module.draw_children

    def __call__(self, dist: torch.Tensor, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, q = self._draw(dist, k, generator)
        self.tokens.append(tokens)
        return tokens, q

    def rows(self) -> list[list[int]]:
        """The draws of every recorded row, in draw order."""
        return [row for t in self.tokens for row in t.tolist()]


def build_trees(
    builder_key: str,
    draft: str,
    setting: str,
    draft_t: float | None,
    n: int,
    seed: int = 0,
    log: DrawLog | None = None,
    source=None,
) -> tuple[list[DraftTree], list[list[list[int]]]]:
    """n trees from the real ``build`` with sample=true (the Decoder's draft settings) from the ``draft``
    tables (or from ``source``, a drafter prefilled with PROMPT), and, with a ``log``, the draws behind
    each tree's recorded rows."""
    name, opts = BUILDERS[builder_key]
    builder = make_builder(name, {**opts, "sample": True})
    params = SETTINGS[setting]
    builder.start(DraftSampling(temperature=draft_t or params.temperature, generator=make_generator(seed, "cpu")))
    source = source or drafter(draft, setting)
    trees, draws = [], []
    for _ in range(n):
        if log is not None:
            log.tokens.clear()
        trees.append(builder.build(source, PROMPT[-1], max_depth=MAX_DEPTH))
        draws.append(log.rows() if log is not None else [])
    return trees, draws


def compact(tree: DraftTree) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(shape key, draw_row [N], draw_dist [R', V]) with only the kept nodes' recorded rows, in node
    order, so that trees of one shape share ``draw_row`` and batch together."""
    has = tree.draw_row >= 0  # [N]
    row = torch.where(has, torch.cumsum(has.long(), 0) - 1, -1)  # [N]
    key = (tuple(tree.parents.tolist()), tuple(has.tolist()))
    return key, row, tree.draw_dist[tree.draw_row[has]]


def verify_trees(trees: list[DraftTree], setting: str, rules: tuple[str, ...] = RULES, seed: int = 1):
    """Every tree verified once per rule (independent randomness per rule): the completed emitted
    sequences [n, L] and accepted depths [n] of each rule, trees grouped by shape."""
    params = SETTINGS[setting]
    tables = target_tables(params, LENGTH)
    groups: dict[tuple, list[int]] = defaultdict(list)
    parts = [compact(t) for t in trees]
    for i, (key, _, _) in enumerate(parts):
        groups[key].append(i)
    out = {}
    for r, rule in enumerate(rules):
        gen = make_generator(seed + 1000 * r, "cpu")
        seqs, depths = [], []
        for members in groups.values():
            first = trees[members[0]]
            tt = dataclasses.replace(first.tensors(0), draw_row=parts[members[0]][1], draw_dist=None)
            tokens = torch.stack([trees[i].tokens for i in members])  # [b, N]
            dists = torch.stack([parts[i][2] for i in members])  # [b, R', V]
            paths = [first.path(u) for u in range(len(first))]
            probs = torch.stack([tables.at(tokens[:, p[1:]]) for p in paths], dim=1)  # [b, N, V]
            best, bonus = verify_batch(tt, tokens, probs.float(), gen, rule, dists)
            seqs.append(complete(emitted(tt, tokens, best, bonus, LENGTH), tables, gen))
            depths.append(first.depths[best])
        out[rule] = (torch.cat(seqs), torch.cat(depths).double())
    return out, tables


# ----------------------------------------------------------------------------------------- exactness
CASES = [  # (builder, draft, setting, draft temperature: None = the target's)
    ("opt-tree", "model", "t0.7", None),
    ("opt-tree", "model", "t1.0", None),
    ("opt-tree", "model", "t1.5", None),
    ("opt-tree", "model", "t1.0-top_k5", 0.5),
    ("opt-tree", "zero", "t0.7-top_p0.9", 1.5),
    ("eagle2", "model", "t0.7", None),
    ("eagle2", "model", "t1.0", None),
    ("eagle2", "model", "t1.5", None),
    ("eagle2", "zero", "t1.0", None),
    ("eagle2", "model", "t1.5-top_k5-top_p0.9", 0.7),
]


@functools.cache
def case_results(builder_key: str, draft: str, setting: str, draft_t: float | None):
    """The trees of one case and their verifications under every rule (shared by the tests below)."""
    trees, _ = build_trees(builder_key, draft, setting, draft_t, N_TREES)
    out, tables = verify_trees(trees, setting)
    return trees, out, tables


def exactness(seqs: torch.Tensor, tables: Tables) -> tuple[float, str]:
    """The smallest p-value of the chi-square fits of the first 1, 2 and L emitted tokens (a bias in
    the first tokens shows in few cells, where it is seen with far fewer trials), and its description."""
    worst = (2.0, "")
    for length in sorted({1, 2, seqs.shape[1]}):
        stat, df, pvalue, impossible = fit(seqs[:, :length], tables)
        assert impossible == 0, f"{impossible} samples of probability-0 sequences"
        worst = min(worst, (pvalue, f"first {length}: X² = {stat:.1f} on {df} df, p = {pvalue:.3g}"))
    return worst


@pytest.mark.parametrize("builder_key,draft,setting,draft_t", CASES)
def test_sampled_builder_trees_are_exact(builder_key, draft, setting, draft_t):
    trees, out, tables = case_results(builder_key, draft, setting, draft_t)
    assert all(t.draw_row is not None for t in trees)
    assert len({compact(t)[0] for t in trees}) > 1  # the shape follows the draws
    for rule, (seqs, depths) in out.items():
        pvalue, how = exactness(seqs, tables)
        what = f"{builder_key} sample=true/{draft}/{setting}/draft_t={draft_t}/{rule}"
        assert pvalue >= ALPHA, f"{what}: {how} < {ALPHA} over {seqs.shape[0]} trials"
        assert float(depths.mean()) > 0.2, what  # drafts do get accepted


@pytest.mark.parametrize("builder_key", list(BUILDERS))
def test_children_are_a_prefix_of_the_draws(builder_key, monkeypatch):
    """Every node's children are exactly its first c draws, in draw order, each with the probability
    it was drawn with; nodes without a recorded draw have no children."""
    log = DrawLog()
    monkeypatch.setattr(sampling_module, "draw_children", log)
    checked = 0
    for draft, setting, draft_t in [("model", "t1.0", None), ("zero", "t0.7", 0.5), ("model", "t1.5", None)]:
        trees, draws = build_trees(builder_key, draft, setting, draft_t, 300, seed=3, log=log)
        for tree, rows in zip(trees, draws):
            tree.validate()
            kids: dict[int, list[int]] = defaultdict(list)
            for c, p in enumerate(tree.parents.tolist()):
                if p >= 0:
                    kids[p].append(c)
            for u in range(len(tree)):
                row = int(tree.draw_row[u])
                if row < 0:
                    assert not kids[u], f"node {u} has children but no recorded draw"
                    continue
                tokens = tree.tokens[kids[u]].tolist()
                assert tokens == rows[row][: len(tokens)], f"node {u}: children {tokens}, draws {rows[row]}"
                q = tree.draw_dist[row][tree.tokens[kids[u]]]
                assert torch.equal(tree.q[kids[u]], q.float()), "a child's q is not what it was drawn with"
                checked += len(tokens)
    assert checked > 1000


# ----------------------------------------------------------------------------------------- broken variants
def _own_phat_slots(expand_slots):
    """BROKEN: each draw ranked by its own probability, made non-increasing along the node's draws
    (cumulative minimum) so that every cut still keeps a prefix: whether draw j is kept then depends
    on what draw j was, which biases the verifier even though the prefix rule holds."""

    def slots(drafter, tree, nodes, k, sampling):
        s = expand_slots(drafter, tree, nodes, k, sampling)
        return Slots(s.tokens, s.q, s.q.cummin(dim=1).values) if sampling is not None else s

    return slots


def _skip_first_draw(expand_slots):
    """BROKEN: a node's children are its draws 2, 3, … (a non-prefix subset of its draws)."""

    def slots(drafter, tree, nodes, k, sampling):
        if sampling is None:
            return expand_slots(drafter, tree, nodes, k, sampling)
        s = expand_slots(drafter, tree, nodes, k + 1, sampling)
        return Slots(s.tokens[:, 1:], s.q[:, 1:], s.value[:, :-1])

    return slots


BROKEN = {"rank by the draw's own p̂": _own_phat_slots, "skip the first draw": _skip_first_draw}


@pytest.mark.parametrize(
    "builder_key,draft,setting,variant",
    [
        ("opt-tree", "model", "t1.0", "rank by the draw's own p̂"),
        ("opt-tree", "model", "t0.7", "skip the first draw"),
        ("eagle2", "model", "t1.0", "skip the first draw"),
    ],
)
def test_broken_builders_fail_the_same_check(builder_key, draft, setting, variant, monkeypatch):
    """The check the real builder passes (the same case, seeds and rule) fails for each broken variant."""
    _, ok, tables = case_results(builder_key, draft, setting, None)
    with monkeypatch.context() as m:
        broken = BROKEN[variant](opt_tree_module.expand_slots)
        m.setattr(opt_tree_module, "expand_slots", broken)
        m.setattr(eagle2_module, "expand_slots", broken)
        bad, _ = verify_trees(build_trees(builder_key, draft, setting, None, N_TREES)[0], setting, ("auto",))
    assert exactness(ok["auto"][0], tables)[0] >= ALPHA
    pvalue, how = exactness(bad["auto"][0], tables)
    assert pvalue < ALPHA, f"{builder_key}, {variant}: the broken builder passed ({how})"


# ----------------------------------------------------------------------------------------- options, greedy
def test_nodes_auto_with_sample_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"nodes=N") as err:
        make_builder("opt-tree", {"sample": True})  # nodes=auto is the default
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"nodes=N"):
        make_builder("opt-tree", {"nodes": "auto", "sample": "true"})
    assert make_builder("opt-tree", {"nodes": 8, "sample": True}).samples_children
    assert make_builder("eagle2", {"sample": True}).samples_children
    assert not make_builder("opt-tree", {"nodes": 8}).samples_children


def test_drafters_without_distributions_are_refused_up_front():
    from treespec import Decoder, TargetModel

    for builder, opts in [("opt-tree", {"nodes": 6, "sample": True}), ("eagle2", {"sample": True})]:
        dec = Decoder(TargetModel(tiny(TARGET_SEED)), drafter="ngram", builder=builder, builder_options=opts)
        with pytest.raises(ConfigError, match="full distribution"):
            dec.generate(PROMPT, max_new_tokens=4, temperature=0.7)
        with pytest.warns(IgnoredOptionWarning, match="sample=true"):  # greedy needs no distribution
            assert len(dec.generate(PROMPT, max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("builder_key", list(BUILDERS))
@pytest.mark.parametrize("calibrate", [False, True])
def test_greedy_trees_are_unchanged_by_sample(builder_key, calibrate):
    """Not sampling (``start(None)``), sample=true builds the very tree sample=false builds."""
    name, opts = BUILDERS[builder_key]
    source = drafter("model", "t1.0")
    for threshold in [0.0, 0.5] if name == "opt-tree" else [None]:
        extra = {"calibrate": calibrate, **({"threshold": threshold} if threshold is not None else {})}
        trees = []
        for sample in (False, True):
            builder = make_builder(name, {**opts, **extra, "sample": sample})
            builder.start(None)
            trees.append(builder.build(source, PROMPT[-1], max_depth=MAX_DEPTH))
        a, b = trees
        assert b.draw_row is None and a.draw_row is None
        for field in ("tokens", "parents", "depths", "q", "phat"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_decoder_runs_sampled_builders(tmp_path):
    """Whole seeded ``generate`` calls with the real model drafter: sampled trees reach the verifier
    (auto), seeds reproduce."""
    from treespec import Decoder, TargetModel

    tiny(TARGET_SEED, 0.3).save_pretrained(tmp_path)
    for builder, opts in [
        ("opt-tree", {"nodes": 6, "max_depth": 3, "sample": True}),
        ("eagle2", {"top_k": 2, "depth": 3, "total_tokens": 5, "sample": True}),
    ]:
        dec = Decoder(TargetModel(tiny(TARGET_SEED)), drafter=str(tmp_path), builder=builder, builder_options=opts)
        runs = [dec.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=s) for s in (4, 4, 5)]
        assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids
        assert sum(s.accepted for s in runs[0].stats.steps) > 0


# ----------------------------------------------------------------------------------------- measured
def ranked_mean_depth(builder_key: str, draft: str, setting: str) -> float:
    """The ranked tree's exact expected accepted depth under the deterministic rule: node v is accepted
    exactly when the target's own sample follows its path, so E(depth) = Σ_v P_target(path to v)."""
    name, opts = BUILDERS[builder_key]
    builder = make_builder(name, opts)
    builder.start(None)
    tree = builder.build(drafter(draft, setting), PROMPT[-1], max_depth=MAX_DEPTH)
    tables = target_tables(SETTINGS[setting], LENGTH)
    total = 0.0
    for v in range(1, len(tree)):
        path = tree.path_tokens(v)[1:]
        prob = 1.0
        for i, token in enumerate(path):
            prob *= float(tables.at(torch.tensor(path[:i]))[token])
        total += prob
    return total


def test_report_mean_accepted_depth(capsys):
    """Ranked (deterministic rule, exact expectation) against sampled (specinfer and traversal, the
    same trees): printed, not asserted, except that traversal accepts at least what specinfer does
    (within noise), as it does on every sampled tree."""
    lines = []
    for builder_key in BUILDERS:
        for setting in ("t0.7", "t1.0", "t1.5"):
            trees, out, _ = case_results(builder_key, "model", setting, None)
            s, t = out["specinfer"][1], out["traversal"][1]  # [n] accepted depths, the same trees
            se = float((t - s).std()) / len(t) ** 0.5
            ranked = ranked_mean_depth(builder_key, "model", setting)
            lines.append(
                f"{builder_key:8s} {setting}: ranked/deterministic {ranked:.3f}   sampled/specinfer "
                f"{float(s.mean()):.3f}  sampled/traversal {float(t.mean()):.3f}  "
                f"(± {float(t.std()) / len(t) ** 0.5:.3f}, {len(t)} trees)"
            )
            assert float(t.mean()) >= float(s.mean()) - 2 * se, lines[-1]
    with capsys.disabled():
        print("\nmean accepted depth at equal budgets (draft 'model', depth ≤ 3):\n" + "\n".join(lines))
