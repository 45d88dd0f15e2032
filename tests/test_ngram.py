"""Drafter `ngram` (prompt lookup): unit tests on hand-made contexts, and lossless decoding on the real target."""

from __future__ import annotations

import pydantic
import pytest
import torch

import treespec
from conftest import tinystories_prompts
from treespec.errors import ConfigError
from treespec.interfaces import Commit, PrefillContext
from treespec.plugins.configs import NgramConfig
from treespec.plugins.ngram import NgramDrafter
from treespec.tree import DraftTree

MAX_NEW = 128


def make(prompt: list[int], **options) -> NgramDrafter:
    """A drafter over ``prompt``; the hand-made cases below read raw match shares (``prior=0``) unless
    they pass ``prior``."""
    options.setdefault("prior", 0.0)
    d = NgramDrafter(NgramConfig(**options), target=None)
    d.prefill(PrefillContext(input_ids=torch.tensor(prompt)))
    return d


def proposals(d: NgramDrafter, tree: DraftTree, nodes: list[int], k: int) -> list[list[tuple[int, float]]]:
    """Non-padding (token, q) per node, in the drafter's order."""
    p = d.expand(tree, torch.tensor(nodes), k)
    assert p.tokens.shape == p.q.shape == (len(nodes), k)
    assert p.tokens.dtype == torch.long and p.q.dtype == torch.float32
    return [[(int(t), round(float(q), 6)) for t, q in zip(tr, qr) if q > 0] for tr, qr in zip(p.tokens, p.q)]


def chain_tree(tokens: list[int]) -> tuple[DraftTree, int]:
    """A tree that is a single path root=tokens[0] → ... → tokens[-1]; returns it and the leaf's id."""
    tree = DraftTree(tokens[0])
    node = torch.zeros(1, dtype=torch.long)
    for t in tokens[1:]:
        node = tree.add_children(node, torch.tensor([t]), torch.tensor([1.0]))
    return tree, int(node[0])


# ---------------------------------------------------------------------- unit tests
def test_repeated_phrase_gives_its_continuations_ranked_by_count():
    # "5 6" is followed by 7 twice and by 8 once; the context ends with "5 6"
    d = make([5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 5, 6])
    assert proposals(d, DraftTree(6), [0], 4) == [[(7, round(2 / 3, 6)), (8, round(1 / 3, 6))]]
    assert not NgramDrafter.provides_probabilities and not NgramDrafter.needs_target_hidden


def test_the_longest_matching_ngram_wins():
    # the 3-gram "4 5 6" occurs once (→ 9); the 1-gram "6" occurs three times (→ 9, 7, 7)
    d = make([4, 5, 6, 9, 0, 6, 7, 1, 6, 7, 2, 4, 5, 6])
    assert proposals(d, DraftTree(6), [0], 4) == [[(9, 1.0)]]
    # restricted to unigrams, the counts of "6"'s followers decide
    d1 = make([4, 5, 6, 9, 0, 6, 7, 1, 6, 7, 2, 4, 5, 6], max_ngram=1)
    assert proposals(d1, DraftTree(6), [0], 4) == [[(7, round(2 / 3, 6)), (9, round(1 / 3, 6))]]
    # a 2-gram falls back when the 3-gram is new: "x 5 6" never seen, "5 6" seen once
    d2 = make([5, 6, 8, 3, 5, 6])
    assert proposals(d2, DraftTree(6), [0], 4) == [[(8, 1.0)]]


def test_ties_prefer_the_most_recent_occurrence_and_k_and_max_matches_cap():
    d = make([1, 10, 1, 11, 1, 12, 1])
    assert proposals(d, DraftTree(1), [0], 4) == [[(12, 0.333333), (11, 0.333333), (10, 0.333333)]]
    assert proposals(d, DraftTree(1), [0], 2) == [[(12, 0.333333), (11, 0.333333)]]  # q keeps the full total
    dm = make([1, 10, 1, 11, 1, 12, 1], max_matches=1)
    assert proposals(dm, DraftTree(1), [0], 4) == [[(12, 0.333333)]]


def test_no_match_gives_only_padding():
    d = make([1, 2, 3, 4, 5])
    p = d.expand(DraftTree(5), torch.tensor([0]), 3)
    assert p.q.shape == (1, 3) and bool((p.q == 0).all())
    # min_ngram = 2: a unigram match alone does not count
    d2 = make([7, 3, 9, 3], min_ngram=2)
    assert proposals(d2, DraftTree(3), [0], 3) == [[]]
    assert proposals(make([7, 3, 9, 3]), DraftTree(3), [0], 3) == [[(9, 1.0)]]
    # no nodes asked: an empty [0, k]
    assert d.expand(DraftTree(5), torch.zeros(0, dtype=torch.long), 3).tokens.shape == (0, 3)


def test_commit_updates_the_index():
    d = make([1, 2, 3])
    assert proposals(d, DraftTree(3), [0], 2) == [[]]
    d.commit(Commit(tokens=[4, 1, 2, 3]))  # sequence now 1 2 3 4 1 2 3
    assert d.seq == [1, 2, 3, 4, 1, 2, 3]
    assert proposals(d, DraftTree(3), [0], 2) == [[(4, 1.0)]]
    d.commit(Commit(tokens=[5, 1, 2, 3]))  # 1 2 3 4 1 2 3 5 1 2 3
    assert proposals(d, DraftTree(3), [0], 2) == [[(5, 0.5), (4, 0.5)]]
    # prefill starts over
    d.prefill(PrefillContext(input_ids=torch.tensor([1, 2, 3])))
    assert d.seq == [1, 2, 3] and proposals(d, DraftTree(3), [0], 2) == [[]]


