"""The default pair's data (``treespec train pair``): the Python standard library's own source, a
reproducible train / held-out split, a byte-level BPE tokenizer trained on the train split, and both
splits tokenised once into flat token streams.

Corpus: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` in sorted path order, read as UTF-8
(undecodable files are skipped and listed), except

- installed packages: ``site-packages/``, ``dist-packages/`` (they differ from machine to machine);
- test suites: any ``test/``, ``tests/`` or ``idle_test/`` directory (Debian ships them in a separate
  package and the official Docker images delete them; they also hold deliberately broken files);
- packages that distributions split off or that later Pythons drop: ``idlelib/``, ``tkinter/``,
  ``turtledemo/``, ``lib2to3/``, ``distutils/``, ``ensurepip/``;
- data, not code: ``encodings/`` (generated codec tables), ``pydoc_data/`` (the documentation as a
  string literal), and the build's own ``_sysconfigdata_*.py`` and ``config-*/`` (machine-specific).

A file is held out when the first 8 bytes of sha256(its relative path) read as a fraction are below
``held_out``: the split depends on nothing but the path, so it is the same on every machine with the
same Python version, and a new file does not move any other. ``corpus_sha256`` (over every included
path and the sha256 of its content) tells whether two machines trained on the same text.

Tokens: ``<|endoftext|>`` (id 0) separates documents and is BOS, EOS and the tokenizer's automatic
prefix; ``<|pad|>`` (id 1) pads and never occurs in training. The streams are
``<|endoftext|> file₁ <|endoftext|> file₂ …`` as uint16, cached in ``OUT/data/`` with the key they were
built from; a matching cache is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from treespec.errors import ConfigError
from treespec.files import save_atomic_with, write_text_atomic, writing
from treespec.train.code_prompts import write_prompts

EOT, PAD = "<|endoftext|>", "<|pad|>"
EOT_ID, PAD_ID = 0, 1
SKIPPED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",  # installed packages
        "test",
        "tests",
        "idle_test",  # test suites
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "distutils",
        "ensurepip",  # split off / dropped
        "encodings",
        "pydoc_data",  # data, not code
    }
)
DATA_VERSION = 1
MAX_TOKEN_BYTES = 16  # longest merge the BPE trainer may make: long runs of '#' or '-' waste vocabulary


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the stdlib directory, '/'-separated
    text: str


@dataclass
class Corpus:
    root: str
    train: list[SourceFile]
    held_out: list[SourceFile]
    skipped: list[str] = field(default_factory=list)  # undecodable as UTF-8
    sha256: str = ""

    def facts(self) -> dict[str, Any]:
        def size(files: list[SourceFile]) -> int:
            return sum(len(f.text.encode("utf-8")) for f in files)

        return {
            "source": "Python standard library *.py (treespec.train.pair_data)",
            "python": sys.version.split()[0],
            "implementation": sys.implementation.name,
            "stdlib": self.root,
            "train_files": len(self.train),
            "held_out_files": len(self.held_out),
            "train_bytes": size(self.train),
            "held_out_bytes": size(self.held_out),
            "undecodable_skipped": self.skipped,
            "corpus_sha256": self.sha256,
            "held_out_file_names": [f.rel for f in self.held_out],
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def included(rel: PurePosixPath) -> bool:
    """Whether a stdlib ``*.py`` path (relative) belongs to the corpus (see the module docstring)."""
    if any(part in SKIPPED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return False
    return not rel.name.startswith("_sysconfigdata_")


def is_held_out(rel: str, fraction: float) -> bool:
    """Stable, machine-independent split by the path alone."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < fraction


