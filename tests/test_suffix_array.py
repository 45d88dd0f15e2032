"""The datastore's suffix array (libdivsufsort through pydivsufsort) against references that share
nothing with it: Python's own sort of the suffixes as lists, and, for a whole corpus, the definition
itself (a permutation whose neighbours are in strictly increasing order)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import STORIES260K, TINYSTORIES
from treespec.plugins.datastore_index import (
    FORMAT_VERSION,
    SENTINEL,
    Index,
    suffix_array,
)


def by_sorting(tokens: np.ndarray) -> list[int]:
    """The suffix array by definition: positions sorted by their suffixes as Python lists."""
    seq = tokens.tolist()
    return sorted(range(len(seq)), key=lambda i: seq[i:])


def suffix_before(seq: list[int], a: int, b: int, width: int = 32) -> bool:
    """seq[a:] < seq[b:] (a != b), compared a window at a time (a tie over a window reads the next)."""
    n = len(seq)
    while True:
        x, y = seq[a : a + width], seq[b : b + width]
        if x != y:
            return x < y
        if a + width >= n:  # a's suffix ended inside the window and is a prefix of b's: shorter first
            return True
        if b + width >= n:
            return False
        a, b = a + width, b + width


def assert_is_suffix_array(tokens: np.ndarray, sa: np.ndarray) -> None:
    """A permutation of 0..n-1 whose consecutive suffixes are strictly increasing (all suffixes differ,
    so this is the one suffix array)."""
    n = len(tokens)
    assert sa.shape == (n,) and np.array_equal(np.sort(sa), np.arange(n))
    seq = tokens.tolist()
    bad = [k for k, (a, b) in enumerate(zip(sa[:-1].tolist(), sa[1:].tolist())) if not suffix_before(seq, a, b)]
    assert not bad, f"suffixes out of order at slots {bad[:5]}"


@pytest.fixture(scope="module")
def story_tokens() -> np.ndarray:
    """TinyStories validation stories tokenised by stories260K (512 ids: beyond one byte), each ended
    by the sentinel, as the datastore lays out a corpus."""
    tok = AutoTokenizer.from_pretrained(str(STORIES260K))
    stories = [s.strip() for s in TINYSTORIES.read_text().split("\n\n") if s.strip()]
    ids = tok(stories, add_special_tokens=False)["input_ids"]
    return np.concatenate([np.asarray([*d, SENTINEL], dtype=np.int32) for d in ids if d])


def test_random_short_sequences_equal_sorting_the_suffixes():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 60))
        tokens = rng.integers(-1, int(rng.integers(1, 6)), n).astype(np.int32)  # -1 = document end
        assert suffix_array(tokens).tolist() == by_sorting(tokens)
    periodic = np.tile(np.array([3, 1, 3, 1, 2], dtype=np.int32), 40)  # long repeats
    assert suffix_array(periodic).tolist() == by_sorting(periodic)


def test_real_text_equals_sorting_the_suffixes(story_tokens):
    head = story_tokens[:3000]  # ~15 stories: "Once upon a time" and friends repeat
    assert int(head.max()) > 255 and (head == SENTINEL).sum() > 5
    sa = suffix_array(head)
    assert sa.dtype == np.int64 and sa.tolist() == by_sorting(head)


def test_a_whole_real_corpus_is_a_suffix_array(story_tokens):
    assert len(story_tokens) > 200_000
    assert_is_suffix_array(story_tokens, suffix_array(story_tokens))


@pytest.mark.parametrize("top", [256, 49_152, 2**20, 2**31 - 1], ids=["byte", "smollm2-vocab", "3-byte", "int32-max"])
def test_real_text_in_wide_alphabets(story_tokens, top):
    """The same text with its ids moved by a random map into [0, top) (one-to-one where the range is
    larger than the tokenizer's 512 ids): one byte, a 49,152-token vocabulary (SmolLM2's), three
    bytes, and int32's largest id beside the sentinel. The map does not keep the ids' order."""
    rng = np.random.default_rng(top)
    vocab = int(story_tokens.max()) + 1
    lift = rng.choice(top, size=vocab, replace=top < vocab)
    head = story_tokens[:2000]
    lift[head[0]] = top - 1  # the largest id of the range occurs
    mapped = np.where(head == SENTINEL, SENTINEL, lift[np.maximum(head, 0)]).astype(np.int32)
    assert mapped.max() == top - 1 and mapped.min() == SENTINEL
    assert suffix_array(mapped).tolist() == by_sorting(mapped)


@pytest.mark.parametrize(
    "tokens",
    [[], [7], [SENTINEL], [5, 5, 5, 5, 5, 5, 5, 5], [SENTINEL] * 5, [0, SENTINEL], [2**31 - 1, 0, SENTINEL, 2**31 - 1]],
    ids=["empty", "one", "sentinel", "all-equal", "all-sentinels", "zero-then-sentinel", "extremes"],
)
def test_edge_cases(tokens):
    arr = np.asarray(tokens, dtype=np.int32)
    sa = suffix_array(arr)
    assert sa.dtype == np.int64 and sa.tolist() == by_sorting(arr)


def test_other_integer_dtypes_and_strided_input(story_tokens):
    head = story_tokens[:1500]
    want = by_sorting(head)
    assert suffix_array(head.astype(np.int64)).tolist() == want
    assert suffix_array(head.astype(np.int16)).tolist() == want
    every_other = story_tokens[:3000:2]  # a non-contiguous view
    assert suffix_array(every_other).tolist() == by_sorting(every_other)
    all_equal = np.full(3000, 42, dtype=np.int32)  # the longest repeat there is
    assert suffix_array(all_equal).tolist() == list(range(2999, -1, -1))


def test_an_index_file_of_the_format_before_the_library_still_loads_unchanged(tmp_path, story_tokens):
    """Format 1 is unchanged: a file written as that format describes (its suffix array sorted here by
    definition) loads, and building the same documents now gives the same arrays, so cached indexes
    stay valid and are not rebuilt."""
    docs = np.split(story_tokens[:2500], np.flatnonzero(story_tokens[:2500] == SENTINEL) + 1)
    docs = [d[:-1].tolist() for d in docs if len(d) > 1 and d[-1] == SENTINEL]
    tokens = np.concatenate([np.asarray([*d, SENTINEL], dtype=np.int32) for d in docs])
    header = {"format": 1, "tokens": sum(map(len, docs)), "documents": len(docs)}
    path = tmp_path / "old.npz"
    np.savez(
        path, tokens=tokens, sa=np.asarray(by_sorting(tokens), dtype=np.int32), header=np.array(json.dumps(header))
    )
    old = Index.load(path)
    new = Index.from_documents(docs)
    assert FORMAT_VERSION == 1 and new.header == old.header
    assert np.array_equal(new.tokens, old.tokens) and new.sa.dtype == old.sa.dtype == np.int32
    assert np.array_equal(new.sa, old.sa)
