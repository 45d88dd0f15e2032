"""Model resolution: local directories, the Hugging Face cache (offline), aliases."""

from __future__ import annotations

import os

import pytest

import treespec
from conftest import STORIES260K, ship_own_code
from treespec import catalog, models


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
    monkeypatch.setitem(catalog.MODEL_ALIASES, "tiny-stories", hub_cache)
    assert models.looks_like_model("tiny-stories")
    target = treespec.TargetModel.load("tiny-stories")
    assert target.config.num_hidden_layers == 5


def test_public_draft_aliases():
    assert catalog.resolve_name("llama-68m") == "JackFram/llama-68m"
    assert catalog.resolve_name("llama-160m") == "JackFram/llama-160m"
    assert catalog.resolve_name("some/other") == "some/other"


def test_drafter_flag_reads_models_as_the_model_drafter():
    from treespec.factory import resolve_drafter_name

    assert resolve_drafter_name("llama-68m", {}) == ("model", {"model": "llama-68m"})
    assert resolve_drafter_name(str(STORIES260K), {"layers": 3}) == ("model", {"model": str(STORIES260K), "layers": 3})
    assert resolve_drafter_name("model", {"model": "x"}) == ("model", {"model": "x"})
    with pytest.raises(treespec.ConfigError, match="did you mean"):
        resolve_drafter_name("lama-68m", {})


def test_treespec_own_aliases_are_package_folders():
    for alias in ("treespec-py", "treespec-py-draft", "treespec-py-eagle"):
        folder = catalog.PACKAGED_MODELS[alias]
        assert catalog.resolve_name(alias) == str(folder) and (folder / "config.json").is_file()
        assert folder.is_relative_to(os.path.dirname(treespec.__file__))
    assert models.looks_like_model("treespec-py-draft")
    assert catalog.DEFAULT_TARGET == "treespec-py"


def _custom_code_model(path):
    """A local model whose config maps AutoModelForCausalLM to its own Python file."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(path)
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


def _tampered_copy(path, weights=None, config=None):
    """A copy of stories260K whose weights (``weights(state) -> state``) or config were changed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(STORIES260K, path)
    if weights is not None:
        state = weights(load_file(path / "model.safetensors"))
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (path / "config.json").write_text(json.dumps(config(json.loads((path / "config.json").read_text()))))
    return str(path)


@pytest.mark.parametrize("case", ["layer_missing", "renamed", "config_deeper", "wrong_shape"])
def test_weights_that_do_not_fill_the_config_are_refused(tmp_path, case):
    """transformers fills missing weights at random and says so only in a log treespec keeps quiet:
    such a model decoded garbage with exit 0. Now it is one line naming the weights and the fix."""
    import torch

    make = {
        "layer_missing": dict(weights=lambda sd: {k: v for k, v in sd.items() if ".layers.1." not in k}),
        "renamed": dict(weights=lambda sd: {k.replace("model.", "\ufffd"): v for k, v in sd.items()}),
        "config_deeper": dict(config=lambda c: c | {"num_hidden_layers": 40}),
        "wrong_shape": dict(weights=lambda sd: sd | {"model.norm.weight": torch.ones(3)}),
    }[case]
    path = _tampered_copy(tmp_path / "m", **make)
    with pytest.raises((treespec.ModelLoadError, treespec.ConfigError)) as err:
        treespec.Decoder(path, drafter="ngram")
    msg = str(err.value)
    assert "\n" not in msg and "'" + path + "'" in msg and "fix config.json" in msg
    assert ("other shapes" if case == "wrong_shape" else "missing from the checkpoint") in msg


def test_a_self_draft_of_the_first_layers_still_loads():
    """Weights the config does not use (layers a self-draft skips) are not a reason to refuse."""
    model = models.load_causal_lm(str(STORIES260K), num_hidden_layers=2)
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize("bars", [True, False])
def test_loading_gives_the_callers_transformers_settings_back(bars, hf_logging_info):
    """Loading hides transformers' warnings and progress bars, then restores the caller's choices."""
    hf_logging = hf_logging_info
    if not bars:
        hf_logging.disable_progress_bar()
    models.load_tokenizer(str(STORIES260K))
    models.load_causal_lm(str(STORIES260K))
    assert hf_logging.get_verbosity() == hf_logging.INFO and hf_logging.is_progress_bar_enabled() == bars
