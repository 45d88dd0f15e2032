"""Drafter `datastore` (REST-style retrieval): the suffix array, the index file and its cache, lookups on
hand-made token corpora, `treespec datastore build`, and lossless decoding on the real target."""

from __future__ import annotations

import functools
import gzip
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pydantic
import pytest
import torch
from typer.testing import CliRunner

import treespec
from conftest import STORIES260K, TINYSTORIES, tinystories_prompts
from treespec.cli.app import app
from treespec.errors import ConfigError
from treespec.interfaces import Commit, PrefillContext
from treespec.plugins.configs import DatastoreConfig
from treespec.plugins.datastore import DatastoreDrafter
from treespec.plugins.datastore_index import Index, cache_path, default_cache_dir, open_index
from treespec.testing import DrafterConformance
from treespec.tree import DraftTree

MAX_NEW = 128


class NumberTokenizer:
    """Text "5 6 7" → ids [5, 6, 7]; ``vocab`` sets its vocabulary (and so its hash)."""

    def __init__(self, vocab: int = 64, name: str = "numbers"):
        self.name_or_path = name
        self.vocab = {f"t{i}": i for i in range(vocab)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __call__(self, texts: list[str], add_special_tokens: bool = False, verbose: bool = False) -> dict:
        return {"input_ids": [[int(w) for w in t.split()] for t in texts]}


def fake_target(vocab: int = 64) -> SimpleNamespace:
    return SimpleNamespace(tokenizer=NumberTokenizer(vocab), vocab_size=vocab)


def make(docs: list[list[int]], prompt: list[int], **options) -> DatastoreDrafter:
    cfg = DatastoreConfig(corpus="unused", **options)
    d = DatastoreDrafter(cfg, target=None, index=Index.from_documents(docs))
    d.prefill(PrefillContext(input_ids=torch.tensor(prompt)))
    return d


def proposals(d: DatastoreDrafter, tree: DraftTree, nodes: list[int], k: int) -> list[list[tuple[int, float]]]:
    """Non-padding (token, q) per node, in the drafter's order; checks the Proposals conventions."""
    p = d.expand(tree, torch.tensor(nodes, dtype=torch.long), k)
    assert p.tokens.shape == p.q.shape == (len(nodes), k)
    assert p.tokens.dtype == torch.long and p.q.dtype == torch.float32
    for row in p.q:  # padding only at the end
        nz = (row > 0).tolist()
        assert nz == sorted(nz, reverse=True)
    return [[(int(t), round(float(q), 6)) for t, q in zip(tr, qr) if q > 0] for tr, qr in zip(p.tokens, p.q)]


def write_corpus(path, docs: list[list[int]]) -> str:
    path.write_text("\n\n".join(" ".join(map(str, d)) for d in docs) + "\n")
    return str(path)


# ---------------------------------------------------------------------- ranges (the suffix array: test_suffix_array.py)
def test_ranges_find_exactly_the_occurrences():
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 4, int(rng.integers(1, 30))).tolist() for _ in range(20)]
    index = Index.from_documents(docs)
    toks = index.tokens.tolist()
    pats = [rng.integers(0, 4, int(rng.integers(1, 5))).tolist() for _ in range(50)]
    lo, hi = index.ranges(np.array([p + [0] * (4 - len(p)) for p in pats]), np.array([len(p) for p in pats]))
    for p, a, b in zip(pats, lo.tolist(), hi.tolist()):
        want = sorted(i for i in range(len(toks) - len(p) + 1) if toks[i : i + len(p)] == p)
        assert sorted(index.sa[a:b].tolist()) == want


# ---------------------------------------------------------------------- lookups
def test_the_longest_suffix_wins_and_shorter_ones_are_the_fallback():
    docs = [[4, 5, 6, 9], [8, 5, 6, 7], [3, 5, 6, 7]]
    assert proposals(make(docs, [4, 5, 6]), DraftTree(6), [0], 4) == [[(9, 1.0)]]  # "4 5 6" → 9
    # "2 5 6" never occurs: "5 6" is followed by 9, 7, 7
    assert proposals(make(docs, [2, 5, 6]), DraftTree(6), [0], 4) == [[(7, 0.666667), (9, 0.333333)]]
    # max_suffix=2 ignores the longer match
    assert proposals(make(docs, [4, 5, 6], max_suffix=2), DraftTree(6), [0], 4) == [[(7, 0.666667), (9, 0.333333)]]
    assert not DatastoreDrafter.provides_probabilities and not DatastoreDrafter.needs_target_hidden


