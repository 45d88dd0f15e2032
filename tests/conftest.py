"""Shared fixtures: the real model and prompt sets in ../shared, and the target's own greedy outputs."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The models here are tiny: one thread per process is fastest, and two test processes (or a test and
# its `treespec` subprocess) with two OpenMP threads each on two cores slow every matmul ~100x.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# treespec.row_matmul: every test exercises a few-row product, the one compiled here (W·Xᵀ where no
# compiler exists); tests of `auto`, `on` (W·Xᵀ) and `off` set their own
os.environ.setdefault("TREESPEC_ROW_MATMUL", "native")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TREESPEC_SHARED", REPO.parent / "shared"))
STORIES260K = SHARED / "models" / "stories260K"
TINYSTORIES = SHARED / "prompts" / "tinystories_val.txt"

# stories260K was trained on llama2.c's TinyStories format, where every story starts with BOS (1)
# and none ends with EOS (2): the model ends a story by emitting BOS. The lossless tests make the
# target's generation_config stop at either, so that runs which end a story are covered too; the
# reference `generate` reads the same generation_config.
STORY_END_IDS = [2, 1]


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per usable core, capped at 8 (every worker
    loads its own models and fixtures). Usable cores are the affinity mask, lowered by a cgroup v2
    CPU quota if the container has one (os.cpu_count() would report the host's cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, min(cores, 8))


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not STORIES260K.is_dir():
        raise pytest.UsageError(f"{STORIES260K} is missing: the tests need ../shared (set TREESPEC_SHARED)")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (the exactness harness's vectorised verifications: their
    statistics do not depend on it, their speed does when -n 0 leaves torch the whole machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def hf_logging_info():
    """transformers logging at INFO with its progress bars on, as a program calling treespec may have
    it; the test's own settings back afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_info()
    hf_logging.enable_progress_bar()
    yield hf_logging
    hf_logging.set_verbosity(verbosity)
    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


def tinystories_prompts(n: int, cut_words: int = 25) -> list[str]:
    """The first n validation stories, each without its last ``cut_words`` words (at least 12 kept):
    real text, and some runs reach the story's end within 128 tokens."""
    stories = [s.strip() for s in TINYSTORIES.read_text().split("\n\n") if s.strip()]
    out = []
    for story in stories[:n]:
        words = story.split()
        out.append(" ".join(words[: max(12, len(words) - cut_words)]))
    return out


def assert_drafted_decodes_are_greedy(target, reference, prompts: int = 4, max_new_tokens: int = 48) -> None:
    """stories260K's first 3 layers drafting 12-node opt-tree trees for ``target``: every real prompt's
    output equals ``reference`` (the target's own ``generate(do_sample=False)``)."""
    import treespec

    dec = treespec.Decoder(
        target,
        drafter=str(STORIES260K),
        drafter_options={"layers": 3},
        builder="opt-tree",
        builder_options={"nodes": 12},
    )
    for text in tinystories_prompts(prompts):
        ids = target.tokenizer(text).input_ids
        assert dec.generate(ids, max_new_tokens=max_new_tokens).token_ids == reference(ids, max_new_tokens)


def assert_greedy_with_product(monkeypatch, product: str) -> None:
    """``assert_drafted_decodes_are_greedy`` on float32 stories260K with every forward's linear layers
    (the target's trees and the draft's) computed by the few-row ``product`` (one of
    ``row_matmul.CHOICES``) at every size, against the target's own ``generate(do_sample=False)``."""
    import torch

    import treespec
    from treespec import row_matmul
    from treespec.testing import GreedyReference

    target = treespec.TargetModel.load(str(STORIES260K))
    target.model.generation_config.eos_token_id = STORY_END_IDS
    threads = torch.get_num_threads()
    target.row_matmul.verdicts[threads] = (product,) * len(row_matmul.SIZES)
    monkeypatch.setitem(row_matmul._LATEST, threads, (product,) * len(row_matmul.SIZES))
    assert_drafted_decodes_are_greedy(target, GreedyReference(target))


@functools.cache
def eagle_head_dir() -> Path:
    """An EAGLE head for stories260K trained here once per session (≈ 10 s; trained heads are not
    committed): 240 TinyStories prompts the tests do not prompt with, 3 short epochs."""
    import tempfile

    from treespec.plugins.eagle_train import train

    out = Path(tempfile.mkdtemp(prefix="treespec-eagle-head-"))
    train(EAGLE_TEST_SETTINGS(out), log=lambda _: None)
    return out


