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
from treespec.lean import LeanCausalLM, lean_reason, lean_target

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


def _compare(model, prefix_len: int = 37, fuse: bool = True) -> None:
    lean = LeanCausalLM(model, fuse=fuse)
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
                input_ids=x,
                position_ids=p,
                attention_mask=m,
                **{cache_keyword(model): caches[0]},
                use_cache=True,
                output_hidden_states=True,
            )
            got = lean(input_ids=x, position_ids=p, attention_mask=m, cache=caches[1], output_hidden_states=True)
            assert got.logits.shape == want.logits.shape
            assert torch.allclose(got.logits, want.logits, rtol=0, atol=1e-10), (got.logits - want.logits).abs().max()
            assert len(got.hidden_states) == len(want.hidden_states) == model.config.num_hidden_layers + 1
            for a, b in zip(got.hidden_states, want.hidden_states):  # each layer's input, then the final norm's
                assert torch.allclose(a, b, rtol=0, atol=1e-10)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(a.keys, b.keys, rtol=0, atol=1e-10)
        assert torch.allclose(a.values, b.values, rtol=0, atol=1e-10)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "the-model's-own-weights"])
@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha-tied", "llama-bias", "llama3-rope", "qwen2", "mistral"])
def test_lean_equals_the_hugging_face_forward(kind, fuse):
    model = _random(kind)
    assert lean_reason(model) is None
    _compare(model, fuse=fuse)


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


def test_altered_models_keep_their_own_forward():
    """A projection that is not a plain Linear (LoRA, quantised wrappers) or a module with hooks or a
    forward of its own computes something the lean forward would not: such a model keeps its forward."""
    model = _random("llama-gqa")

    class Scaled(torch.nn.Linear):  # what a LoRA or quantised wrapper looks like from outside
        def forward(self, x):
            return 2 * super().forward(x)

    layer = model.model.layers[1].self_attn
    plain = layer.v_proj
    layer.v_proj = Scaled(plain.in_features, plain.out_features, bias=False).to(torch.float64)
    assert "v_proj is a Scaled" in lean_reason(model)
    assert lean_target(model) is None
    layer.v_proj = plain
    assert lean_reason(model) is None
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 0)
    assert "model.layers.0.mlp has hooks" in lean_reason(model)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert "a global forward hook" in lean_reason(model)
    finally:
        handle.remove()
    assert lean_reason(model) is None
    model.model.norm.forward = lambda x: x  # a user's patch
    assert "model.norm has hooks or a forward of its own" in lean_reason(model)


def test_the_target_verifies_with_the_lean_forward_unless_switched_off(monkeypatch):
    """A TargetModel's tree forward runs lean on a Llama (the model's own weights, no copies) and gives
    what the model's own forward gives: logits and hidden states (the last, and layer inputs)."""
    from treespec.tree import DraftTree

    model = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float64).eval()
    lean_on = treespec.TargetModel(model)
    assert isinstance(lean_on.lean, LeanCausalLM)
    weights = {p.data_ptr() for p in model.parameters()}
    assert all(w.data_ptr() in weights for layer in lean_on.lean.layers for w in (*layer.w_qkv, *layer.w_gate_up))
    monkeypatch.setenv("TREESPEC_LEAN_TARGET", "off")
    lean_off = treespec.TargetModel(model)
    assert lean_off.lean is None
    prompt = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(2))
    tree, layers = DraftTree(int(prompt[-1])), model.config.num_hidden_layers
    for parents, tokens in (([0, 0], [7, 9]), ([1, 2, 2], [11, 13, 15]), ([4], [17])):  # 7 nodes, depth 3
        tree.add_children(torch.tensor(parents), torch.tensor(tokens), torch.full((len(parents),), 0.5))
    outs = []
    for target in (lean_on, lean_off):
        target.prefill(prompt[:-1])
        for want, i in ((True, 1), ((0, 1, layers), 1), (False, 0)):  # each commits the root: the next sits one on
            outs.append(target.forward_tree(tree.tensors(target.past_len, torch.float64), want)[i])
            target.commit(torch.tensor([0]))
    for got, want in zip(outs[:3], outs[3:]):
        assert torch.allclose(got, want, rtol=0, atol=1e-10)


def test_a_target_whose_forward_differs_from_the_formula_keeps_it():
    """A Llama by its config whose own forward computes something else (here: a subclass that scales
    the logits) fails the probe, so trees are verified by the model's own forward."""
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 1.5
            return out

    plain = _random("llama-gqa")
    scaled = Scaled(plain.config).to(torch.float64).eval()
    scaled.load_state_dict(plain.state_dict())
    assert lean_reason(scaled) is None  # nothing in its config or modules tells
    assert isinstance(lean_target(plain), LeanCausalLM)
    assert lean_target(scaled) is None
    assert treespec.TargetModel(scaled).lean is None


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 3, 576), (4, 5, 64), (1, 200, 576)])
def test_rms_norm_in_float32_is_the_models_own_to_the_bit(shape):
    """The lean RMSNorm takes torch's ``rms_norm`` for float32 on a CPU (the tests above run float64,
    which keeps the formula): it must give transformers' LlamaRMSNorm exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from treespec.lean import rms_norm

    gen = torch.Generator().manual_seed(sum(shape))
    x = 3 * torch.randn(*shape, generator=gen)
    norm = LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rope_is_the_models_own_to_the_bit(dtype, tokens):
    """The lean RoPE (a roll of x times a sin whose first half is negated once per forward) must give
    transformers' ``apply_rotary_pos_emb`` exactly, on the model's own cos/sin."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from treespec.lean import apply_rope, rotate, signed_sin

    gen = torch.Generator().manual_seed(tokens)
    q = 3 * torch.randn(2, 4, tokens, 16, generator=gen, dtype=dtype)  # [B, H, T, D]
    k = 3 * torch.randn(2, 2, tokens, 16, generator=gen, dtype=dtype)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0))
    positions = torch.tensor([[5 + 3 * i for i in range(tokens)], [200 + i for i in range(tokens)]])
    cos, sin = rotary(q, positions)  # [B, T, D]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(apply_rope(q, cos[:, None], sin[:, None]), want_q)
    ssin = signed_sin(sin[:, None])
    assert torch.equal(rotate(q, cos[:, None], ssin), want_q)
    assert torch.equal(rotate(k, cos[:, None], ssin), want_k)