def test_counts_rank_followers_and_ties_go_to_the_smaller_token_id():
    docs = [[1, 2, 10], [1, 2, 11], [1, 2, 11], [1, 2, 12], [1, 2, 3]]
    d = make(docs, [1, 2])
    assert proposals(d, DraftTree(2), [0], 4) == [[(11, 0.4), (3, 0.2), (10, 0.2), (12, 0.2)]]
    assert proposals(d, DraftTree(2), [0], 2) == [[(11, 0.4), (3, 0.2)]]  # q keeps the full total


def test_max_matches_reads_evenly_spread_occurrences():
    docs = [[1, 2, 3]] * 70 + [[1, 2, 4]] * 30
    assert proposals(make(docs, [1, 2], max_matches=10), DraftTree(2), [0], 2) == [[(3, 0.7), (4, 0.3)]]
    assert proposals(make(docs, [1, 2], max_matches=1000), DraftTree(2), [0], 2) == [[(3, 0.7), (4, 0.3)]]


def test_matches_never_cross_document_boundaries():
    docs = [[5, 6], [7, 8], [1, 2], [3, 9]]
    # "6 7" and "2 3" exist only across a boundary
    assert proposals(make(docs, [0, 6, 7]), DraftTree(7), [0], 3) == [[]]
    assert proposals(make(docs, [0, 6, 7], min_suffix=1), DraftTree(7), [0], 3) == [[(8, 1.0)]]
    # "1 2" ends its document: nothing follows it (not 3), and no shorter suffix has a follower either
    assert proposals(make(docs, [1, 2], min_suffix=1), DraftTree(2), [0], 3) == [[]]
    # a suffix that ends a document somewhere and continues elsewhere counts only the continuation
    assert proposals(make([[5, 6], [5, 6, 8]], [5, 6]), DraftTree(6), [0], 3) == [[(8, 1.0)]]


def test_no_match_gives_padding():
    d = make([[1, 2, 3]], [7, 8])
    p = d.expand(DraftTree(8), torch.tensor([0]), 3)
    assert p.q.shape == (1, 3) and bool((p.q == 0).all()) and p.tokens.dtype == torch.long
    assert proposals(make([[1, 2, 3]], [2]), DraftTree(2), [0], 3) == [[]]  # context shorter than min_suffix
    assert d.expand(DraftTree(8), torch.zeros(0, dtype=torch.long), 3).tokens.shape == (0, 3)


def test_path_tokens_are_the_context_and_commit_moves_it():
    docs = [[4, 5, 6, 9], [5, 7, 1]]
    d = make(docs, [0, 4])  # root 4
    tree = DraftTree(4)
    kids = tree.add_children(torch.tensor([0, 0]), torch.tensor([5, 8]), torch.tensor([0.5, 0.5]))
    grand = tree.add_children(kids[:1], torch.tensor([6]), torch.tensor([1.0]))
    got = proposals(d, tree, [0, *kids.tolist(), *grand.tolist()], 2)
    # root "0 4" → no 2-gram match; "4 5" → 6; "4 8" → none; "4 5 6" → 9
    assert got == [[], [(6, 1.0)], [], [(9, 1.0)]]
    d.commit(Commit(tokens=[5, 7]))  # sequence 0 4 5 7: "5 7" → 1
    assert d.tail == [0, 4, 5, 7] and proposals(d, DraftTree(7), [0], 2) == [[(1, 1.0)]]
    d.prefill(PrefillContext(input_ids=torch.tensor([4, 5])))
    assert proposals(d, DraftTree(5), [0], 2) == [[(6, 1.0)]]


