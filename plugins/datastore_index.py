"""The datastore's index: a suffix array over a tokenised corpus, built once and cached on disk.

The corpus's documents are tokenised (no special tokens) and concatenated, each followed by the
sentinel ``-1``: ``tokens = d₀ · ⊥ · d₁ · ⊥ · …`` ([N] int32). Queries hold real token ids (≥ 0),
so a match never contains ⊥ and never crosses a document boundary.

The suffix array ``sa`` ([N]) lists the start positions of all suffixes ``tokens[i:]`` in
lexicographic order (a shorter suffix sorts before its extensions). Every suffix starting with a
pattern P then lies in one contiguous range ``sa[lo:hi]``, found by binary search, and because those
suffixes are sorted the tokens that follow P, ``tokens[sa[lo:hi] + |P|]``, come out sorted too.

The array is built by libdivsufsort (``pydivsufsort``), which sorts bytes: token ids are handed
over as fixed-width big-endian words (the library's integer path: its suffixes at word boundaries
compare as the token sequences do), so an index with a vocabulary beyond 255 sorts exactly as its
ids. Building 850k real tokens takes a fraction of a second.

An index file is a ``.npz`` with ``tokens``, ``sa`` and ``header`` (JSON: format version, tokenizer
name / vocabulary size / sha256 of its vocabulary, corpus path and sha256, number of tokens and
documents). Torch-free: ``treespec datastore build`` and the drafter share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from pydivsufsort import divsufsort

from treespec.errors import ConfigError
from treespec.files import save_atomic_with
from treespec.inputs import json_lines

FORMAT_VERSION = 1
SENTINEL = -1  # ends every document; no query token is negative
CORPUS_FORMATS = ".txt (documents separated by blank lines), .jsonl or .jsonl.gz (a 'text' field or a 'turns' list)"


# ---------------------------------------------------------------------- suffix array
def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` ([N] ints) in lexicographic order ([N] int64)."""
    if tokens.shape[0] == 0:  # the library takes the minimum of its input
        return np.zeros(0, dtype=np.int64)
    return divsufsort(np.ascontiguousarray(tokens)).astype(np.int64)


