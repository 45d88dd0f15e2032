"""Hugging Face users' own objects (issue 29): loaded models and tokenizers in ``Decoder``, the arguments
``generate`` takes from them, and treespec behind ``model.generate(custom_generate=...)``; every output
compared with the model's own ``generate`` on real prompts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessorList

import treespec
import treespec.hf
from conftest import STORIES260K, tinystories_prompts
from treespec.errors import ConfigError

MAX_NEW = 40


@pytest.fixture(scope="module")
def hf():
    """The model, a second copy as the draft, and the tokenizer, loaded as a Hugging Face user does."""
    model = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(STORIES260K)
    return model, draft, tok


def greedy(model, ids: list[int], n: int = MAX_NEW) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("builder,options", [("opt-tree", {"nodes": 8}), ("chain", {"k": 3})])
def test_a_loaded_target_tokenizer_and_draft_decode_as_generate(hf, builder, options):
    model, draft, tok = hf
    dec = treespec.Decoder(model, tokenizer=tok, drafter=draft, builder=builder, builder_options=options)
    for text in tinystories_prompts(4):
        enc = tok(text, return_tensors="pt")
        out = dec.generate(**enc, max_new_tokens=MAX_NEW)  # what HF users pass
        assert out.token_ids == greedy(model, enc.input_ids[0].tolist())
        assert out.text and out.text == dec.text_of(out.token_ids, enc.input_ids[0].tolist())


def test_without_a_tokenizer_the_one_saved_beside_the_model_is_used(hf):
    model, draft, tok = hf
    dec = treespec.Decoder(model, drafter=draft, builder="chain")
    text = tinystories_prompts(1)[0]
    out = dec.generate(text, max_new_tokens=MAX_NEW)
    assert out.token_ids == greedy(model, tok(text).input_ids)


def test_input_ids_of_several_rows_with_left_padding_decode_as_a_batch(hf):
    model, draft, tok = hf
    left = AutoTokenizer.from_pretrained(STORIES260K, padding_side="left")
    left.pad_token = left.pad_token or left.unk_token
    texts = tinystories_prompts(3, cut_words=8) + tinystories_prompts(1, cut_words=30)
    enc = left(texts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # the rows really are padded
    dec = treespec.Decoder(model, tokenizer=tok, drafter=draft, builder="chain")
    outs = dec.generate(**enc, max_new_tokens=MAX_NEW)
    assert [o.token_ids for o in outs] == [greedy(model, tok(t).input_ids) for t in texts]
    unpadded = torch.tensor([tok(texts[0]).input_ids] * 2)  # [2, L]: two rows, not "batches are not supported"
    assert len(dec.generate(unpadded, max_new_tokens=8)) == 2


def test_custom_generate_returns_what_generate_returns(hf):
    model, draft, tok = hf
    left = AutoTokenizer.from_pretrained(STORIES260K, padding_side="left")
    left.pad_token = left.pad_token or left.unk_token
    common = dict(custom_generate=treespec.hf.CUSTOM_GENERATE, trust_remote_code=True, drafter=draft)
    for text in tinystories_prompts(3):
        enc = tok(text, return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(model.generate(**enc, max_new_tokens=MAX_NEW, **common), ref)
    enc = left(tinystories_prompts(3, cut_words=10), return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=left.pad_token_id)
    out = model.generate(**enc, max_new_tokens=MAX_NEW, pad_token_id=left.pad_token_id, return_dict_in_generate=True,
                         **common)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    # assisted generation's argument names the draft too
    enc = tok(tinystories_prompts(1)[0], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False)
    out = model.generate(**enc, max_new_tokens=MAX_NEW, custom_generate=treespec.hf.CUSTOM_GENERATE,
                         trust_remote_code=True, assistant_model=draft)  # fmt: skip
    assert torch.equal(out, ref)


def test_custom_generate_streams_one_row(hf):
    model, draft, tok = hf

    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    enc = tok(tinystories_prompts(1)[0], return_tensors="pt")
    streamer = Collect()
    out = model.generate(**enc, max_new_tokens=MAX_NEW, custom_generate=treespec.hf.CUSTOM_GENERATE,
                         trust_remote_code=True, drafter=draft, streamer=streamer)  # fmt: skip
    assert streamer.parts[0] == enc.input_ids[0].tolist() and streamer.ended  # the prompt first, as generate does
    assert sum(streamer.parts[1:], []) == out[0, enc.input_ids.shape[1] :].tolist()


def test_sampling_settings_come_from_the_generation_config_as_generate_reads_them(hf):
    model = hf[0]
    s = treespec.hf._settings(model, None, {"do_sample": True, "max_new_tokens": 5}, 10)
    assert (s["temperature"], s["top_k"], s["top_p"]) == (1.0, 50, 1.0)  # transformers' defaults: top_k 50
    s = treespec.hf._settings(model, GenerationConfig(do_sample=True, temperature=0.7, top_k=0), {}, 10)
    assert (s["temperature"], s["top_k"]) == (0.7, 0)
    assert treespec.hf._settings(model, None, {"max_length": 30}, 10)["max_new_tokens"] == 20
    assert treespec.hf._settings(model, None, {}, 10)["temperature"] is None  # greedy


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"repetition_penalty": 1.3}, "cannot honour repetition_penalty=1.3"),
        ({"num_beams": 2}, "cannot honour num_beams=2"),
        ({"output_scores": True}, "cannot honour output_scores=True"),
        ({"logits_processor": LogitsProcessorList([lambda i, s: s])}, "does not run logits_processor"),
        ({"eos_token_id": 5}, "stops where the model's generation_config says"),
        ({"frobnicate": 1}, "does not take frobnicate"),
        ({"max_length": 3}, "leaves no room"),
    ],
)
def test_what_custom_generate_cannot_honour_is_one_line(hf, kwargs, message):
    model, draft, tok = hf
    enc = tok(tinystories_prompts(1)[0], return_tensors="pt")
    with pytest.raises(ConfigError, match=message):
        model.generate(**enc, custom_generate=treespec.hf.CUSTOM_GENERATE, trust_remote_code=True, drafter=draft,
                       **{"max_new_tokens": 5, **kwargs} if "max_length" not in kwargs else kwargs)  # fmt: skip


def test_custom_generate_without_a_draft_says_how_to_give_one(hf):
    model, _, tok = hf
    enc = tok("Once upon a time", return_tensors="pt")
    with pytest.raises(ConfigError, match="needs a draft: drafter="):
        model.generate(**enc, custom_generate=treespec.hf.CUSTOM_GENERATE, trust_remote_code=True)


def test_loaded_models_are_used_where_they_are_never_moved(hf):
    model, _, tok = hf
    with pytest.raises(ConfigError, match="the target was passed already loaded"):
        treespec.Decoder(model, tokenizer=tok, drafter="ngram", dtype="float64")
    other = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float64)
    with pytest.raises(ConfigError, match="the draft model is on cpu in torch.float64 but the target"):
        treespec.Decoder(model, tokenizer=tok, drafter=other)
    assert next(other.parameters()).dtype == torch.float64  # untouched
    with pytest.raises(ConfigError, match="drop layers"):
        treespec.Decoder(model, tokenizer=tok, drafter=hf[1], drafter_options={"layers": 2})


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d, e: d.generate("x", input_ids=e.input_ids), "both a prompt and input_ids"),
        (lambda d, e: d.generate(), "needs a prompt"),
        (lambda d, e: d.generate(input_ids=e.input_ids, attention_mask=torch.ones(1, 2)), "shaped like input_ids"),
        (lambda d, e: d.generate(input_ids=e.input_ids, attention_mask=_holed(e)), "holes inside a prompt"),
        (lambda d, e: d.generate(e.input_ids, do_sample=False, temperature=0.5), "do_sample=False is greedy"),
    ],
)
def test_hugging_face_arguments_misused_are_one_line(hf, call, message):
    model, draft, tok = hf
    dec = treespec.Decoder(model, tokenizer=tok, drafter="ngram", builder="chain")
    with pytest.raises(ConfigError, match=message):
        call(dec, tok("Once upon a time there was", return_tensors="pt"))


def _holed(enc):
    mask = torch.ones_like(enc.input_ids)
    mask[0, 2] = 0
    return mask


def test_a_drafter_that_fails_while_nodes_auto_measures_is_one_line(hf, tmp_path, monkeypatch):
    """Issue 29 (2): a drafter failing inside the quick cost measurement that ``nodes=auto`` runs in
    ``Decoder.__init__`` escaped as a 102-line traceback."""
    from treespec.plugins.ngram import NgramDrafter

    class Broken(NgramDrafter):
        def expand(self, tree, nodes, k):
            raise RuntimeError("shape '[1, 128, 1, 16]' is invalid for input of size 96")

    monkeypatch.setenv("TREESPEC_PROFILE_DIR", str(tmp_path))  # no saved profile: the Decoder measures
    model, _, tok = hf
    target = treespec.TargetModel(model, tok)
    drafter = Broken(Broken.Config(), target)
    with pytest.raises(ConfigError, match=r"could not measure step costs with drafter Broken \(RuntimeError: shape"):
        treespec.Decoder(target, drafter=drafter, builder="opt-tree", builder_options={"nodes": "auto"})


def test_a_generation_config_that_changes_generate_is_named_in_a_note(hf):
    """The sweep found it: BART-family configs force EOS at max_length (forced_eos_token_id), which
    ``generate`` applies and treespec's decoding does not; the Decoder says so instead of differing silently."""
    from treespec.errors import GenerationConfigNote

    model, draft, tok = hf
    before = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=2, bos_token_id=1, forced_eos_token_id=2)
    try:
        with pytest.warns(GenerationConfigNote, match="sets forced_eos_token_id=2, which treespec does not apply"):
            treespec.Decoder(model, tokenizer=tok, drafter="ngram", builder="chain")
    finally:
        model.generation_config = before