def test_lookups_match_a_brute_force_scan():
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 5, int(rng.integers(2, 40))).tolist() for _ in range(30)]
    d = make(docs, [0], max_suffix=6, min_suffix=2, max_matches=10_000)
    contexts = [tuple(rng.integers(0, 5, int(rng.integers(1, 10))).tolist()) for _ in range(60)]
    for ctx, got in zip(contexts, d.lookup_many([c[-6:] for c in contexts])):
        want = []
        for n in range(min(6, len(ctx)), 1, -1):
            follow = [doc[j + n] for doc in docs for j in range(len(doc) - n) if tuple(doc[j : j + n]) == ctx[-n:]]
            if follow:
                counts = {t: follow.count(t) for t in set(follow)}
                want = [(t, c / len(follow)) for t, c in sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))]
                break
        assert got == want, ctx


def test_the_memo_is_bounded_and_answers_stay_right(monkeypatch):
    import treespec.plugins.datastore as ds

    monkeypatch.setattr(ds, "MEMO_LIMIT", 2)
    d = make([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [0])
    assert d.lookup_many([(1, 2), (4, 5)]) == [[(3, 1.0)], [(6, 1.0)]]
    assert d.lookup_many([(1, 2), (7, 8), (0, 1)]) == [[(3, 1.0)], [(9, 1.0)], []]  # clears on the way
    assert len(d.memo) <= 2


def test_options_are_validated():
    with pytest.raises(ConfigError, match="min_suffix"):
        DatastoreDrafter(
            DatastoreConfig(corpus="x", min_suffix=5, max_suffix=3), target=None, index=Index.from_documents([[1]])
        )
    with pytest.raises(pydantic.ValidationError, match="max_matches"):
        DatastoreConfig(corpus="x", max_matches=0)
    with pytest.raises(pydantic.ValidationError, match="corpus"):
        DatastoreConfig()  # corpus is required


# ---------------------------------------------------------------------- files, cache and errors
def test_index_save_load_round_trip_and_the_cache(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt", [[1, 2, 3], [4, 5], [1, 2, 6]])
    tok = NumberTokenizer()
    index = Index.build(corpus, tok)
    assert index.header["tokens"] == 8 and index.header["documents"] == 3
    assert index.tokens.tolist() == [1, 2, 3, -1, 4, 5, -1, 1, 2, 6, -1]
    saved = index.save(tmp_path / "idx.npz")
    back = Index.load(saved)
    assert (
        np.array_equal(back.tokens, index.tokens) and np.array_equal(back.sa, index.sa) and back.header == index.header
    )
    assert back.header["tokenizer"]["vocab_size"] == 64 and back.header["format"] == 1
    # a corpus file: built once into the cache (keyed by corpus and tokenizer), then loaded from it
    cache = tmp_path / "cache"
    _, path = open_index(corpus, tok, str(cache))
    assert path == cache_path(tmp_path / "c.txt", tok, cache) and path.is_file()
    stamp = path.stat().st_mtime_ns
    d = DatastoreDrafter(DatastoreConfig(corpus=corpus, cache_dir=str(cache)), fake_target())
    assert d.index_path == path and path.stat().st_mtime_ns == stamp
    d.prefill(PrefillContext(input_ids=torch.tensor([1, 2])))
    assert proposals(d, DraftTree(2), [0], 2) == [[(3, 0.5), (6, 0.5)]]
    # another tokenizer gets its own cache entry; a given index file is used as is
    assert cache_path(tmp_path / "c.txt", NumberTokenizer(65), cache) != path
    assert DatastoreDrafter(DatastoreConfig(corpus=str(saved)), fake_target()).index_path == saved


def test_default_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "treespec" / "datastore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(default_cache_dir()).endswith(".cache/treespec/datastore")


def test_an_index_of_another_tokenizer_is_refused(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt", [[1, 2, 3]])
    saved = Index.build(corpus, NumberTokenizer(64)).save(tmp_path / "idx.npz")
    with pytest.raises(ConfigError, match=r"tokenizer.*rebuild") as exc:
        DatastoreDrafter(DatastoreConfig(corpus=str(saved)), fake_target(vocab=65))
    assert "\n" not in str(exc.value)


def test_corpus_errors_are_one_line(tmp_path):
    for corpus, match in [
        (str(tmp_path / "missing.txt"), "not found"),
        (str(tmp_path / "missing.npz"), "not found"),
    ]:
        with pytest.raises(ConfigError, match=match) as exc:
            DatastoreDrafter(DatastoreConfig(corpus=corpus, cache_dir=str(tmp_path)), fake_target())
        assert "\n" not in str(exc.value)
    (tmp_path / "c.csv").write_text("1,2")
    (tmp_path / "bad.jsonl").write_text('{"title": "x"}\n')
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "junk.npz").write_text("not a zip")
    for name, match in [
        ("c.csv", "unknown format"),
        ("bad.jsonl", "line 1"),
        ("empty.txt", "no documents"),
        ("junk.npz", "not a datastore index"),
    ]:
        with pytest.raises(ConfigError, match=match) as exc:
            DatastoreDrafter(DatastoreConfig(corpus=str(tmp_path / name), cache_dir=str(tmp_path)), fake_target())
        assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="tokenizer"):
        DatastoreDrafter(DatastoreConfig(corpus=str(tmp_path / "empty.txt")), SimpleNamespace(tokenizer=None))


def test_jsonl_corpora_with_text_or_turns(tmp_path):
    rows = [{"text": "1 2 3"}, {"turns": ["4 5", "6"]}, {"text": ""}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows))
    for name in ("c.jsonl", "c.jsonl.gz"):
        index = Index.build(tmp_path / name, NumberTokenizer())
        assert index.tokens.tolist() == [1, 2, 3, -1, 4, 5, 6, -1] and index.header["documents"] == 2


