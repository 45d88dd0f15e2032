"""Builder `static`: presets, shape specs, the trees it builds, its errors, and losslessness.

A scripted drafter proposes tokens that are a fixed function of the node's token path, so the rank
path of every node can be read back from the built tree and compared with the shape exactly.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec.errors import ConfigError
from treespec.plugins.configs import StaticConfig
from treespec.plugins.static import StaticBuilder, load_shape, preset_names, preset_source
from treespec.tree import DraftTree

V = 1000  # vocabulary of the scripted drafter


def _h(tokens: list[int]) -> int:
    """A stable hash of a token path (the first child's token of that node)."""
    h = 7
    for t in tokens:
        h = (h * 31 + t + 1) % V
    return h


class ScriptedDrafter(treespec.Drafter):
    """Child j of a node has token (h(node's token path) + j) % V and q = 2^-(j+1).

    ``pad(rank_path)`` -> True makes that child padding (q = 0); ``columns`` caps the number of
    columns returned (a drafter with a small vocabulary). Every expand call is recorded.
    """

    def __init__(self, pad=lambda rank_path: False, columns: int | None = None):
        self.pad, self.columns = pad, columns
        self.calls: list[tuple[list[int], int]] = []

    def prefill(self, context):
        pass

    def commit(self, commit):
        pass

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> treespec.Proposals:
        self.calls.append((nodes.tolist(), k))
        cols = k if self.columns is None else min(k, self.columns)
        tokens = torch.zeros(len(nodes), cols, dtype=torch.long)
        q = torch.zeros(len(nodes), cols)
        for i, node in enumerate(nodes.tolist()):
            base, path = _h(tree.path_tokens(node)), rank_path(tree, node)
            for j in range(cols):
                tokens[i, j] = (base + j) % V
                q[i, j] = 0.0 if self.pad(path + [j]) else 2.0 ** -(j + 1)
        return treespec.Proposals(tokens=tokens, q=q)


def rank_path(tree: DraftTree, node: int) -> list[int]:
    """The child ranks from the root to ``node``, read back from the scripted tokens."""
    ids = tree.path(node)
    toks = tree.tokens.tolist()
    return [(toks[c] - _h(tree.path_tokens(p))) % V for p, c in zip(ids, ids[1:])]


def rank_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(rank_path(tree, i)) for i in range(1, len(tree))}


def build(shape: str, max_depth: int = 100, **drafter_kw) -> tuple[DraftTree, ScriptedDrafter]:
    drafter = ScriptedDrafter(**drafter_kw)
    tree = StaticBuilder(StaticConfig(shape=shape)).build(drafter, 5, max_depth)
    tree.validate()
    return tree, drafter


# ------------------------------------------------------------------------------------ shapes
def test_presets_have_their_published_sizes():
    assert set(preset_names()) >= {"eagle-mc_sim_7b_63", "eagle-25", "medusa-mc_sim_7b_63"}
    eagle = load_shape("eagle-mc_sim_7b_63")
    # EAGLE-1's default tree keeps Medusa's variable name but has 25 drafted nodes (26 tokens with the root)
    assert len(eagle) == 25 and Counter(map(len, eagle)) == {1: 4, 2: 8, 3: 8, 4: 3, 5: 2}
    assert load_shape("eagle-25") == eagle  # the 25-node EAGLE tree OPT-Tree compares with is the same tree
    medusa = load_shape("medusa-mc_sim_7b_63")
    assert len(medusa) == 63 and Counter(map(len, medusa)) == {1: 10, 2: 28, 3: 23, 4: 2}
    for name in preset_names():
        assert preset_source(name)  # every preset says where it was copied from
        paths = load_shape(name)
        assert paths == sorted(paths, key=lambda p: (len(p), p))  # parents first


