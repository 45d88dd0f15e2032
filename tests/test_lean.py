"""treespec.lean: the drafts' lean forward must compute what the Hugging Face forward computes.

Each case runs both forwards in float64 over the same cached prefix and then a tree (explicit
positions, a 4D ancestor mask), and compares the logits and the cached keys and values. Real
weights (stories260K) and random ones for every supported family and its variations (GQA, q/k/v
biases, an o_proj bias, Llama-3 RoPE scaling, a sliding window carried by the mask).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import treespec
from conftest import STORIES260K
from treespec.kv import cache_keyword
from treespec.lean import LeanCausalLM, lean_reason

VOCAB = 96


def _random(kind: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    config = {
        "llama-gqa": lambda: LlamaConfig(**common),
        "llama-mha-tied": lambda: LlamaConfig(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=True),
        "llama-bias": lambda: LlamaConfig(**common, attention_bias=True),
        "llama3-rope": lambda: LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2": lambda: Qwen2Config(**common),
        "mistral": lambda: MistralConfig(**common, sliding_window=8),
        "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4),
    }[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    with torch.no_grad():  # Hugging Face initialises biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
    return model


def _compare(model, prefix_len: int = 37) -> None:
    lean = LeanCausalLM(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    blocked = torch.finfo(torch.float64).min
    caches = DynamicCache(), DynamicCache()
    # 1) the prefix, causal
    ids = torch.randint(3, vocab, (1, prefix_len), generator=gen)
    pos = torch.arange(prefix_len)[None]
    mask = torch.triu(torch.full((prefix_len, prefix_len), blocked, dtype=torch.float64), 1)[None, None]
    # 2) a tree of 6 nodes: two children of the root, then grandchildren; positions = prefix + depth
    parents = [-1, 0, 0, 1, 1, 2]
    depth = torch.tensor([0, 1, 1, 2, 2, 2])
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i, i] = True
        while p >= 0:
            anc[i, p] = True
            p = parents[p]
    tree_mask = torch.zeros(6, prefix_len + 6, dtype=torch.float64)
    tree_mask[:, prefix_len:].masked_fill_(~anc, blocked)
    window = getattr(model.config, "sliding_window", None)
    kv_pos = torch.cat([torch.arange(prefix_len), prefix_len + depth])
    q_pos = prefix_len + depth
    if window:  # the drafter applies windows in its own masks (treespec.target.window_mask)
        from treespec.kv import window_mask

        mask = window_mask(mask[0, 0], pos[0], pos[0], window)[None, None]
        tree_mask = window_mask(tree_mask, q_pos, kv_pos, window)
    steps = [(ids, pos, mask), (torch.randint(3, vocab, (1, 6), generator=gen), q_pos[None], tree_mask[None, None])]
    with torch.inference_mode():
        for x, p, m in steps:
            want = model(
                input_ids=x, position_ids=p, attention_mask=m, **{cache_keyword(model): caches[0]}, use_cache=True
            ).logits
            got = lean(input_ids=x, position_ids=p, attention_mask=m, cache=caches[1]).logits
            assert got.shape == want.shape
            assert torch.allclose(got, want, rtol=0, atol=1e-10), (got - want).abs().max()
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(a.keys, b.keys, rtol=0, atol=1e-10)
        assert torch.allclose(a.values, b.values, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha-tied", "llama-bias", "llama3-rope", "qwen2", "mistral"])
def test_lean_equals_the_hugging_face_forward(kind):
    model = _random(kind)
    assert lean_reason(model) is None
    _compare(model)


def test_lean_equals_the_hugging_face_forward_on_stories260k():
    model = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float64).eval()
    _compare(model, prefix_len=120)


def test_unsupported_models_keep_their_own_forward(tmp_path):
    gpt2 = _random("gpt2")
    assert "gpt2" in lean_reason(gpt2)
    with pytest.raises(ValueError, match="no lean forward"):
        LeanCausalLM(gpt2)
    gpt2.save_pretrained(tmp_path / "gpt2")
    target = treespec.TargetModel(_random("gpt2"))
    dec = treespec.Decoder(target, drafter=str(tmp_path / "gpt2"), builder="chain", builder_options={"k": 2})
    assert dec.drafter.forward is dec.drafter.model


def test_lean_can_be_switched_off(target64):
    on = treespec.Decoder(target64, drafter="self", drafter_options={"layers": 2}, builder="chain")
    off = treespec.Decoder(target64, drafter="self", drafter_options={"layers": 2, "lean": False}, builder="chain")
    assert isinstance(on.drafter.forward, LeanCausalLM)
    assert off.drafter.forward is off.drafter.model