def load_corpus(held_out: float, max_files: int | None = None, root: Path | None = None) -> Corpus:
    """The stdlib corpus split into train / held-out. ``max_files``: only the first N included files
    in sorted order (tests)."""
    if not 0 < held_out < 1:
        raise ConfigError(f"--held-out must be between 0 and 1, got {held_out}")
    root = root or stdlib_root()
    if not root.is_dir():
        raise ConfigError(f"the standard library directory {root} does not exist; run with a regular CPython install")
    paths = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py") if p.is_file())
    paths = [(rel, p) for rel, p in paths if included(PurePosixPath(rel))]
    if max_files is not None:
        paths = paths[:max_files]
    corpus, digest = Corpus(root=str(root), train=[], held_out=[]), hashlib.sha256()
    for rel, p in paths:
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            corpus.skipped.append(rel)
            continue
        digest.update(f"{rel}\t{hashlib.sha256(raw).hexdigest()}\n".encode())
        (corpus.held_out if is_held_out(rel, held_out) else corpus.train).append(SourceFile(rel, text))
    corpus.sha256 = digest.hexdigest()
    if not corpus.train or not corpus.held_out:
        raise ConfigError(
            f"the split of {len(paths)} files has {len(corpus.train)} train and {len(corpus.held_out)} held-out files; "
            f"raise --max-files or change --held-out"
        )
    return corpus


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, context: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` (``tokenizers``): no normaliser, no prefix space,
    so ``decode(encode(x), skip_special_tokens=True) == x`` for any text; ``<|endoftext|>`` is
    prepended to every encoding (documents start with it in training too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if not 258 < vocab_size <= 65535:
        raise ConfigError(
            f"--vocab-size must be between 259 and 65535 (256 bytes, 2 special tokens, uint16 streams), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT, PAD],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=MAX_TOKEN_BYTES,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1", special_tokens=[(EOT, EOT_ID)]
    )
    assert tok.token_to_id(EOT) == EOT_ID and tok.token_to_id(PAD) == PAD_ID
    return wrap_tokenizer(tok, context)


def wrap_tokenizer(backend: Any, context: int) -> Any:
    """The ``transformers`` tokenizer around a ``tokenizers.Tokenizer``: BOS = EOS = ``<|endoftext|>``,
    pad ``<|pad|>``, no clean-up of spaces on decode (it would change source code)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=context,
    )


def encode_stream(tokenizer: Any, files: list[SourceFile]) -> Any:
    """``<|endoftext|> f₁ <|endoftext|> f₂ …`` as a numpy uint16 array [N]."""
    import numpy as np

    backend = tokenizer.backend_tokenizer
    backend.encode_special_tokens = True  # a file that spells "<|endoftext|>" holds text, not a boundary
    try:
        encs = backend.encode_batch([f.text for f in files], add_special_tokens=False)
    finally:
        backend.encode_special_tokens = False
    parts = [np.asarray([EOT_ID] + e.ids, dtype=np.uint16) for e in encs]
    return np.concatenate(parts)  # [N]


@dataclass
class PairData:
    tokenizer: Any
    train: Any  # numpy uint16 [N_train]
    held_out: Any  # numpy uint16 [N_held]
    facts: dict[str, Any]  # corpus facts + token counts


def prepare(
    held_out: float, max_files: int | None, vocab_size: int, context: int, out: Path, log: Callable[[str], None] = print
) -> PairData:
    """Corpus → tokenizer → token streams, reusing ``out`` (``OUT/data``) when its key matches."""
    import numpy as np
    from tokenizers import Tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpus = load_corpus(held_out, max_files)
    key = {
        "v": DATA_VERSION,
        "corpus_sha256": corpus.sha256,
        "held_out": held_out,
        "max_files": max_files,
        "vocab_size": vocab_size,
        "context": context,
        "max_token_bytes": MAX_TOKEN_BYTES,
    }
    meta_file, tok_dir = out / "meta.json", out / "tokenizer"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    if meta.get("key") == key:
        log(f"reusing the tokenizer and token streams in {out}")
        tokenizer = wrap_tokenizer(Tokenizer.from_file(str(tok_dir / "tokenizer.json")), context)
        train = np.fromfile(out / "train.u16", dtype=np.uint16)
        held = np.fromfile(out / "held_out.u16", dtype=np.uint16)
    else:
        out.mkdir(parents=True, exist_ok=True)
        meta_file.unlink(missing_ok=True)  # a half-written cache is never taken for a valid one
        facts = corpus.facts()
        log(
            f"corpus: {facts['train_files']} train files ({facts['train_bytes']:,} bytes), "
            f"{facts['held_out_files']} held out ({facts['held_out_bytes']:,} bytes) from {corpus.root}"
        )
        tokenizer = train_tokenizer([f.text for f in corpus.train], vocab_size, context)
        with writing(tok_dir, "--out"):
            tokenizer.save_pretrained(tok_dir)
        train, held = encode_stream(tokenizer, corpus.train), encode_stream(tokenizer, corpus.held_out)
        save_atomic_with(train.tofile, out / "train.u16", "--out")
        save_atomic_with(held.tofile, out / "held_out.u16", "--out")
        tok_hash = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
        meta = {
            "key": key,
            "facts": facts
            | {"train_tokens": int(train.size), "held_out_tokens": int(held.size), "tokenizer_sha256": tok_hash},
        }
        write_text_atomic(meta_file, json.dumps(meta, indent=2) + "\n", "--out")  # last: it marks the cache valid
        log(
            f"tokenizer: {vocab_size} tokens; {train.size:,} train tokens "
            f"({facts['train_bytes'] / max(1, train.size):.2f} bytes/token), {held.size:,} held-out tokens → {out}"
        )
    for split, files in (("train", corpus.train), ("held-out", corpus.held_out)):  # cheap: always rewritten
        write_prompts([(f.rel, f.text) for f in files], out / f"code-prompts-{split}.jsonl", limit=3000)
    if held.size < 2 or train.size < 2:
        raise ConfigError(
            f"the token streams are too short ({train.size} train, {held.size} held out); raise --max-files"
        )
    return PairData(tokenizer=tokenizer, train=train, held_out=held, facts=meta["facts"])