# ---------------------------------------------------------------------- CLI
def test_cli_build_writes_the_index_and_prints_one_line(tmp_path, target64):
    stories = TINYSTORIES.read_text().split("\n\n")[:20]
    corpus = tmp_path / "small.txt"
    corpus.write_text("\n\n".join(stories))
    runner = CliRunner()
    out = tmp_path / "small.npz"
    res = runner.invoke(app, ["datastore", "build", str(corpus), "--target", str(STORIES260K), "--out", str(out)])
    assert res.exit_code == 0, res.output
    m = re.fullmatch(r"(\d+) tokens, (\d+) documents, [\d.]+ s, (.+)\n", res.stdout)
    assert m and m.group(3) == str(out), res.stdout
    index = Index.load(out)
    assert index.header["tokens"] == int(m.group(1)) and index.header["documents"] == int(m.group(2)) == 20
    index.check_tokenizer(target64.tokenizer, str(out))  # the target's tokenizer: accepted
    # without --out: into the cache, where the drafter finds it
    res = runner.invoke(
        app, ["datastore", "build", str(corpus), "--target", str(STORIES260K), "--cache-dir", str(tmp_path / "cache")]
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith(str(cache_path(corpus, target64.tokenizer, tmp_path / "cache")))
    res = runner.invoke(app, ["datastore", "build", str(tmp_path / "nope.txt"), "--target", str(STORIES260K)])
    assert res.exit_code == 2 and "not found" in res.stderr


# ---------------------------------------------------------------------- lossless, on the real target
@pytest.fixture(scope="module")
def story_corpus(tmp_path_factory) -> tuple[str, str]:
    """The validation stories the prompts do not come from (all but the first 50), and a cache folder."""
    folder = tmp_path_factory.mktemp("datastore")
    stories = [s.strip() for s in TINYSTORIES.read_text().split("\n\n") if s.strip()]
    corpus = folder / "stories.txt"
    corpus.write_text("\n\n".join(stories[50:]) + "\n")
    return str(corpus), str(folder / "cache")


@pytest.mark.parametrize("builder,b_opts", [("opt-tree", {"nodes": 25}), ("chain", {"k": 4})])
def test_lossless_and_accepts_drafted_tokens(builder, b_opts, target64, greedy_reference, story_corpus):
    corpus, cache = story_corpus
    dec = treespec.Decoder(
        target64,
        drafter="datastore",
        builder=builder,
        builder_options=b_opts,
        drafter_options={"corpus": corpus, "cache_dir": cache},
    )
    assert isinstance(dec.drafter, DatastoreDrafter)
    failures, tokens, steps = [], 0, 0
    for text in tinystories_prompts(8):
        ids = target64.tokenizer(text).input_ids
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        if out.token_ids != want:
            failures.append(greedy_reference.explain(ids, out.token_ids, want))
        assert sum(s.emitted for s in out.stats.steps) == len(out.token_ids)
        tokens += len(out.token_ids)
        steps += out.stats.n_steps
    assert not failures, f"{len(failures)}/8 prompts differ:\n" + "\n".join(failures)
    tau = tokens / steps
    print(f"datastore + {builder} {b_opts}: τ = {tau:.3f} ({tokens} tokens in {steps} steps)")
    assert tau > 1.0


# ---------------------------------------------------------------------- the drafter conformance suite
@functools.lru_cache(maxsize=1)
def _story_index(tokenizer) -> Index:
    """The stories the prompts do not come from, indexed in memory."""
    stories = [s.strip() for s in TINYSTORIES.read_text().split("\n\n") if s.strip()][50:]
    return Index.from_documents(tokenizer(stories, add_special_tokens=False)["input_ids"])


class TestDatastoreConformance(DrafterConformance):
    """``treespec.testing``'s suite on the real target (a node's proposals depend only on committed + path)."""

    max_new_tokens = 24
    path_exact = True
    expect_acceptance = True

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, target64):
        return target64

    def prompts(self):
        return tinystories_prompts(3)

    def make_drafter(self, target):
        return DatastoreDrafter(DatastoreConfig(corpus="in-memory"), target, index=_story_index(target.tokenizer))


