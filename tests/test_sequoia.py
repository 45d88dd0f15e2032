"""The `sequoia` builder: its DP against brute force, its walk of the shape with a scripted drafter,
its acceptance inputs, `measure_acceptance` and `sequoia-measure`, and losslessness on the real model."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
import typer
from typer.testing import CliRunner

import treespec
from conftest import SHARED, STORIES260K, tinystories_prompts
from treespec.cli.sequoia import sequoia_measure
from treespec.errors import ConfigError
from treespec.factory import make_builder
from treespec.interfaces import Drafter, Proposals
from treespec.plugins.sequoia import SequoiaBuilder, load_acceptance, optimal_shape, optimal_shapes, shape_value
from treespec.train.acceptance import measure_acceptance
from treespec.tree import DraftTree

MAX_NEW = 128


# ---------------------------------------------------------------------------------------- brute force
@functools.cache
def all_trees(m: int, d: int, n_ranks: int) -> tuple[frozenset, ...]:
    """Every shape with exactly m nodes (root included), depth ≤ d, ranks < n_ranks, whose children
    take the first c ranks: as frozensets of rank paths, root excluded."""
    if m == 1:
        return (frozenset(),)
    if d == 0:
        return ()

    def forests(left: int, r: int):
        if left == 0:
            yield frozenset()
            return
        if r >= n_ranks:
            return
        for j in range(1, left + 1):
            for sub in all_trees(j, d - 1, n_ranks):
                child = frozenset({(r,)} | {(r, *p) for p in sub})
                for rest in forests(left - j, r + 1):
                    yield child | rest

    return tuple(forests(m - 1, 0))


def brute_best(p: list[float], nodes: int, depth: int) -> float:
    return max(shape_value(t, p) for m in range(1, nodes + 2) for t in all_trees(m, depth, len(p)))


def check_well_formed(paths, nodes: int, depth: int) -> None:
    s = set(paths)
    assert len(s) == len(paths) <= nodes
    for path in paths:
        assert 1 <= len(path) <= depth
        assert len(path) == 1 or path[:-1] in s, f"{path}: parent missing"
        assert path[-1] == 0 or path[:-1] + (path[-1] - 1,) in s, f"{path}: a smaller rank is missing"


def test_dp_equals_brute_force_on_small_budgets():
    rng = random.Random(7)
    cases = 0
    for _ in range(60):
        n_ranks = rng.randint(1, 4)
        p = sorted((rng.random() for _ in range(n_ranks)), reverse=rng.random() < 0.7)
        if rng.random() < 0.2:
            p[rng.randrange(n_ranks)] = 0.0  # zeros anywhere, even before a positive rank
        for nodes in range(0, 8):
            for depth in range(0, 5):
                shape = optimal_shape(p, nodes, depth)
                check_well_formed(shape.paths, nodes, depth)
                assert shape_value(shape.paths, p) == pytest.approx(shape.expected_accepted, abs=1e-12)
                assert shape.expected_accepted == pytest.approx(brute_best(p, nodes, depth), abs=1e-12), (
                    p,
                    nodes,
                    depth,
                )
                cases += 1
    assert cases == 60 * 8 * 5


def test_the_whole_budget_is_used_when_the_vector_allows():
    p = [0.5, 0.15, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01, 0.008, 0.006, 0.005, 0.004, 0.003, 0.002, 0.002, 0.001]
    for nodes, depth in [(1, 1), (5, 2), (20, 10), (40, 6), (60, 10), (100, 4)]:
        shape = optimal_shape(p, nodes, depth)
        assert shape.nodes == nodes and shape.depth <= depth
        check_well_formed(shape.paths, nodes, depth)
    # two ranks and depth 2 hold at most 2 + 4 nodes; a zero rank or a trailing zero adds none
    assert optimal_shape([0.6, 0.3], 10, 2).nodes == 6
    assert optimal_shape([0.6, 0.3, 0.0], 10, 2).nodes == 6
    assert optimal_shape([0.0, 0.0], 10, 3).paths == ()
    assert optimal_shape([0.9], 10, 4).paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))  # a chain
    assert optimal_shape([0.5, 0.3], 5, 0).paths == ()


def test_value_is_monotone_in_budget_and_depth():
    rng = random.Random(3)
    for _ in range(10):
        p = sorted((rng.random() for _ in range(8)), reverse=True)
        values = [[s.expected_accepted for s in optimal_shapes(tuple(p), n, 6)] for n in range(0, 41)]
        for n in range(41):
            for d in range(7):
                if n:
                    assert values[n][d] >= values[n - 1][d] - 1e-12
                if d:
                    assert values[n][d] >= values[n][d - 1] - 1e-12
        # one solve gives every depth cap: index d equals a separate solve of depth d
        shapes = optimal_shapes(tuple(p), 30, 6)
        assert [s.paths for s in shapes] == [optimal_shape(p, 30, d).paths for d in range(7)]


# ---------------------------------------------------------------------------------------- build()
class ScriptedDrafter(Drafter):
    """Deterministic: the child of rank r is token 10 + r with q = qs[r] (0 beyond ``pad_from``),
    so a node's rank path is its path's tokens minus 10."""

    def __init__(self, qs=(0.5, 0.2, 0.1, 0.05, 0.05, 0.05, 0.02, 0.02), pad_from: int | None = None):
        self.qs, self.pad_from, self.calls = qs, pad_from, []

    def prefill(self, context):
        pass

    def commit(self, commit):
        pass

    def expand(self, tree, nodes, k):
        self.calls.append((tree.depths[nodes].tolist(), k))
        q = torch.tensor([self.qs[r] if r < len(self.qs) else 0.01 for r in range(k)])
        if self.pad_from is not None:
            q[self.pad_from :] = 0.0
        return Proposals(tokens=(10 + torch.arange(k)).repeat(len(nodes), 1), q=q.repeat(len(nodes), 1))


def rank_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(t - 10 for t in tree.path_tokens(i)[1:]) for i in range(1, len(tree))}


P_TEST = [0.55, 0.2, 0.08, 0.05, 0.03, 0.02]


@pytest.mark.parametrize("nodes,max_depth", [(10, 4), (25, 6), (60, 10)])
def test_build_walks_the_shape_one_expand_per_depth(nodes, max_depth):
    builder = SequoiaBuilder(SequoiaBuilder.Config(nodes=nodes, max_depth=max_depth, acceptance=P_TEST))
    shape = builder.shape
    drafter = ScriptedDrafter()
    tree = builder.build(drafter, root_token=1, max_depth=100)
    tree.validate()
    assert rank_paths(tree) == set(shape.paths) and tree.size == shape.nodes == nodes
    assert len(drafter.calls) == shape.depth  # ONE expand per depth
    for d, (depths, k) in enumerate(drafter.calls):
        assert set(depths) == {d}
        assert k == 1 + max(p[-1] for p in shape.paths if len(p) == d + 1)
        parents = {p[:-1] for p in shape.paths if len(p) == d + 1}
        assert len(depths) == len(parents)  # only nodes with children are expanded
    # the same builder, capped by the Decoder: the optimal tree of each smaller depth, never deeper
    for cap in range(0, shape.depth + 1):
        capped = builder.build(ScriptedDrafter(), root_token=1, max_depth=cap)
        assert capped.depth <= cap
        assert rank_paths(capped) == set(optimal_shape(P_TEST, nodes, cap).paths)


def test_build_skips_padding_and_its_subtree():
    builder = SequoiaBuilder(SequoiaBuilder.Config(nodes=30, max_depth=6, acceptance=P_TEST))
    drafter = ScriptedDrafter(pad_from=2)  # only two real candidates per node
    tree = builder.build(drafter, root_token=1, max_depth=6)
    tree.validate()
    assert rank_paths(tree) == {p for p in builder.shape.paths if max(p) < 2}
    assert bool((tree.q[1:] > 0).all())
    nothing = builder.build(ScriptedDrafter(pad_from=0), root_token=1, max_depth=6)
    assert len(nothing) == 1


# ---------------------------------------------------------------------------------------- acceptance input
def test_acceptance_from_files_lists_and_inline_json(tmp_path):
    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"acceptance": [0.5, 0.25], "positions": 10}))
    bare = tmp_path / "bare.json"
    bare.write_text("[0.5, 0.25]")
    assert load_acceptance(str(f)) == load_acceptance(str(bare)) == load_acceptance("[0.5, 0.25]") == (0.5, 0.25)
    assert load_acceptance([1, 0]) == (1.0, 0.0)
    builder = make_builder("sequoia", {"acceptance": str(f), "nodes": "3", "max_depth": "2"})  # as the CLI passes it
    assert isinstance(builder, SequoiaBuilder) and builder.shape.paths == ((0,), (1,), (0, 0))


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "sequoia-measure"),  # missing file: say how to make one
        ("{not json", "not JSON"),
        ('{"positions": 3}', "no 'acceptance'"),
        ('{"acceptance": []}', "empty"),
        ('{"acceptance": [0.5, 1.5]}', "p_1 = 1.5"),
        ('{"acceptance": [-0.1]}', "p_0 = -0.1"),
        ('{"acceptance": ["a"]}', "list of numbers"),
    ],
)
def test_bad_acceptance_files_are_one_line_errors(tmp_path, content, needle):
    path = tmp_path / "acc.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        make_builder("sequoia", {"acceptance": str(path)})
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("value,needle", [([], "empty"), ([0.5, float("nan")], "p_1 = nan"), ("[0.5,", "JSON list")])
def test_bad_acceptance_lists_are_one_line_errors(value, needle):
    with pytest.raises(ConfigError, match=needle):
        make_builder("sequoia", {"acceptance": value})


def test_acceptance_is_required():
    with pytest.raises(ConfigError, match="acceptance"):
        make_builder("sequoia", {"nodes": 5})


# ---------------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="session")
def draft4():
    from treespec.models import load_causal_lm

    return load_causal_lm(str(STORIES260K), dtype="float64", num_hidden_layers=4)


@pytest.fixture(scope="session")
def story_prompts(target64):
    return [target64.tokenizer(p).input_ids for p in tinystories_prompts(9)]


@pytest.fixture(scope="session")
def measured(target64, draft4, story_prompts):
    return measure_acceptance(target64, draft4, story_prompts[6:9], MAX_NEW)  # 3 prompts not decoded below


def test_measured_vector(measured):
    p = measured["acceptance"]
    assert len(p) == 16 and measured["positions"] > 300 and measured["prompts"] == 3
    assert 0.35 < p[0] < 0.65, p  # the 4-layer draft's top token is the target's about half the time
    assert all(0.0 <= x <= 1.0 for x in p) and sum(p) <= 1.0 + 1e-12
    assert sum(p) + measured["beyond"] == pytest.approx(1.0)


def test_measured_ranks_match_the_draft_run_on_each_prefix(target64, draft4, story_prompts):
    ids = story_prompts[0]
    got = measure_acceptance(target64, draft4, [ids], 24, ranks=4)
    with torch.inference_mode():
        seq = target64.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0].tolist()
        counts = [0] * 4
        for t in range(len(ids), len(seq)):
            logits = draft4(torch.tensor([seq[:t]])).logits[0, -1]
            rank = logits.argsort(descending=True).tolist().index(seq[t])
            if rank < 4:
                counts[rank] += 1
    assert got["positions"] == len(seq) - len(ids)
    assert got["acceptance"] == pytest.approx([c / got["positions"] for c in counts])


@pytest.mark.parametrize("nodes", [20, 40])
def test_greedy_equals_target_generate(nodes, target64, greedy_reference, measured, story_prompts):
    dec = treespec.Decoder(
        target64,
        drafter=str(STORIES260K),
        drafter_options={"layers": 4},
        builder="sequoia",
        builder_options={"nodes": nodes, "acceptance": measured["acceptance"]},
    )
    assert dec.builder.shape.nodes == nodes
    failures, tokens, steps = [], 0, 0
    for ids in story_prompts[:6]:
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        if out.token_ids != want:
            failures.append(greedy_reference.explain(ids, out.token_ids, want))
        tokens, steps = tokens + len(out.token_ids), steps + out.stats.n_steps
    assert not failures, f"{len(failures)}/6 prompts differ:\n" + "\n".join(failures)
    assert tokens / steps > 2.0  # a useful tree: well above one token per step


# ---------------------------------------------------------------------------------------- the CLI command
def cli_app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command("sequoia-measure")(sequoia_measure)

    @app.command()
    def other() -> None:  # a second command keeps `sequoia-measure` a subcommand
        pass

    return app


def test_sequoia_measure_writes_a_file_the_builder_reads(tmp_path):
    out = tmp_path / "acc.json"
    args = [
        "sequoia-measure",
        "--target",
        str(STORIES260K),
        "--drafter",
        str(STORIES260K),
        "--layers",
        "4",
        "--dataset",
        "tinystories",
        "--data-dir",
        str(SHARED / "prompts"),
        "--limit",
        "2",
        "--max-new-tokens",
        "24",
        "--ranks",
        "8",
        "--out",
        str(out),
    ]
    res = CliRunner().invoke(cli_app(), args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert len(data["acceptance"]) == 8 and data["positions"] == 48 and data["dataset"] == "tinystories"
    assert "layers=4" in data["drafter"] and "p = [" in res.stderr
    builder = make_builder("sequoia", {"acceptance": str(out), "nodes": "10"})
    assert builder.acceptance == tuple(data["acceptance"])


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target", str(STORIES260K)], "no draft model"),
        (["--limit", "0"], "--limit"),
        (["--dataset", "nope"], "neither a known name"),
    ],
)
def test_sequoia_measure_bad_input_is_one_clear_line(args, needle):
    res = CliRunner().invoke(cli_app(), ["sequoia-measure", *args])
    assert res.exit_code == 2 and needle in res.stderr, res.output
