"""The builder conformance kit (``treespec.testing.BuilderConformance``) on every shipped builder, and
proof that each of its checks catches what it is about.

- ``CASES``: each built-in builder (chain, static k-ary and EAGLE's published tree, sequoia, eagle2,
  opt-tree with a fixed budget and with ``nodes=auto``) and the example plugin's ``best-first`` run
  the whole kit on the real stories260K target in float64, with real TinyStories prompts and two
  real drafters: the model drafter (stories260K's first 3 layers) and ngram. Lossless means token for
  token equal to the target's own ``generate(do_sample=False)``, one sequence and batched.
- The default target (``tiny_target()``, random weights, no files): the kit as a plugin author gets it.
- Deliberately broken builders: each check that should catch one raises ``AssertionError`` with the
  reason, and the checks it does not break pass.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from conftest import STORIES260K, tinystories_prompts
from treespec.config import PluginConfig
from treespec.factory import make_builder
from treespec.interfaces import Commit, PlanningBuilder, TreeBuilder
from treespec.testing import (
    BUILDER_CHECKS,
    BuilderConformance,
    check_builder,
    check_builder_batch,
    check_builder_budget,
    check_builder_contract,
    check_builder_lossless,
    check_builder_max_depth,
    tiny_target,
)
from treespec.testing.watch import WatchedBuilder, WatchedPlanningBuilder
from treespec.tree import DraftTree

HAS_EXAMPLE = importlib.util.find_spec("treespec_example") is not None
needs_example = pytest.mark.skipif(
    not HAS_EXAMPLE, reason="the example plugin is not installed: pip install -e examples/treespec-example-plugin"
)


def _model(target):
    from treespec.plugins.model_drafter import ModelDrafter

    return ModelDrafter(ModelDrafter.Config(model=str(STORIES260K), layers=3), target)


def _ngram(target):
    from treespec.plugins.ngram import NgramDrafter

    return NgramDrafter(NgramDrafter.Config(), target)


@dataclass(frozen=True)
class Case:
    """One builder to run the whole kit on, on stories260K."""

    name: str  # the test class becomes Test<Name>BuilderConformance
    builder: str
    options: dict[str, Any]
    marks: tuple = ()


# ---- the builders under test: add new ones here ----------------------------------------------------
CASES: list[Case] = [
    Case("chain", "chain", {"k": 4}),
    Case("static-kary", "static", {"shape": "kary-2-3"}),
    Case("static-eagle", "static", {"shape": "eagle-mc_sim_7b_63"}),
    Case("sequoia", "sequoia", {"nodes": 16, "max_depth": 6, "acceptance": [0.6, 0.2, 0.1]}),
    Case("eagle2", "eagle2", {"top_k": 4, "depth": 5, "total_tokens": 16}),
    Case("opt-tree", "opt-tree", {"nodes": 16}),
    Case("opt-tree-auto", "opt-tree", {"nodes": "auto"}),
    Case("best-first", "best-first", {"nodes": 12, "branch": 3}, marks=(needs_example,)),
]

PROMPTS = tinystories_prompts(3)


class Stories260KBuilderConformance(BuilderConformance):
    """The kit on the real target: stories260K in float64, stopping at EOS or BOS (conftest's ``target64``)."""

    expect_acceptance = True  # the model drafter's tokens are accepted on real text

    @pytest.fixture
    def target(self, target64):
        return target64

    def prompts(self):
        return PROMPTS

    def drafters(self):
        return [("model", _model), ("ngram", _ngram)]


for _case in CASES:
    _name = f"Test{_case.name.title().replace('-', '')}BuilderConformance"
    globals()[_name] = type(
        _name,
        (Stories260KBuilderConformance,),
        {
            "__doc__": f"The builder kit on {_case.builder} {_case.options} with stories260K.",
            "make_builder": lambda self, _case=_case: make_builder(_case.builder, dict(_case.options)),
            "pytestmark": list(_case.marks),
        },
    )
del _case, _name


class TestChainOnTheDefaultTarget(BuilderConformance):
    """No files: the random tiny target with the default drafters (self and ngram)."""

    def make_builder(self):
        return make_builder("chain", {"k": 3})


# ---------------------------------------------------------------------------------------------------
# broken builders: each names the check that must catch it
class Broken(TreeBuilder):
    """A chain of up to ``length`` best children (respecting max_depth), declared ``max_nodes``; the
    subclasses break one rule each."""

    length = 3
    declared: int | None = 3

    def __init__(self, config: PluginConfig | None = None):
        super().__init__(config or PluginConfig())

    @property
    def max_nodes(self) -> int | None:
        return self.declared

    def depth_cap(self, max_depth: int) -> int:
        return min(self.length, max_depth)

    def build(self, drafter, root_token, max_depth):
        tree = DraftTree(root_token)
        node = torch.zeros(1, dtype=torch.long)
        for _ in range(self.depth_cap(max_depth)):
            prop = drafter.expand(tree, node, 2)
            if float(prop.q[0, 0]) <= 0:
                break
            node = tree.add_children(node, prop.tokens[:1, 0], prop.q[:1, 0])
        return tree


class RootOnly(Broken):
    def build(self, drafter, root_token, max_depth):
        return DraftTree(root_token)


class OverBudget(Broken):
    length, declared = 4, 2


class Undeclared(Broken):
    declared = None


class TooDeep(Broken):
    def depth_cap(self, max_depth: int) -> int:
        return self.length  # ignores the Decoder's cap


class ChildBeforeParent(Broken):
    def build(self, drafter, root_token, max_depth):
        tree = super().build(drafter, root_token, max_depth)
        if tree.size < 2:
            return tree
        swap = torch.tensor([0, 2, 1])  # node 1 becomes the grandchild: its parent (2) comes after it
        out = DraftTree(root_token)
        out.tokens, out.q, out.phat = tree.tokens[swap], tree.q[swap], tree.phat[swap]
        out.parents, out.depths = torch.tensor([-1, 2, 0]), torch.tensor([0, 2, 1])
        return out


class DuplicateSiblings(Broken):
    def build(self, drafter, root_token, max_depth):
        tree = DraftTree(root_token)
        if max_depth > 0:
            prop = drafter.expand(tree, torch.zeros(1, dtype=torch.long), 1)
            if float(prop.q[0, 0]) > 0:
                tree.add_children(
                    torch.zeros(2, dtype=torch.long), prop.tokens[0, :1].repeat(2), prop.q[0, :1].repeat(2)
                )
        return tree


class AddsPadding(Broken):
    def build(self, drafter, root_token, max_depth):
        tree = DraftTree(root_token)
        if max_depth > 0:
            vocab = drafter.target.vocab_size
            prop = drafter.expand(tree, torch.zeros(1, dtype=torch.long), vocab + 2)  # more than the vocabulary
            keep = prop.q.shape[1]
            tree.add_children(torch.zeros(keep, dtype=torch.long), prop.tokens[0], prop.q[0])  # q = 0 entries too
        return tree


class WrongRoot(Broken):
    def build(self, drafter, root_token, max_depth):
        return DraftTree((root_token + 1) % drafter.target.vocab_size)


class NewTreeEachLayer(Broken):
    """Expands a fresh copy of its tree for each layer, without telling the drafter it started over."""

    def build(self, drafter, root_token, max_depth):
        tree = DraftTree(root_token)
        node = torch.zeros(1, dtype=torch.long)
        for _ in range(self.depth_cap(max_depth)):
            prop = drafter.expand(tree, node, 1)
            if float(prop.q[0, 0]) <= 0:
                break
            copy = tree.select(torch.arange(len(tree)))  # the same nodes, another object
            node = copy.add_children(node, prop.tokens[:, 0], prop.q[:, 0])
            tree = copy
        return tree


class CommitsInBuild(Broken):
    def build(self, drafter, root_token, max_depth):
        tree = super().build(drafter, root_token, max_depth)
        drafter.commit(Commit(tokens=[root_token]))
        return tree


class SharedScratch(Broken):
    """Keeps the step's tree in a dict that is a class attribute (one dict for every instance) and reads
    it back after each expand: fine alone, but a batch's rows are instances of one class, and rows
    whose expand calls meet in rounds (a model drafter's rows) then grow each other's trees. (The
    Decoder gives rows fresh instances from the Config; state in the class is still shared.)"""

    scratch: dict[str, DraftTree] = {}  # noqa: RUF012 - the bug under test: mutable state on the class

    def build(self, drafter, root_token, max_depth):
        self.scratch["tree"] = DraftTree(root_token)
        node = torch.zeros(1, dtype=torch.long)
        for _ in range(self.depth_cap(max_depth)):
            prop = drafter.expand(self.scratch["tree"], node, 1)
            if float(prop.q[0, 0]) <= 0:
                break
            node = self.scratch["tree"].add_children(node, prop.tokens[:, 0], prop.q[:, 0])
        return self.scratch["tree"]


class TouchesTarget(Broken):
    """Re-prefills the target (which a builder never touches) in the middle of decoding."""

    def build(self, drafter, root_token, max_depth):
        drafter.target.prefill(torch.tensor([1, 5, 17]))
        return super().build(drafter, root_token, max_depth)


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def run(check, cls, target) -> str | None:
    """The check's failure message, or None if it passed."""
    try:
        check(cls, target)
    except AssertionError as exc:
        return str(exc)
    return None


def test_a_correct_builder_passes_every_check(tiny):
    check_builder(Broken, tiny)


@pytest.mark.parametrize(
    "cls, check, words",
    [
        (RootOnly, check_builder_contract, "none of the"),
        (ChildBeforeParent, check_builder_contract, "does not come before it"),
        (DuplicateSiblings, check_builder_contract, "has two children with token"),
        (AddsPadding, check_builder_contract, "padding (q == 0) must never be added"),
        (WrongRoot, check_builder_contract, "not the step's root"),
        (NewTreeEachLayer, check_builder_contract, "a different tree than this step's earlier expand calls"),
        (CommitsInBuild, check_builder_contract, "build called drafter.commit()"),
        (OverBudget, check_builder_budget, "more than the builder's max_nodes = 2"),
        (Undeclared, check_builder_budget, "max_nodes is None"),
        (TooDeep, check_builder_max_depth, "> max_depth 0 (0 means the root alone)"),
        (SharedScratch, check_builder_batch, "batch: drafter 'self'"),
        (TouchesTarget, check_builder_lossless, "differs from the target's own greedy generate()"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else getattr(v, "__name__", None),
)
def test_each_broken_builder_is_caught_by_its_check(tiny, cls, check, words):
    message = run(check, cls, tiny)
    assert message is not None, f"{check.__name__} passed {cls.__name__}"
    assert words in message and f"builder {cls.__name__}()" in message, message


@pytest.mark.parametrize(
    "cls, passes",
    [
        (OverBudget, [check_builder_contract, check_builder_max_depth, check_builder_lossless]),
        (Undeclared, [check_builder_contract, check_builder_max_depth, check_builder_batch, check_builder_lossless]),
        (
            SharedScratch,
            [check_builder_contract, check_builder_budget, check_builder_max_depth, check_builder_lossless],
        ),
        (RootOnly, [check_builder_budget, check_builder_max_depth, check_builder_batch, check_builder_lossless]),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_a_broken_builder_passes_the_checks_it_does_not_break(tiny, cls, passes):
    for check in passes:
        assert run(check, cls, tiny) is None, f"{check.__name__} failed {cls.__name__}"


def test_check_builder_lists_every_failed_check(tiny):
    with pytest.raises(AssertionError) as err:
        check_builder(OverBudget, tiny)
    text = str(err.value)
    assert text.startswith("2 of 5 builder conformance checks failed") and "[budget]" in text and "[batch]" in text
    with pytest.raises(ValueError, match="unknown checks"):
        check_builder(Broken, tiny, skip=["nope"])
    assert list(BUILDER_CHECKS) == ["contract", "budget", "max_depth", "batch", "lossless"]


def test_the_watch_forwards_every_builder_hook():
    """Every public member of TreeBuilder is WatchedBuilder's own: a hook added to the ABC later would
    otherwise reach its default, not the builder under test."""
    public = {name for name in dir(TreeBuilder) if not name.startswith("_")} - {"Config"}
    assert public <= set(vars(WatchedBuilder)), sorted(public - set(vars(WatchedBuilder)))
    planning = {name for name in vars(PlanningBuilder) if not name.startswith("_")}  # and a planner's hooks
    assert planning <= set(vars(WatchedPlanningBuilder)), sorted(planning - set(vars(WatchedPlanningBuilder)))
