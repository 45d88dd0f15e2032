"""The drafter conformance suite (``treespec.testing``) on every shipped drafter, and proof that it fails.

- ``CASES``: each drafter runs the whole suite (``DrafterConformance``, one test per check) on the
  real stories260K target in float64 with real TinyStories prompts.
- The default target (``tiny_target()``, random weights, no files) runs the suite on ``self``, on a
  model-free reference drafter (``ToyDrafter``) and on one that needs the target's hidden states.
- Deliberately broken drafters: each check that should catch them raises ``AssertionError``.

To add a drafter (``datastore``, composed drafters, ``eagle``, ...), append a ``Case`` to ``CASES``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import treespec
from conftest import STORIES260K, block_head_dir, eagle3_head_dir, eagle_head_dir, tinystories_prompts
from treespec.testing import (
    DrafterConformance,
    check_commit_consistency,
    check_contract,
    check_drafter,
    check_flags,
    check_unproposed_nodes,
    tiny_target,
)

HAS_EXAMPLE = importlib.util.find_spec("treespec_example") is not None
needs_example = pytest.mark.skipif(
    not HAS_EXAMPLE, reason="the example plugin is not installed: pip install -e examples/treespec-example-plugin"
)


def _model(target):
    from treespec.plugins.model_drafter import ModelDrafter

    return ModelDrafter(ModelDrafter.Config(model=str(STORIES260K), layers=3), target)


def _self(target):
    from treespec.plugins.self_drafter import SelfDrafter

    return SelfDrafter(SelfDrafter.Config(layers=3), target)


def _ngram(target):
    from treespec.plugins.ngram import NgramDrafter

    return NgramDrafter(NgramDrafter.Config(), target)


def _eagle(target):
    from treespec.plugins.eagle import EagleDrafter

    return EagleDrafter(EagleDrafter.Config(head=str(eagle_head_dir())), target)


def _eagle3(target):
    from treespec.plugins.eagle3 import Eagle3Drafter

    return Eagle3Drafter(Eagle3Drafter.Config(head=str(eagle3_head_dir())), target)


def _block(target):
    from treespec.plugins.block import BlockDrafter

    return BlockDrafter(BlockDrafter.Config(head=str(block_head_dir())), target)


def _bigram(target):
    from treespec_example.bigram import BigramDrafter

    return BigramDrafter(BigramDrafter.Config(), target)


@dataclass(frozen=True)
class Case:
    """One drafter to run the whole suite on, on stories260K."""

    name: str  # the test class becomes Test<Name>Conformance
    make: Callable  # target -> a new Drafter
    path_exact: bool = False  # a node's proposals equal a fresh drafter's on committed + path
    expect_acceptance: bool = False  # the lossless runs must accept some draft tokens
    marks: tuple = ()


# ---- the drafters under test: add new ones here (datastore, composed drafters, eagle, ...) -----------
CASES: list[Case] = [
    Case("model", _model, path_exact=True, expect_acceptance=True),
    Case("self", _self, path_exact=True, expect_acceptance=True),
    Case("ngram", _ngram, path_exact=True),
    # bigram counts pairs of committed tokens only, not along a node's path: not path_exact, by design
    Case("bigram", _bigram, marks=(needs_example,)),
    # datastore and composed drafters run the suite in tests/test_datastore.py and tests/test_compose.py
    # tree nodes below the root use the head's predicted features, not the target's: not path_exact
    Case("eagle", _eagle, expect_acceptance=True),
    Case("eagle3", _eagle3, expect_acceptance=True),
    # every node at depth d gets depth d+1's marginal, whatever its path: not path_exact, by design
    Case("block", _block, expect_acceptance=True),
]

PROMPTS = tinystories_prompts(3)  # real text: two short prompts first (the commit-consistency check uses those)


class Stories260KConformance(DrafterConformance):
    """The suite on the real target: stories260K in float64, stopping at EOS or BOS (conftest's ``target64``)."""

    max_new_tokens = 24

    @pytest.fixture
    def target(self, target64):
        return target64

    def prompts(self):
        return PROMPTS


for _case in CASES:
    _name = f"Test{_case.name.title().replace('-', '').replace('_', '')}Conformance"
    globals()[_name] = type(
        _name,
        (Stories260KConformance,),
        {
            "__doc__": f"The conformance suite on drafter {_case.name!r} with stories260K.",
            "make_drafter": lambda self, target, _make=_case.make: _make(target),
            "path_exact": _case.path_exact,
            "expect_acceptance": _case.expect_acceptance,
            "pytestmark": list(_case.marks),
        },
    )


# ---------------------------------------------------------------------------------------------------
# model-free drafters for the default target: a correct one, one that uses hidden states, broken ones


class ToyDrafter(treespec.Drafter):
    """A correct drafter without a model. A node's q is a seeded pseudo-random distribution over the
    vocabulary, a function of the context (committed + path) through its length and last two tokens
    (position-dependent, like a RoPE model). Like a KV-cache drafter, it "feeds" each new node once
    and must forget the rejected ones at commit."""

    def __init__(self, config, target):
        super().__init__(config, target)
        self.vocab = target.vocab_size

    def prefill(self, context):
        self.seq = context.input_ids.tolist()
        self.fed: dict[int, int] = {}  # node id -> token, in the order fed this step

    def dist(self, context: list[int]) -> torch.Tensor:
        a, b = context[-1], context[-2] if len(context) > 1 else -1
        gen = torch.Generator().manual_seed(len(context) * 1_000_003 + a * 1009 + b + 7)
        return torch.softmax(3 * torch.randn(self.vocab, generator=gen, dtype=torch.float64), -1)

    def expand(self, tree, nodes, k):
        rows = []
        for node in nodes.tolist():
            path = tree.path_tokens(node)
            for n in tree.path(node)[1:]:
                self.fed.setdefault(n, int(tree.tokens[n]))
            rows.append(self.dist(self.seq + path[1:]))
        q, tokens = torch.stack(rows).topk(min(k, self.vocab), dim=-1)
        return treespec.Proposals(tokens=tokens, q=q.float())

    def commit(self, commit):
        self.seq += commit.tokens
        self.fed = {}


class HiddenToyDrafter(ToyDrafter):
    """A correct drafter that needs the target's hidden states, EAGLE-style: a node's logits come from
    the target's last hidden state before the root plus the node's path tokens. Its asserts check
    that the suite hands over hidden states with the Decoder's shapes."""

    needs_target_hidden = True

    def prefill(self, context):
        super().prefill(context)
        h = context.hidden
        assert h is not None and h.shape[0] == len(self.seq) - 1, (None if h is None else h.shape, len(self.seq))
        self.feats = list(h)
        gen = torch.Generator().manual_seed(1)
        self.w = torch.randn(h.shape[1], self.vocab, generator=gen, dtype=torch.float64)
        self.e = torch.randn(self.vocab, self.vocab, generator=gen, dtype=torch.float64)

    def expand(self, tree, nodes, k):
        last = self.feats[-1].double() if self.feats else torch.zeros(self.w.shape[0], dtype=torch.float64)
        rows = [last @ self.w + self.e[tree.path_tokens(node)].sum(0) for node in nodes.tolist()]
        q, tokens = torch.softmax(torch.stack(rows), -1).topk(min(k, self.vocab), dim=-1)
        return treespec.Proposals(tokens=tokens, q=q)

    def commit(self, commit):
        assert commit.hidden is not None and commit.hidden.shape[0] == len(commit.tokens)
        self.feats += list(commit.hidden)
        super().commit(commit)


class NoRollbackDrafter(ToyDrafter):
    """BROKEN: its commit keeps every node fed this step (like KV rows never cropped), then the bonus."""

    def commit(self, commit):
        self.seq += list(self.fed.values()) + [commit.tokens[-1]]
        self.fed = {}


class UnsortedDrafter(ToyDrafter):
    """BROKEN: worst first."""

    def expand(self, tree, nodes, k):
        p = super().expand(tree, nodes, k)
        return treespec.Proposals(tokens=p.tokens.flip(1), q=p.q.flip(1))


class DuplicateDrafter(ToyDrafter):
    """BROKEN: proposes its best token twice."""

    def expand(self, tree, nodes, k):
        p = super().expand(tree, nodes, k)
        tokens = p.tokens.clone()
        tokens[:, 1] = tokens[:, 0]
        return treespec.Proposals(tokens=tokens, q=p.q)


class HiddenLiarDrafter(ToyDrafter):
    """BROKEN: says needs_target_hidden = False but reads PrefillContext.hidden."""

    def prefill(self, context):
        self.width = context.hidden.shape[1]
        super().prefill(context)


class ScoresDrafter(ToyDrafter):
    """BROKEN: q are scores (the best is 1) while provides_probabilities stays True."""

    def expand(self, tree, nodes, k):
        p = super().expand(tree, nodes, k)
        return treespec.Proposals(tokens=p.tokens, q=p.q / p.q[:, :1])


def toy(cls):
    return lambda target: cls(treespec.PluginConfig(), target)


class TestSelfOnTheDefaultTarget(DrafterConformance):
    """The default target (random weights, no files) works: the built-in self drafter on 1 of its 2 layers."""

    def make_drafter(self, target):
        from treespec.plugins.self_drafter import SelfDrafter

        return SelfDrafter(SelfDrafter.Config(layers=1), target)


class TestToyDrafterConformance(DrafterConformance):
    """A correct model-free drafter passes, path_exact included."""

    path_exact = True

    def make_drafter(self, target):
        return ToyDrafter(treespec.PluginConfig(), target)


class TestHiddenStatesConformance(DrafterConformance):
    """The suite passes the target's hidden states exactly as the Decoder does."""

    def make_drafter(self, target):
        return HiddenToyDrafter(treespec.PluginConfig(), target)


# ---------------------------------------------------------------------------------------------------
# the suite fails when it should


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def test_a_drafter_that_keeps_rejected_nodes_fails_commit_consistency(tiny):
    check_contract(toy(NoRollbackDrafter), tiny)  # its answers are well formed: only its state drifts
    with pytest.raises(
        AssertionError, match=r"(?s)NoRollbackDrafter.*commit consistency.*differs from a fresh drafter prefilled"
    ):
        check_commit_consistency(toy(NoRollbackDrafter), tiny)
    with pytest.raises(AssertionError, match=r"(?s)unproposed nodes.*differs from a fresh drafter"):
        check_unproposed_nodes(toy(NoRollbackDrafter), tiny)


def test_unsorted_q_and_duplicate_tokens_fail_the_contract(tiny):
    with pytest.raises(AssertionError, match=r"UnsortedDrafter.*row 0 = node 0 .* not best first: q\[1\]"):
        check_contract(toy(UnsortedDrafter), tiny)
    with pytest.raises(AssertionError, match=r"DuplicateDrafter.*token \d+ proposed twice \(columns 0 and 1\)"):
        check_contract(toy(DuplicateDrafter), tiny)
    check_commit_consistency(toy(UnsortedDrafter), tiny)  # the other checks are not about the order


def test_dishonest_flags_fail_the_flags_check(tiny):
    with pytest.raises(
        AssertionError, match=r"(?s)prefill\(\) raised AttributeError.*declares needs_target_hidden = False"
    ):
        check_flags(toy(HiddenLiarDrafter), tiny)
    with pytest.raises(AssertionError, match=r"provides_probabilities = True, but the q of .* sum to [\d.]+ > 1"):
        check_flags(toy(ScoresDrafter), tiny)


def test_check_drafter_lists_every_failed_check(tiny):
    with pytest.raises(AssertionError) as err:
        check_drafter(toy(NoRollbackDrafter), tiny, skip=["lossless"])
    msg = str(err.value)
    assert msg.startswith("2 of 7 drafter conformance checks failed")
    assert "[commit_consistency] drafter NoRollbackDrafter()" in msg and "[unproposed_nodes]" in msg
    assert "[contract]" not in msg
    check_drafter(toy(ToyDrafter), prompts=[[1, 2, 3, 2, 3]], max_new_tokens=8)  # default target
    with pytest.raises(ValueError, match="unknown checks"):
        check_drafter(toy(ToyDrafter), tiny, skip=["nope"])


def test_a_bad_prompt_is_refused_in_one_line_naming_it(tiny):
    """The kit encodes prompts as the Decoder does (``treespec.inputs.token_ids``) and names the bad one."""
    vocab = tiny.vocab_size
    with pytest.raises(ValueError, match=rf"^prompt #1: token id {vocab} is outside the target's vocabulary"):
        check_drafter(toy(ToyDrafter), tiny, prompts=[[1, 2, 3], [1, vocab]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"^prompt #0 is empty"):
        check_drafter(toy(ToyDrafter), tiny, prompts=[[]], max_new_tokens=4)