def test_presets_are_copied_verbatim():
    """shapes.json keeps the published order; load_shape only sorts."""
    from importlib import resources

    raw = json.loads(resources.files("treespec.plugins").joinpath("shapes.json").read_text())["presets"]
    assert raw["eagle-mc_sim_7b_63"]["paths"][:5] == [[0], [1], [2], [3], [0, 0]]
    assert raw["eagle-mc_sim_7b_63"]["paths"][-2:] == [[0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    assert raw["medusa-mc_sim_7b_63"]["paths"][:5] == [[0], [0, 0], [1], [0, 1], [2]]
    assert raw["medusa-mc_sim_7b_63"]["paths"][-3:] == [[0, 0, 0, 1], [1, 6], [0, 7, 0]]


def test_chain_and_kary_shapes():
    assert load_shape("chain-1") == [[0]]
    assert load_shape("chain-5") == [[0] * d for d in range(1, 6)]
    assert load_shape("kary-2-2") == [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]
    assert len(load_shape("kary-2-3")) == 2 + 4 + 8
    assert len(load_shape("kary-3-3")) == 3 + 9 + 27
    assert load_shape("kary-1-4") == load_shape("chain-4")


def test_json_list_and_json_files(tmp_path):
    assert load_shape("[[1], [0], [0, 0]]") == [[0], [1], [0, 0]]  # sorted: parents before children
    assert load_shape(" [[0],[0,0]] ") == [[0], [0, 0]]
    listed = tmp_path / "list.json"
    listed.write_text("[[0], [0, 2], [0, 1]]")
    assert load_shape(str(listed)) == [[0], [0, 1], [0, 2]]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"paths": [[0], [1]], "source": "mine"}))
    assert load_shape(str(wrapped)) == [[0], [1]]
    assert StaticBuilder(StaticConfig(shape=str(wrapped))).size == 2


BAD = [
    ("eagle-mc_sim", "did you mean 'eagle-mc_sim_7b_63'"),
    ("medusa", "unknown tree shape 'medusa'"),
    ("chain-0", "chain-K needs K >= 1"),
    ("kary-0-3", "kary-K-D needs K >= 1 and D >= 1"),
    ("kary-2", "malformed"),
    ("kary-10-10", "more than the limit"),
    ("[[0], [0, 0]", "malformed JSON"),
    ("[[0], [1, 0]]", "path [1, 0] has no parent path [1]"),
    ("[[0], [0, 1], [0, 1]]", "path [0, 1] appears twice"),
    ("[[0], [-1]]", "path [-1] has a negative rank"),
    ("[[0], []]", "not a non-empty list of integer ranks"),
    ("[[0], [0.5]]", "not a non-empty list of integer ranks"),
    ("[]", "has no paths"),
    ('{"nodes": [[0]]}', 'under "paths"'),
    ("missing/shape.json", "does not exist"),
]


@pytest.mark.parametrize("shape,message", BAD)
def test_bad_shapes_are_one_line_config_errors(shape, message):
    with pytest.raises(ConfigError) as err:
        StaticBuilder(StaticConfig(shape=shape))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_shape_file_and_registry(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[[0],\n [0, 0],\n oops]")
    with pytest.raises(ConfigError, match=r"malformed JSON .*line 3") as err:
        load_shape(str(bad))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="did you mean"):  # through the registry, as the CLI does
        treespec.Decoder(STORIES260K, builder="static", builder_options={"shape": "eagle-26"})


# ------------------------------------------------------------------------------------ building
SHAPES = ["eagle-mc_sim_7b_63", "eagle-25", "medusa-mc_sim_7b_63", "chain-5", "kary-2-3", "kary-3-2"]


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_structure_equals_the_shape(shape):
    tree, drafter = build(shape)
    paths = load_shape(shape)
    assert rank_paths(tree) == {tuple(p) for p in paths}
    assert tree.size == len(paths) and tree.depth == max(map(len, paths))
    # q and p̂ are the drafter's: q = 2^-(rank+1) along the path
    for i in range(1, len(tree)):
        assert float(tree.phat[i]) == pytest.approx(2.0 ** -sum(r + 1 for r in rank_path(tree, i)))
    # ONE expand per depth, over exactly the nodes of that depth that have children in the shape
    assert len(drafter.calls) == tree.depth
    for d, (nodes, k) in enumerate(drafter.calls):
        wanted = {tuple(p[:-1]) for p in paths if len(p) == d + 1}
        assert sorted(nodes) == nodes
        assert {tuple(rank_path(tree, n)) for n in nodes} == wanted and len(nodes) == len(wanted)
        assert k == 1 + max(p[-1] for p in paths if len(p) == d + 1)


