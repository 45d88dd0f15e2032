"""Model resolution: local directories, the Hugging Face cache (offline), aliases."""

from __future__ import annotations

import os

import pytest

import treespec
from conftest import STORIES260K, ship_own_code
from treespec import models


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A real Hugging Face hub cache holding stories260K as `treespec-test/stories260K` (links, no copies)."""
    snapshot = tmp_path / "models--treespec-test--stories260K" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    for f in STORIES260K.iterdir():
        if f.is_file():
            os.symlink(f, snapshot / f.name)
    refs = tmp_path / "models--treespec-test--stories260K" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return "treespec-test/stories260K"


def test_hub_id_loads_from_the_local_cache_offline(hub_cache, greedy_reference):
    target = treespec.TargetModel.load(hub_cache, dtype="float64")
    assert target.vocab_size == 512 and target.max_positions == 512
    dec = treespec.Decoder(target, drafter=hub_cache, drafter_options={"layers": 4}, builder="chain")
    ids = target.tokenizer("Once upon a time").input_ids
    assert dec.generate(ids, max_new_tokens=24).token_ids == greedy_reference(ids, 24)


def test_alias_resolves_to_its_hub_id(hub_cache, monkeypatch):
    monkeypatch.setitem(models.MODEL_ALIASES, "tiny-stories", hub_cache)
    assert models.looks_like_model("tiny-stories")
    target = treespec.TargetModel.load("tiny-stories")
    assert target.config.num_hidden_layers == 5


def test_public_draft_aliases():
    assert models.resolve_name("llama-68m") == "JackFram/llama-68m"
    assert models.resolve_name("llama-160m") == "JackFram/llama-160m"
    assert models.resolve_name("some/other") == "some/other"


def test_drafter_flag_reads_models_as_the_model_drafter():
    from treespec.factory import resolve_drafter_name

    assert resolve_drafter_name("llama-68m", {}) == ("model", {"model": "llama-68m"})
    assert resolve_drafter_name(str(STORIES260K), {"layers": 3}) == ("model", {"model": str(STORIES260K), "layers": 3})
    assert resolve_drafter_name("model", {"model": "x"}) == ("model", {"model": "x"})
    with pytest.raises(treespec.ConfigError, match="did you mean"):
        resolve_drafter_name("lama-68m", {})


def test_treespec_own_aliases_are_package_folders():
    for alias in ("treespec-py", "treespec-py-draft", "treespec-py-eagle"):
        folder = models.PACKAGED_MODELS[alias]
        assert models.resolve_name(alias) == str(folder) and (folder / "config.json").is_file()
        assert folder.is_relative_to(os.path.dirname(treespec.__file__))
    assert models.looks_like_model("treespec-py-draft")
    assert models.DEFAULT_TARGET == "treespec-py"


def _custom_code_model(path):
    """A local model whose config maps AutoModelForCausalLM to its own Python file."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(path)
    ship_own_code(path)


@pytest.mark.parametrize("value", ["false", "False", "no", 1, 0, None])
def test_remote_code_needs_a_literal_bool(tmp_path, value):
    """Only the literal True runs a model's own code: a string such as "false" is truthy, and used to."""
    _custom_code_model(tmp_path / "m")
    with pytest.raises(treespec.ConfigError, match="trust_remote_code must be True or False") as err:
        treespec.Decoder(str(tmp_path / "m"), drafter="ngram", trust_remote_code=value)
    assert "\n" not in str(err.value)
    with pytest.raises(treespec.ConfigError, match="literal True"):
        models.load_tokenizer(str(STORIES260K), trust_remote_code=value)


def test_remote_code_runs_only_when_allowed(tmp_path):
    _custom_code_model(tmp_path / "m")
    with pytest.raises(treespec.ModelLoadError) as err:
        models.load_causal_lm(str(tmp_path / "m"))
    msg = str(err.value)
    assert "\n" not in msg and "ships its own Python code" in msg and "--trust-remote-code to `treespec run`" in msg
    model = models.load_causal_lm(str(tmp_path / "m"), trust_remote_code=True)
    assert getattr(model, "RAN_CUSTOM_CODE", False)