# ---------------------------------------------------------------------- trusting files on disk (issue 16)
def test_a_cached_index_of_another_corpus_is_rebuilt(tmp_path):
    """A cache file whose header names another corpus (copied, or a stale file under the same key)
    is not used: the index is rebuilt from the corpus actually given."""
    tok, cache = NumberTokenizer(), tmp_path / "cache"
    corpus = write_corpus(tmp_path / "c.txt", [[1, 2, 3], [1, 2, 3]])
    other = write_corpus(tmp_path / "o.txt", [[1, 2, 9]])
    Index.build(other, tok).save(cache_path(tmp_path / "c.txt", tok, cache))  # the wrong index in c.txt's slot
    d = DatastoreDrafter(DatastoreConfig(corpus=corpus, cache_dir=str(cache)), fake_target())
    d.prefill(PrefillContext(input_ids=torch.tensor([1, 2])))
    assert proposals(d, DraftTree(2), [0], 2) == [[(3, 1.0)]]  # from c.txt, not 9 from o.txt
    assert Index.load(d.index_path).header["corpus"]["sha256"] != Index.build(other, tok).header["corpus"]["sha256"]


def test_index_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    from treespec.plugins.datastore_index import tokenizer_fingerprint

    header = {"tokenizer": tokenizer_fingerprint(NumberTokenizer())}  # the right tokenizer, a foreign id
    saved = Index.from_documents([[1, 2, 70]], header).save(tmp_path / "idx.npz")
    with pytest.raises(ConfigError, match=r"holds token id 70, outside the target's vocabulary \[0, 64\)"):
        DatastoreDrafter(DatastoreConfig(corpus=str(saved)), fake_target())


def test_index_files_are_written_through_an_unpredictable_temp_name(tmp_path, monkeypatch):
    import tempfile

    made = []
    real = tempfile.mkstemp

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkstemp", spy)
    corpus = write_corpus(tmp_path / "c.txt", [[1, 2, 3]])
    path = Index.build(corpus, NumberTokenizer()).save(tmp_path / "out" / "idx.npz")
    assert made and Path(made[0][1]).parent == path.parent and not Path(made[0][1]).exists()
    assert [p.name for p in path.parent.iterdir()] == ["idx.npz"]


def test_an_unusable_cache_dir_is_one_line(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt", [[1, 2, 3]])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="cannot write the index to") as exc:
        DatastoreDrafter(DatastoreConfig(corpus=corpus, cache_dir=str(tmp_path / "afile")), fake_target())
    assert "\n" not in str(exc.value)
