"""Bad input gets one clear line; a failure part-way keeps what was generated."""

from __future__ import annotations

import pytest

import treespec
from conftest import STORIES260K
from treespec.plugins.model_drafter import ModelDrafter


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg, msg
    return msg


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory, target64):
    """A model directory whose tokenizer has the target's size (512) but a different vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from conftest import TINYSTORIES

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([TINYSTORIES.read_text()[:200_000]], trainer)
    path = tmp_path_factory.mktemp("other-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_mismatched_tokenizer_is_refused_before_decoding(target64, other_tokenizer_model):
    with pytest.raises(treespec.ModelLoadError) as err:
        treespec.Decoder(target64, drafter=other_tokenizer_model)
    msg = _one_line(err.value)
    assert "does not share the tokenizer" in msg and "512 vs 512" in msg


def test_missing_model_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(treespec.ModelLoadError) as err:
        treespec.TargetModel.load("treespec-test/no-such-model")
    msg = _one_line(err.value)
    assert "not in the local" in msg and "local path" in msg


def test_missing_local_directory(tmp_path):
    with pytest.raises(treespec.ModelLoadError) as err:
        treespec.TargetModel.load(str(tmp_path / "nothing" / "here"))
    assert "does not exist" in _one_line(err.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(treespec.ModelLoadError) as err:
        treespec.TargetModel.load(str(tmp_path / "file"))
    assert "is not a directory" in _one_line(err.value)


@pytest.mark.parametrize(
    "builder,options,needle",
    [
        ("opt-tree", {"nodes": 0}, "option 'nodes': should be greater than 0, or should be 'auto' (got 0)"),
        ("opt-tree", {"nodes": -3}, "greater than 0"),
        ("chain", {"k": 0}, "greater than 0"),
        ("opt-tree", {"threshold": -1}, "threshold"),
        ("opt-tree", {"budget": 5}, "unknown option 'budget'"),
    ],
)
def test_bad_builder_options(target64, builder, options, needle):
    with pytest.raises(treespec.ConfigError) as err:
        treespec.Decoder(target64, drafter=str(STORIES260K), builder=builder, builder_options=options)
    assert needle in _one_line(err.value)
    assert "constrained-int" not in str(err.value)  # a union's members are one option to the user


def test_unknown_names_suggest(target64):
    with pytest.raises(treespec.ConfigError) as err:
        treespec.Decoder(target64, drafter=str(STORIES260K), builder="chian")
    assert "did you mean 'chain'" in _one_line(err.value)


def test_api_refuses_long_prompt_and_bad_lengths(target64):
    dec = treespec.Decoder(target64, drafter=str(STORIES260K), drafter_options={"layers": 4})
    with pytest.raises(treespec.ConfigError, match="context is 512"):
        dec.generate([1] * 600)
    with pytest.raises(treespec.ConfigError, match="max_new_tokens"):
        dec.generate("Hi", max_new_tokens=0)


class FailingDrafter(ModelDrafter):
    """A real model drafter that breaks on its 6th expansion: failure injection, not a mock."""

    calls = 0

    def expand(self, tree, nodes, k):
        FailingDrafter.calls += 1
        if FailingDrafter.calls == 6:
            raise RuntimeError("draft device lost")
        return super().expand(tree, nodes, k)


def test_failure_returns_what_was_generated(target64, greedy_reference):
    cfg = ModelDrafter.Config(model=str(STORIES260K), layers=4)
    dec = treespec.Decoder(target64, drafter=FailingDrafter(cfg, target64), builder="chain", builder_options={"k": 2})
    ids = target64.tokenizer("Once upon a time, there was a little dog").input_ids
    with pytest.raises(treespec.DecodingError) as err:
        dec.generate(ids, max_new_tokens=64)
    partial = err.value.output
    assert "draft device lost" in _one_line(err.value)
    assert 0 < len(partial.token_ids) < 64
    assert partial.token_ids == greedy_reference(ids, 64)[: len(partial.token_ids)]
    assert partial.text and partial.stats.stop_reason == "error"
    # the target is reusable afterwards
    dec2 = treespec.Decoder(target64, drafter=str(STORIES260K), drafter_options={"layers": 4})
    assert dec2.generate(ids, max_new_tokens=64).token_ids == greedy_reference(ids, 64)