@functools.cache
def eagle3_head_dir() -> Path:
    """An EAGLE-3 head for stories260K trained here once per session (≈ 15 s; not committed): the
    prompts of ``eagle_head_dir``, 3 unrolled steps, a 300-token draft vocabulary."""
    import tempfile

    from treespec.plugins.eagle3_train import Train3Settings, train3

    out = Path(tempfile.mkdtemp(prefix="treespec-eagle3-head-"))
    train3(
        Train3Settings(
            target=str(STORIES260K),
            data="tinystories",
            out=str(out),
            offset=200,
            limit=240,
            max_new_tokens=64,
            epochs=4,
            batch_size=16,
            lr=3e-3,
            ttt_steps=3,
            draft_vocab=300,
        ),
        log=lambda _: None,
    )
    return out


@functools.cache
def block_head_dir() -> Path:
    """A block drafter for stories260K trained here once per session (≈ 20 s; not committed): the
    continuations of ``eagle3_head_dir``'s run (``answers``), K = 4, one layer."""
    import tempfile

    from treespec.plugins.block_train import BlockSettings, train_block

    out = Path(tempfile.mkdtemp(prefix="treespec-block-"))
    train_block(
        BlockSettings(
            target=str(STORIES260K),
            data="tinystories",
            out=str(out),
            offset=200,
            limit=240,
            max_new_tokens=64,
            epochs=8,
            batch_size=16,
            lr=1e-2,
            block_size=4,
            draft_vocab=300,
            answers=str(eagle3_head_dir() / "data.pt"),
        ),
        log=lambda _: None,
    )
    return out


def EAGLE_TEST_SETTINGS(out: Path, **overrides):
    from treespec.plugins.eagle_train import TrainSettings

    base = dict(
        target=str(STORIES260K),
        data="tinystories",
        out=str(out),
        offset=200,
        limit=240,
        max_new_tokens=64,
        epochs=3,
        batch_size=16,
    )
    return TrainSettings(**(base | overrides))


@pytest.fixture(scope="session")
def target64():
    """stories260K in float64 (ties between the two best logits are vanishingly rare there)."""
    import treespec

    target = treespec.TargetModel.load(str(STORIES260K), dtype="float64")
    target.model.generation_config.eos_token_id = STORY_END_IDS
    return target


@pytest.fixture(scope="session")
def greedy_reference(target64):
    """The target's own ``generate(do_sample=False)`` (``treespec.testing.GreedyReference``)."""
    from treespec.testing import GreedyReference

    return GreedyReference(target64)


def ship_own_code(path: Path) -> None:
    """Make the model folder ``path`` map AutoModelForCausalLM to a Python file of its own, as hub
    repositories with custom code do; the class marks that its code ran (``RAN_CUSTOM_CODE``)."""
    import json

    (path / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n"
    )
    (path / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_custom import CustomConfig\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n    RAN_CUSTOM_CODE = True\n"
    )
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "custom-llama"
    config["auto_map"] = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(config))


def hf_cache(home: Path, repo_id: str, folder: Path, commit: str = "0" * 40) -> Path:
    """Put a local model folder into a Hugging Face cache at ``home`` (``HF_HOME``) as ``repo_id``,
    in the hub's own layout (hub/models--org--name/{refs/main, snapshots/COMMIT/...}), so that loading
    ``repo_id`` with HF_HUB_OFFLINE=1 finds it exactly as it would find a real download."""
    import shutil

    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    return snapshot


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """An empty treespec cache (GGUF conversions, blocks) for one test."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory):
    """GGUF files written by llama.cpp's gguf-py (tests/gguf_fixture.py) from treespec's 0.6M-parameter
    default draft, in F32 and the quantised Q8_0 and Q4_1 (SmolLM2's GGUF is Q4_1)."""
    pytest.importorskip("gguf")
    from gguf_fixture import write_llama_gguf

    import treespec

    source = Path(treespec.__file__).resolve().parent / "default_pair" / "draft"
    folder = tmp_path_factory.mktemp("gguf")
    return {q: write_llama_gguf(source, folder / f"draft-{q}.gguf", q) for q in ("F32", "Q8_0", "Q4_1")}