# ---------------------------------------------------------------------- fingerprints
def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Name, vocabulary size and sha256 of the (token, id) pairs: what an index was tokenised with."""
    vocab = tokenizer.get_vocab()
    pairs = sorted(((int(i), str(t)) for t, i in vocab.items()))
    digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
    return {
        "name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        "vocab_size": len(vocab),
        "hash": digest,
    }


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------- corpus
def iter_documents(path: Path) -> Iterator[str]:
    """The documents of a corpus file, in order (see ``CORPUS_FORMATS``); a file that is not UTF-8,
    or a line that is not JSON, is one ``ConfigError`` line."""
    try:
        yield from _documents(path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"corpus {path} is not UTF-8 text (byte {exc.start}): convert it to UTF-8") from None
    except (OSError, EOFError) as exc:
        raise ConfigError(f"corpus {path} cannot be read ({type(exc).__name__}: {exc})") from None


def _documents(path: Path) -> Iterator[str]:
    name = path.name.lower()
    if name.endswith(".txt"):
        text = path.read_text(encoding="utf-8")
        yield from (d.strip() for d in text.split("\n\n") if d.strip())
        return
    if not name.endswith((".jsonl", ".jsonl.gz")):
        raise ConfigError(f"corpus {path}: unknown format; use {CORPUS_FORMATS}, or an index .npz")
    for n, row in json_lines(path, "corpus"):
        if "text" in row:
            text = str(row["text"])
        elif isinstance(row.get("turns"), list):
            text = "\n\n".join(str(t) for t in row["turns"])
        else:
            raise ConfigError(f"corpus {path} line {n}: no 'text' field or 'turns' list; give each line one")
        if text.strip():
            yield text


# ---------------------------------------------------------------------- the index
@dataclass
class Index:
    """``tokens`` [N] int32 (documents, each ended by ``SENTINEL``), ``sa`` [N] its suffix array."""

    tokens: np.ndarray
    sa: np.ndarray
    header: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_documents(cls, docs: list[list[int]] | Iterator[list[int]], header: dict[str, Any] | None = None) -> Index:
        """Index token-id documents; ``header`` adds facts (tokenizer, corpus) to the counts."""
        parts, n_docs, n_tokens = [], 0, 0
        for doc in docs:
            if len(doc):
                parts.append(np.asarray([*doc, SENTINEL], dtype=np.int32))
                n_docs += 1
                n_tokens += len(doc)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)  # [N]
        sa = suffix_array(tokens)
        sa = sa.astype(np.int32) if tokens.shape[0] < 2**31 else sa
        head = {"format": FORMAT_VERSION, **(header or {}), "tokens": n_tokens, "documents": n_docs}
        return cls(tokens=tokens, sa=sa, header=head)

    @classmethod
    def build(cls, corpus_path: str | Path, tokenizer: Any, batch: int = 512) -> Index:
        """Tokenise a corpus file with the target's tokenizer and index it."""
        path = Path(corpus_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"corpus {str(corpus_path)!r} not found; pass an existing {CORPUS_FORMATS} file")
        start = time.perf_counter()

        def tokenised() -> Iterator[list[int]]:
            texts: list[str] = []
            for text in iter_documents(path):
                texts.append(text)
                if len(texts) == batch:
                    yield from tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
                    texts = []
            if texts:
                yield from tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

        header = {
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "corpus": {"path": str(path.resolve()), "sha256": file_sha256(path)},
        }
        index = cls.from_documents(tokenised(), header)
        if index.header["documents"] == 0:
            raise ConfigError(f"corpus {path} holds no documents; give a non-empty {CORPUS_FORMATS} file")
        index.header["build_seconds"] = round(time.perf_counter() - start, 3)
        return index

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write the ``.npz`` atomically (``treespec.files``: a temporary file with an unpredictable name,
        then a rename); returns the path. A failed write (a full disk) is one ``ConfigError`` line."""
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the index to {path.parent} ({exc.strerror or exc}); pass another cache_dir= (or --out)"
            ) from None

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as fh:  # a file object: np.savez would add .npz to a name
                np.savez(fh, tokens=self.tokens, sa=self.sa, header=np.array(json.dumps(self.header)))

        save_atomic_with(write, path, "cache_dir= (or --out)")
        return path

    def check_vocabulary(self, vocab_size: int, where: str) -> None:
        """Refuse an index holding token ids the target does not have (a damaged or foreign file)."""
        real = self.tokens[self.tokens != SENTINEL]
        if real.size and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
            bad = int(real.max()) if int(real.max()) >= vocab_size else int(real.min())
            raise ConfigError(
                f"datastore index {where} holds token id {bad}, outside the target's vocabulary "
                f"[0, {vocab_size}); rebuild it with `treespec datastore build`"
            )

    @classmethod
    def load(cls, path: str | Path) -> Index:
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"index {str(path)!r} not found; build it with `treespec datastore build CORPUS --out {path}`"
            )
        st = path.stat()
        return _load(str(path.resolve()), st.st_mtime_ns, st.st_size)

    def check_tokenizer(self, tokenizer: Any, where: str) -> None:
        """Refuse an index tokenised with another vocabulary than ``tokenizer``'s."""
        want = tokenizer_fingerprint(tokenizer)
        have = self.header.get("tokenizer", {})
        if have.get("hash") != want["hash"]:
            raise ConfigError(
                f"datastore index {where} was built with tokenizer {have.get('name')!r} ({have.get('vocab_size')} tokens), "
                f"not the target's {want['name']!r} ({want['vocab_size']} tokens); rebuild it from the corpus with "
                f"`treespec datastore build CORPUS --target MODEL` or pass the corpus file as corpus=…"
            )

    # ------------------------------------------------------------------ queries
    def ranges(self, patterns: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each pattern ``patterns[i, :lengths[i]]`` ([Q, L] ids ≥ 0, [Q]) the slot range
        ``[lo, hi)`` of ``sa`` whose suffixes start with it (lo == hi: no occurrence). [Q], [Q].

        One vectorised binary search for all Q lower bounds (the first suffix that is not < P) and
        Q upper bounds (the first suffix that is not ≤ P), comparing only P's length. All 2Q
        searches start on the same range [0, N), so they can share one branch-free loop:
        ``base ← base + half`` where the probe is still "before" P; ⌈log₂ N⌉ rounds of [2Q, L] gathers.
        """
        n = int(self.sa.shape[0])
        q, width = patterns.shape
        pats = np.concatenate([patterns, patterns]).astype(self.tokens.dtype)  # [2Q, L]
        # "suffix before P": its first difference from P is < 0 (lower bound) or ≤ 0 (upper bound)
        limit = np.repeat([0, 1], q)  # [2Q]
        cols = np.arange(width)  # [L]
        used = cols[None, :] < np.concatenate([lengths, lengths])[:, None]  # [2Q, L]
        rows = np.arange(2 * q)

        def before(slots: np.ndarray) -> np.ndarray:  # [2Q] slots -> [2Q] bool
            start = self.sa[slots].astype(np.int64)  # [2Q]
            # past a document's sentinel the columns no longer matter (P differs at ⊥ already)
            seg = self.tokens[np.minimum(start[:, None] + cols, n - 1)]  # [2Q, L]
            diff = np.where(used, seg - pats, 0)  # [2Q, L]
            first = (diff != 0).argmax(1)  # [2Q] first differing column (0 if none)
            return diff[rows, first] < limit

        base = np.zeros(2 * q, dtype=np.int64)  # [2Q]
        if n == 0 or q == 0:
            return base[:q], base[q:]
        size = n
        while size > 1:  # invariant: the answer lies in [base, base + size]
            half = size // 2
            base = np.where(before(base + half), base + half, base)
            size -= half
        base += before(base)
        return base[:q], base[q:]

    def followers(self, lo: int, hi: int, length: int, max_matches: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens following the occurrences ``sa[lo:hi]`` of a pattern of ``length`` tokens, and how
        often: ([F] ids, [F] counts), best first (count descending, then token id ascending).

        More than ``max_matches`` occurrences: read ``max_matches`` of them at the midpoints of equal
        strata of the range. The followers are sorted along the range, so each follower's count is
        its share of the range to within one stratum. Document ends (⊥ follows) are not counted.
        """
        size = hi - lo
        if size <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if size <= max_matches:
            slots = np.arange(lo, hi)
        else:
            slots = lo + (2 * np.arange(max_matches) + 1) * size // (2 * max_matches)  # [max_matches]
        follow = self.tokens[self.sa[slots].astype(np.int64) + length]  # [S]
        follow = follow[follow != SENTINEL]
        toks, counts = np.unique(follow, return_counts=True)  # [F], [F]
        order = np.lexsort((toks, -counts))
        return toks[order].astype(np.int64), counts[order]


@lru_cache(maxsize=4)
def _load(path: str, _mtime_ns: int, _size: int) -> Index:
    """One load per file version and process (several Decoders may share an index)."""
    try:
        with np.load(path) as data:
            header = json.loads(str(data["header"]))
            tokens, sa = data["tokens"], data["sa"]
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(
            f"index {path}: not a datastore index ({type(exc).__name__}); rebuild it with `treespec datastore build`"
        ) from None
    if header.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"index {path} has format {header.get('format')}, this treespec reads {FORMAT_VERSION}; rebuild it with `treespec datastore build`"
        )
    return Index(tokens=tokens, sa=sa, header=header)