def test_path_tokens_are_used_and_never_indexed():
    d = make([9, 1, 2, 3, 4, 8, 8])
    tree, leaf = chain_tree([8, 1, 2])  # context: 9 1 2 3 4 8 8 | 1 2
    assert proposals(d, tree, [leaf], 2) == [[(3, 1.0)]]
    # a match whose follower lies inside the path: context 0 5 6 | 7 3 5 6; "3 5 6" is new, "5 6" → 7
    d2 = make([0, 5, 6])
    tree2, leaf2 = chain_tree([6, 7, 3, 5, 6])
    assert proposals(d2, tree2, [leaf2], 2) == [[(7, 1.0)]]
    # several nodes at once, each with its own path: the root (→ nothing), and two siblings
    d3 = make([2, 4, 1, 3, 1, 4, 5, 1])  # "1" → 3 then 4 (tie, most recent first); "1 3" → 1; "1 4" → 5
    tree3 = DraftTree(1)
    kids = tree3.add_children(torch.tensor([0, 0]), torch.tensor([3, 4]), torch.tensor([0.5, 0.5]))
    got = proposals(d3, tree3, [0, *kids.tolist()], 2)
    assert got == [[(4, 0.5), (3, 0.5)], [(1, 1.0)], [(5, 1.0)]]
    # expanding changed nothing in the index
    assert d3.index == make([2, 4, 1, 3, 1, 4, 5, 1]).index and d3.seq == [2, 4, 1, 3, 1, 4, 5, 1]


@pytest.mark.parametrize("prior", [0.0, NgramConfig().prior, 1.5])
def test_index_matches_a_brute_force_scan(prior):
    """The index against a scan of the whole context, q by the documented formula count / (matches +
    prior / n²): the raw shares (prior 0), the default and another prior."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 6, (60,), generator=g).tolist()
    d = make(seq[:20], prior=prior)
    for i in range(20, 45, 5):
        d.commit(Commit(tokens=seq[i : i + 5]))
    assert d.seq == seq[:45]
    for cut in range(45, 61):
        ext = seq[45:cut]  # a path of 0..15 tokens below the root seq[44]
        ctx = d.seq + ext
        want = []
        for n in range(3, 0, -1):
            gram = ctx[-n:]
            follow = [(ctx[j + n], j + n) for j in range(len(ctx) - n) if ctx[j : j + n] == gram]
            if follow:
                counts: dict[int, list[int]] = {}
                for t, pos in follow:
                    counts.setdefault(t, [0, 0])
                    counts[t][0] += 1
                    counts[t][1] = pos
                best = sorted(counts.items(), key=lambda te: (-te[1][0], -te[1][1]))[:8]
                want = [(t, c / (len(follow) + prior / n**2)) for t, (c, _) in best]
                break
        assert d.lookup(ext, 8) == want


def test_a_longer_match_is_more_confident():
    """One earlier occurrence each: the follower of a 3-token match outranks the follower of a 1-token
    match (with the raw share both were q = 1), and a second occurrence raises q."""
    d = make([5, 6, 7, 1, 2, 3, 4, 9, 8, 3], prior=4.0)  # context ends in 3: 1-token match, follower 4
    (((tok1, q1),),) = proposals(d, DraftTree(3), [0], 1)
    d3 = make([1, 2, 3, 4, 9, 1, 2, 3], prior=4.0)  # ends in 1 2 3: 3-token match, follower 4
    (((tok3, q3),),) = proposals(d3, DraftTree(3), [0], 1)
    assert (tok1, tok3) == (4, 4)
    assert q1 == pytest.approx(1 / (1 + 4.0), abs=1e-6) and q3 == pytest.approx(1 / (1 + 4.0 / 9), abs=1e-6)
    twice = make([1, 2, 3, 4, 1, 2, 3, 4, 9, 1, 2, 3], prior=4.0)
    (((_, q3b),),) = proposals(twice, DraftTree(3), [0], 1)
    assert q3b == pytest.approx(2 / (2 + 4.0 / 9), abs=1e-6) and q3b > q3 > q1


def test_options_are_validated():
    with pytest.raises(ConfigError, match="min_ngram"):
        NgramDrafter(NgramConfig(min_ngram=4, max_ngram=2), target=None)
    with pytest.raises(pydantic.ValidationError, match="max_ngram"):
        NgramConfig(max_ngram=0)


# ---------------------------------------------------------------------- lossless, on the real target
@pytest.fixture(scope="module")
def prompts(target64):
    return [target64.tokenizer(p).input_ids for p in tinystories_prompts(12)]


@pytest.mark.parametrize("builder,b_opts", [("opt-tree", {"nodes": 10}), ("chain", {"k": 4})])
def test_lossless_and_faster_than_one_token_per_step(builder, b_opts, target64, greedy_reference, prompts):
    dec = treespec.Decoder(target64, drafter="ngram", builder=builder, builder_options=b_opts)
    assert isinstance(dec.drafter, NgramDrafter)
    failures, tokens, steps = [], 0, 0
    for ids in prompts:
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        if out.token_ids != want:
            failures.append(greedy_reference.explain(ids, out.token_ids, want))
        assert sum(s.emitted for s in out.stats.steps) == len(out.token_ids)
        tokens += len(out.token_ids)
        steps += out.stats.n_steps
    assert not failures, f"{len(failures)}/{len(prompts)} prompts differ:\n" + "\n".join(failures)
    tau = tokens / steps
    print(f"ngram + {builder} {b_opts}: τ = {tau:.3f} ({tokens} tokens in {steps} steps)")
    assert tau > 1.0
