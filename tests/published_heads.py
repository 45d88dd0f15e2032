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
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "initializer_range": 0.02, "model_type": "llama", "num_hidden_layers": 1, "pad_token_id": 0,
    "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True,
}
LLAMA3_EXTRA = {"bias": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-05}  # EAGLE-LLaMA3-Instruct-8B.json


def eagle1_head(folder: Path, hidden: int, vocab: int, heads: int = 8, kv_heads: int = 4, intermediate: int = 172,
                style: str = "llama2", fmt: str = "bin", dtype: torch.dtype = torch.float32, seed: int = 1,
                max_positions: int = 512) -> Path:
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
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"))
    config = dict(LLAMA2_CONFIG, hidden_size=hidden, vocab_size=vocab, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_positions)
    if style == "llama3":
        config.update(LLAMA3_EXTRA)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half), x: [heads, T, D], pos: [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype), torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def eagle1_forward(folder: Path, features: torch.Tensor, tokens: torch.Tensor,
                   embedding: torch.Tensor | None = None) -> torch.Tensor:
    """The published forward over one causal sequence, from the files alone: features [T, H] (f_j),
    tokens [T] (x_{j+1}), positions 0..T-1. Returns the predicted features [T, H] (float64).
    ``embedding``: the target's table in place of the head's copy (what EAGLE's own loader does)."""
    cfg = json.loads((folder / "config.json").read_text())
    if (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    else:
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
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
    mlp = (torch.nn.functional.silu(m @ s["layers.0.mlp.gate_proj.weight"].T) * (m @ s["layers.0.mlp.up_proj.weight"].T))
    return x + mlp @ s["layers.0.mlp.down_proj.weight"].T
