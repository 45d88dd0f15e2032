"""The model drafter's state, checked against ground truth: its distribution at every node equals
the draft model run on prefix + path as a plain sequence, across steps and odd builder behaviour."""

from __future__ import annotations

import pytest
import torch

import treespec
from conftest import STORIES260K
from treespec.interfaces import Commit, PrefillContext
from treespec.plugins.model_drafter import ModelDrafter
from treespec.tree import DraftTree


@pytest.fixture(scope="module")
def drafter(target64):
    return ModelDrafter(ModelDrafter.Config(model=str(STORIES260K), layers=3), target64)


def plain_probs(drafter, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = drafter.model(torch.tensor([tokens])).logits[0, -1, : drafter.vocab]
    return torch.softmax(logits.double(), -1)


def check_node(drafter, tree, committed, node, k=5):
    prop = drafter.expand(tree, torch.tensor([node]), k)
    want = plain_probs(drafter, committed[:-1] + tree.path_tokens(node))
    q, tok = want.topk(k)
    assert prop.tokens[0].tolist() == tok.tolist()
    assert torch.allclose(prop.q[0].double(), q, atol=1e-6)


def test_probabilities_match_plain_runs_across_steps_and_odd_orders(drafter, target64):
    committed = target64.tokenizer("Once upon a time, there was a little dog").input_ids
    drafter.prefill(PrefillContext(input_ids=torch.tensor(committed)))
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        tree = DraftTree(committed[-1])
        a = tree.add_children(
            torch.tensor([0, 0, 0]), torch.randint(3, 512, (3,), generator=gen), torch.full((3,), 0.3)
        )
        b = tree.add_children(a[[0, 0, 2]], torch.randint(3, 512, (3,), generator=gen), torch.full((3,), 0.3))
        c = tree.add_children(b[[1]], torch.randint(3, 512, (1,), generator=gen), torch.full((1,), 0.3))
        for node in (int(b[2]), int(c[0]), 0, int(a[1]), int(c[0])):  # another branch first, root later, twice
            check_node(drafter, tree, committed, node)
        path = tree.path(int(c[0]))[1 : 1 + step]  # accept 0..3 nodes of a fed path
        new = tree.tokens[path].tolist() + [int(torch.randint(3, 512, (1,), generator=gen))]
        drafter.commit(Commit(tokens=new))
        committed += new
        if step == 1:  # a step without any expansion
            new = [7, 9]
            drafter.commit(Commit(tokens=new))
            committed += new
    check_node(drafter, DraftTree(committed[-1]), committed, 0)


def test_a_second_tree_in_one_step_does_not_corrupt_the_cache(drafter, target64):
    committed = target64.tokenizer("One day, Lily went to the park").input_ids
    drafter.prefill(PrefillContext(input_ids=torch.tensor(committed)))
    drafter.begin_step(committed[-1])
    first = DraftTree(committed[-1])
    first.add_children(torch.tensor([0, 0]), torch.tensor([30, 40]), torch.tensor([0.5, 0.4]))
    drafter.expand(first, torch.tensor([1, 2]), 3)
    second = first.select(torch.tensor([0, 1]))  # a builder that continues on a pruned copy
    drafter.begin_step(committed[-1])  # ... starts its tree over: the drafter drops the first tree's rows
    check_node(drafter, second, committed, 1)
    drafter.commit(Commit(tokens=[30, 11]))
    committed += [30, 11]
    drafter.begin_step(committed[-1])
    check_node(drafter, DraftTree(committed[-1]), committed, 0)


def test_empty_request_and_partial_timing(drafter, target64):
    committed = target64.tokenizer("Hi").input_ids
    drafter.prefill(PrefillContext(input_ids=torch.tensor(committed)))
    prop = drafter.expand(DraftTree(committed[-1]), torch.zeros(0, dtype=torch.long), 4)
    assert prop.tokens.shape == (0, 4) and prop.q.shape == (0, 4)


class TooDeep(treespec.TreeBuilder):
    def build(self, drafter, root_token, max_depth):
        tree = DraftTree(root_token)
        node = torch.zeros(1, dtype=torch.long)
        for _ in range(max_depth + 1):
            node = tree.add_children(node, torch.tensor([5]), torch.tensor([0.5]))
        return tree


def test_a_builder_exceeding_max_depth_is_stopped_with_the_partial_output(target64):
    dec = treespec.Decoder(
        target64, drafter=str(STORIES260K), drafter_options={"layers": 3}, builder=TooDeep(treespec.PluginConfig())
    )
    with pytest.raises(treespec.DecodingError, match="depth .* > max_depth") as err:
        dec.generate("Once upon a time", max_new_tokens=3)
    assert err.value.output.stats.t_total > 0