@pytest.mark.parametrize("max_depth", range(0, 7))
def test_max_depth_truncates(max_depth):
    for shape in ("eagle-mc_sim_7b_63", "medusa-mc_sim_7b_63", "chain-5"):
        tree, drafter = build(shape, max_depth=max_depth)
        assert rank_paths(tree) == {tuple(p) for p in load_shape(shape) if len(p) <= max_depth}
        assert len(tree) == 1 or tree.depth <= max_depth
        assert len(drafter.calls) == min(max_depth, max(map(len, load_shape(shape))))


def test_padding_is_skipped_with_its_subtree():
    shape = {tuple(p) for p in load_shape("eagle-mc_sim_7b_63")}

    def pad(p):  # rank 3 at depth 1, the node [0, 0] and rank 2 at depth 4
        return p == [3] or p == [0, 0] or (len(p) == 4 and p[-1] == 2)

    tree, drafter = build("eagle-mc_sim_7b_63", pad=pad)

    def cut(p):
        return any(pad(list(p[:i])) for i in range(1, len(p) + 1))

    want = {p for p in shape if not cut(p)}
    assert rank_paths(tree) == want and len(want) < len(shape)
    assert not bool((tree.q[1:] == 0).any())
    # the padded node [0, 0] is not expanded: its children [0, 0, *] are never asked for
    assert (0, 0) not in {tuple(rank_path(tree, n)) for nodes, _ in drafter.calls for n in nodes}
    assert tree.depth == 3  # everything deeper hangs below [0, 0]


def test_padding_everywhere_leaves_the_root_only():
    tree, drafter = build("kary-2-3", pad=lambda p: True)
    assert len(tree) == 1 and len(drafter.calls) == 1


def test_fewer_columns_than_asked_count_as_padding():
    tree, _ = build("medusa-mc_sim_7b_63", columns=2)  # e.g. a drafter whose vocabulary has 2 tokens
    assert rank_paths(tree) == {tuple(p) for p in load_shape("medusa-mc_sim_7b_63") if max(p) < 2}


def test_builder_is_reusable_across_steps():
    builder = StaticBuilder(StaticConfig(shape="kary-2-3"))
    trees = [builder.build(ScriptedDrafter(), root, 100) for root in (5, 9, 5)]
    assert [t.size for t in trees] == [14, 14, 14]
    assert trees[0].tokens.tolist() == trees[2].tokens.tolist() != trees[1].tokens.tolist()


# ------------------------------------------------------------------------------------ lossless
N_PROMPTS, MAX_NEW = 6, 128


@pytest.fixture(scope="module")
def prompts(target64):
    return [target64.tokenizer(p).input_ids for p in tinystories_prompts(N_PROMPTS)]


@pytest.mark.parametrize("shape", ["eagle-mc_sim_7b_63", "kary-2-3", "chain-5"])
def test_lossless_on_the_real_model(shape, target64, greedy_reference, prompts):
    dec = treespec.Decoder(
        target64,
        drafter=str(STORIES260K),
        drafter_options={"layers": 4},
        builder="static",
        builder_options={"shape": shape},
    )
    failures, accepted = [], 0
    for ids in prompts:
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        if out.token_ids != want:
            failures.append(greedy_reference.explain(ids, out.token_ids, want))
        accepted += len(out.token_ids) - out.stats.n_steps
    assert not failures, f"{len(failures)}/{len(prompts)} prompts differ:\n" + "\n".join(failures)
    assert accepted > 0  # the drafter's tokens were used, not only the bonus tokens