# ---------------------------------------------------------------------- the on-disk cache
def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/treespec/datastore``, else ``~/.cache/treespec/datastore``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "treespec" / "datastore"


def cache_path(corpus: Path, tokenizer: Any, cache_dir: str | Path | None = None) -> Path:
    """Where the index of ``corpus`` tokenised by ``tokenizer`` is cached: keyed by both hashes."""
    folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    stem = corpus.name.split(".")[0] or "corpus"
    return folder / f"{stem}-{file_sha256(corpus)[:16]}-{tokenizer_fingerprint(tokenizer)['hash'][:16]}.npz"


def open_index(corpus: str, tokenizer: Any, cache_dir: str | None = None) -> tuple[Index, Path]:
    """The index for the drafter's ``corpus`` option: an index file is loaded and its tokenizer
    checked; a corpus file's cached index is loaded, or built and cached first."""
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"drafter 'datastore': corpus {corpus!r} not found; pass corpus=FILE ({CORPUS_FORMATS}, or an index .npz)"
        )
    if path.name.lower().endswith(".npz"):
        index = Index.load(path)
        index.check_tokenizer(tokenizer, str(path))
        return index, path
    cached = cache_path(path, tokenizer, cache_dir)
    if cached.is_file():
        index = Index.load(cached)
        index.check_tokenizer(tokenizer, str(cached))
        if index.header.get("corpus", {}).get("sha256") == file_sha256(path):
            return index, cached
        # a cache file that was built from another corpus (its name says otherwise): rebuild it
    index = Index.build(path, tokenizer)
    index.save(cached)
    return index, cached
