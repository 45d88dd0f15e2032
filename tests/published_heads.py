"""Fixtures in the layouts EAGLE's authors publish, built from their definitions — never from
treespec's own ``save`` — and the published forward, written out here from those definitions.

EAGLE-1/2 (SafeAILab/EAGLE ``eagle/model/cnets1.py``, the module behind every published EAGLE-1/2
head, e.g. ``yuhuili/EAGLE-llama2-chat-7B``, ``yuhuili/EAGLE-LLaMA3-Instruct-8B``):

* state_dict keys: ``embed_tokens.weight`` [V, H] (a copy of the target's), ``fc.weight`` [H, 2H],
  ``fc.bias`` [H] unless the config says ``"bias": false``, and for the one decoder layer
  ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``layers.0.post_attention_layernorm.weight`` — no ``layers.0.input_layernorm`` (the reference
  creates it only for layers with index != 0), no final norm, no lm_head (the target's is used);
* ``pytorch_model.bin`` (fp32 for the Llama-2 heads, fp16 for the LLaMA-3 ones) or ``model.safetensors``;
* ``config.json``: a Llama config as in ``eagle/train/llama_2_chat_7B_config.json`` (no ``bias`` key:
  bias on) or ``EAGLE-LLaMA3-Instruct-8B.json`` (``"bias": false``, ``rope_theta``).

Forward (``Model.forward``): x = fc(cat[embed(x_{j+1}), f_j]); layer 0: x = x + attn(x) (no input
norm), x = x + mlp(rmsnorm(x)); the output (no final norm) is the predicted feature.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

LLAMA2_CONFIG = {  # eagle/train/llama_2_chat_7B_config.json's fields, sizes scaled to the target
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "model_type": "llama",
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
}
LLAMA3_EXTRA = {"bias": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-05}  # EAGLE-LLaMA3-Instruct-8B.json


def eagle1_head(
    folder: Path,
    hidden: int,
    vocab: int,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int = 172,
    style: str = "llama2",
    fmt: str = "bin",
    dtype: torch.dtype = torch.float32,
    seed: int = 1,
    max_positions: int = 512,
) -> Path:
    """Write an EAGLE-1/2 head in the published layout (module docstring) with random weights."""
    gen = torch.Generator().manual_seed(seed)
    d = hidden // heads

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(dtype)

    bias = style != "llama3"
    state = {
        "embed_tokens.weight": w(vocab, hidden),
        "fc.weight": w(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": w(heads * d, hidden),
        "layers.0.self_attn.k_proj.weight": w(kv_heads * d, hidden),
        "layers.0.self_attn.v_proj.weight": w(kv_heads * d, hidden),
        "layers.0.self_attn.o_proj.weight": w(hidden, heads * d),
        "layers.0.mlp.gate_proj.weight": w(intermediate, hidden),
        "layers.0.mlp.up_proj.weight": w(intermediate, hidden),
        "layers.0.mlp.down_proj.weight": w(hidden, intermediate),
        "layers.0.post_attention_layernorm.weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
    }
    if bias:
        state["fc.bias"] = (0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    _write_state(folder, state, fmt)
    config = dict(
        LLAMA2_CONFIG,
        hidden_size=hidden,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
    )
    if style == "llama3":
        config.update(LLAMA3_EXTRA)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _write_state(folder: Path, state: dict[str, torch.Tensor], fmt: str) -> None:
    """As published: a pickled ``pytorch_model.bin`` (``fmt="bin"``) or ``model.safetensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"))


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", weights_only=True)
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half), x: [heads, T, D], pos: [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype), torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def eagle1_forward(
    folder: Path, features: torch.Tensor, tokens: torch.Tensor, embedding: torch.Tensor | None = None
) -> torch.Tensor:
    """The published forward over one causal sequence, from the files alone: features [T, H] (f_j),
    tokens [T] (x_{j+1}), positions 0..T-1. Returns the predicted features [T, H] (float64).
    ``embedding``: the target's table in place of the head's copy (what EAGLE's own loader does)."""
    cfg = json.loads((folder / "config.json").read_text())
    state = _read_state(folder)
    s = {k: v.double() for k, v in state.items()}
    heads, kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta", 10000.0)
    t, h = features.shape
    d = h // heads
    table = embedding.double() if embedding is not None else s["embed_tokens.weight"]
    x = torch.cat([table[tokens], features.double()], -1) @ s["fc.weight"].T
    if "fc.bias" in s:
        x = x + s["fc.bias"]
    pos = torch.arange(t)
    q = _rope((x @ s["layers.0.self_attn.q_proj.weight"].T).view(t, heads, d).transpose(0, 1), pos, theta)
    k = _rope((x @ s["layers.0.self_attn.k_proj.weight"].T).view(t, kv, d).transpose(0, 1), pos, theta)
    v = (x @ s["layers.0.self_attn.v_proj.weight"].T).view(t, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d) + torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(t, heads * d)
    x = x + attn @ s["layers.0.self_attn.o_proj.weight"].T
    m = _rms(x, s["layers.0.post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(m @ s["layers.0.mlp.gate_proj.weight"].T) * (m @ s["layers.0.mlp.up_proj.weight"].T)
    return x + mlp @ s["layers.0.mlp.down_proj.weight"].T


# ---------------------------------------------------------------------------------------------- EAGLE-3
# SafeAILab/EAGLE ``eagle/model/cnets.py`` (inference) and ``eagle/traineagle3/`` (training, its
# ``config.json``), behind ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``; vLLM's ``llama_eagle3.py`` and
# SGLang's ``llama_eagle3.py`` load the same keys:
#
# * state_dict keys: ``fc.weight`` [H, 3·Ht] (no bias), ``midlayer.self_attn.{q,k,v}_proj.weight``
#   [heads·d, 2H] (attention reads [embedding; hidden]), ``midlayer.self_attn.o_proj.weight`` [H, heads·d],
#   ``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,
#   post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight`` [Vd, H], buffers ``d2t``
#   (int64 [Vd], OFFSETS: target id = d + d2t[d]) and ``t2d`` (bool [V]); no embedding (frozen, not saved);
# * ``pytorch_model.bin`` in fp16 (HalfStorage, BoolStorage, LongStorage);
# * ``config.json`` as ``traineagle3/config.json``: a Llama config with ``draft_vocab_size``, no rope_theta.
#
# Forward: g = fc(cat[h_low, h_mid, h_high]) (fc only when the input is 3·Ht wide); x = cat[
# input_layernorm(embed(x_{j+1})), hidden_norm(g)]; h = g + o_proj(attn(x)); out = h +
# mlp(post_attention_layernorm(h)); logits = lm_head(norm(out)) over the draft vocabulary.
# The three layers: the inputs of target layers (2, L//2, L-3) = Hugging Face hidden_states[i].

EAGLE3_CONFIG = {  # eagle/traineagle3/config.json's fields, sizes scaled to the target
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "model_type": "llama",
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
}


def eagle3_head(
    folder: Path,
    hidden: int,
    vocab: int,
    draft_vocab: int,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int = 172,
    dtype: torch.dtype = torch.float16,
    seed: int = 3,
    fmt: str = "bin",
    max_positions: int = 512,
    used: torch.Tensor | None = None,
    target_hidden: int | None = None,
) -> Path:
    """Write an EAGLE-3 head in the published layout with random weights. The draft vocabulary is
    ``used`` (ascending target ids; default: every other id from 1, or all if that does not fit) as ``scandata`` builds it:
    d2t[i] = used[i] - i, t2d[j] = j in used. ``target_hidden``: a head of width ``hidden`` for a target of
    another width, as SpecForge and vLLM define it (``llama_eagle3.py``: ``fc`` reads 3 × ``target_hidden_size``
    and the head embeds with its own ``embed_tokens`` [V, hidden]; config ``target_hidden_size``)."""
    gen = torch.Generator().manual_seed(seed)
    d = hidden // heads
    th = target_hidden or hidden

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(dtype)

    if used is None:
        used = torch.arange(1, 2 * draft_vocab, 2) if 2 * draft_vocab <= vocab else torch.arange(draft_vocab)
    used = used.sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    state = {
        "fc.weight": w(hidden, 3 * th),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * d, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * d, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * d),
        "midlayer.mlp.gate_proj.weight": w(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": w(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, intermediate),
        "midlayer.hidden_norm.weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
        "midlayer.input_layernorm.weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
        "midlayer.post_attention_layernorm.weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
        "norm.weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
        "lm_head.weight": (4 * torch.randn(draft_vocab, hidden, generator=gen) / math.sqrt(hidden)).to(dtype),
        "d2t": used - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if target_hidden is not None:
        state["embed_tokens.weight"] = w(vocab, hidden)
    _write_state(folder, state, fmt)
    config = dict(
        EAGLE3_CONFIG,
        **({"target_hidden_size": target_hidden} if target_hidden is not None else {}),
        hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def eagle3_forward(
    folder: Path, features: torch.Tensor, tokens: torch.Tensor, embedding: torch.Tensor, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The published forward over one causal sequence from the files alone: features [T, 3·Ht] (the
    target's three layers at x_j) or [T, H] (the head's own outputs), tokens [T] (x_{j+1}), positions
    start..start+T-1 (no cache: start only shifts RoPE). Returns (pre-norm outputs [T, H], logits over
    the TARGET vocabulary [T, V] with -inf outside the draft vocabulary), float64."""
    cfg = json.loads((folder / "config.json").read_text())
    state = _read_state(folder)
    s = {k: (v.double() if v.is_floating_point() else v) for k, v in state.items()}
    if cfg.get("target_hidden_size") not in (None, cfg["hidden_size"]):  # a head of its own width: its own table
        embedding = s["embed_tokens.weight"]
    heads, kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta", 10000.0)
    h = cfg["hidden_size"]
    t = features.shape[0]
    d = h // heads
    g = features.double()
    if g.shape[-1] != h:
        g = g @ s["fc.weight"].T
    x = torch.cat(
        [
            _rms(embedding.double()[tokens], s["midlayer.input_layernorm.weight"], eps),
            _rms(g, s["midlayer.hidden_norm.weight"], eps),
        ],
        -1,
    )
    pos = torch.arange(start, start + t)
    q = _rope((x @ s["midlayer.self_attn.q_proj.weight"].T).view(t, heads, d).transpose(0, 1), pos, theta)
    k = _rope((x @ s["midlayer.self_attn.k_proj.weight"].T).view(t, kv, d).transpose(0, 1), pos, theta)
    v = (x @ s["midlayer.self_attn.v_proj.weight"].T).view(t, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d) + torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(t, heads * d)
    hid = g + attn @ s["midlayer.self_attn.o_proj.weight"].T
    m = _rms(hid, s["midlayer.post_attention_layernorm.weight"], eps)
    out = (
        hid
        + (
            torch.nn.functional.silu(m @ s["midlayer.mlp.gate_proj.weight"].T)
            * (m @ s["midlayer.mlp.up_proj.weight"].T)
        )
        @ s["midlayer.mlp.down_proj.weight"].T
    )
    draft_logits = _rms(out, s["norm.weight"], eps) @ s["lm_head.weight"].T  # [T, Vd]
    logits = torch.full((t, cfg["vocab_size"]), float("-inf"), dtype=torch.float64)
    ids = torch.arange(cfg["draft_vocab_size"]) + s["d2t"]
    logits[:, ids] = draft_logits
    return out, logits


# ------------------------------------------------------------------------------ vLLM's speculators layout
# neuralmagic/speculators ``src/speculators/convert/eagle/eagle3_converter.py`` (Eagle3Converter, behind
# RedHatAI's ``*-speculator.eagle3`` heads): the EAGLE-3 weights renamed ``midlayer.*`` -> ``layers.0.*``,
# the verifier's ``embed_tokens.weight`` added, saved by ``Eagle3Speculator.save_pretrained``
# (model.safetensors); config.json: ``architectures: ["Eagle3Speculator"]``, ``speculators_model_type:
# "eagle3"``, ``transformer_layer_config`` (a LlamaConfig: vocab_size = the target's, num_hidden_layers 1,
# tie_word_embeddings false), top-level ``draft_vocab_size``, ``norm_before_residual``,
# ``target_hidden_size``, ``speculators_config`` (``algorithm``, ``proposal_methods: [{"proposal_type":
# "greedy", "speculative_tokens": 5}]``, ``default_proposal_method``, ``verifier: {name_or_path,
# architectures}``); later releases add the top-level ``eagle_aux_hidden_state_layer_ids`` that vLLM
# reads as they are (vllm/transformers_utils/configs/speculators/algos.py, ``update_eagle3``;
# id i = the input of decoder layer i, vllm/model_executor/models/interfaces.py).
# ``norm_before_residual`` (vLLM: absent = true): the layer's residual is hidden_norm(g) instead of g
# (vllm/model_executor/models/llama_eagle3.py ``_norm_before_residual``).


def speculators_head(
    folder: Path,
    hidden: int,
    vocab: int,
    draft_vocab: int,
    embedding: torch.Tensor,
    layer_ids: list[int] | None,
    norm_before_residual: bool | None,
    **kwargs,
) -> Path:
    """An EAGLE-3 head in the speculators layout: the published EAGLE-3 weights (``eagle3_head``), renamed
    and re-configured as Eagle3Converter does (the comment above)."""
    eagle3_head(folder, hidden, vocab, draft_vocab, fmt="safetensors", **kwargs)
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    state["embed_tokens.weight"] = embedding.to(torch.float16).clone()
    (folder / "model.safetensors").unlink()
    save_file(state, str(folder / "model.safetensors"))
    flat = json.loads((folder / "config.json").read_text())
    layer = {k: v for k, v in flat.items() if k != "draft_vocab_size"}
    layer.update(num_hidden_layers=1, tie_word_embeddings=False, rope_theta=10000.0)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "verifier": {"name_or_path": "the-target", "architectures": ["LlamaForCausalLM"]},
        },
    }
    if norm_before_residual is not None:
        config["norm_before_residual"] = norm_before_residual
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def speculators_forward(
    folder: Path, features: torch.Tensor, tokens: torch.Tensor, embedding: torch.Tensor
) -> torch.Tensor:
    """vLLM's Eagle3LlamaForCausalLM forward from the files alone (float64), norm_before_residual as
    vLLM reads it (absent = true); positions 0..T-1, causal. Returns the draft logits over the target
    vocabulary (-inf outside the draft vocabulary) [T, V]."""
    cfg = json.loads((folder / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    from safetensors.torch import load_file

    s = {
        k: (v.double() if v.is_floating_point() else v) for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    heads, kv, eps, h = (
        layer["num_attention_heads"],
        layer["num_key_value_heads"],
        layer["rms_norm_eps"],
        layer["hidden_size"],
    )
    theta = layer.get("rope_theta", 10000.0)
    t, d = features.shape[0], h // heads
    g = features.double() @ s["fc.weight"].T if features.shape[-1] != h else features.double()
    normed = _rms(g, s["layers.0.hidden_norm.weight"], eps)
    residual = normed if cfg.get("norm_before_residual", True) else g
    x = torch.cat([_rms(embedding.double()[tokens], s["layers.0.input_layernorm.weight"], eps), normed], -1)
    pos = torch.arange(t)
    q = _rope((x @ s["layers.0.self_attn.q_proj.weight"].T).view(t, heads, d).transpose(0, 1), pos, theta)
    k = _rope((x @ s["layers.0.self_attn.k_proj.weight"].T).view(t, kv, d).transpose(0, 1), pos, theta)
    v = (x @ s["layers.0.self_attn.v_proj.weight"].T).view(t, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d) + torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    hid = (
        residual
        + (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(t, heads * d)
        @ s["layers.0.self_attn.o_proj.weight"].T
    )
    m = _rms(hid, s["layers.0.post_attention_layernorm.weight"], eps)
    out = (
        hid
        + (
            torch.nn.functional.silu(m @ s["layers.0.mlp.gate_proj.weight"].T)
            * (m @ s["layers.0.mlp.up_proj.weight"].T)
        )
        @ s["layers.0.mlp.down_proj.weight"].T
    )
    draft = _rms(out, s["norm.weight"], eps) @ s["lm_head.weight"].T
    logits = torch.full((t, layer["vocab_size"]), float("-inf"), dtype=torch.float64)
    logits[:, torch.arange(cfg["draft_vocab_size"]) + s["d2t"]] = draft
    return logits
