"""A lean forward for Llama-family drafts: the same weights and math, without the framework's overhead.

A Hugging Face forward costs ~1 ms + ~0.5 ms per layer of Python on a CPU (measured: docs/drafters.md),
which is more than a 2-layer draft's arithmetic. A drafter calls its model once per tree level, so
that overhead, not the FLOPs, decides whether drafting pays. ``LeanCausalLM`` runs the same model in
a dozen tensor ops per layer: fused QKV and gate/up matmuls, the model's own rotary embedding module
(so every RoPE variant it supports is honoured), SDPA with grouped KV heads, and a ``DynamicCache``
so ``crop_cache``/``keep_rows`` work unchanged. It shares (views of) the model's weights, except for
the two fused matrices, which are concatenated copies (≈ the size of the model's attention and MLP).

Drafts only: the target always runs its own forward, so lossless output never depends on this file.
``lean_reason(model)`` says why a model cannot use it (then the drafter keeps the model's forward).

Per layer, with x: [B, T, H] and a float mask [B, 1, T, S] (0 = attend, finfo.min = blocked):

    h   = x + W_o · attn(rope(W_q·n), rope(W_k·n), W_v·n)      n = rmsnorm(x) ⊙ g_in
    out = h + W_down · (silu(W_gate·m) ⊙ W_up·m)               m = rmsnorm(h) ⊙ g_post
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from treespec.inference import inference
from treespec.row_matmul import linear

#: Model types whose decoder layer is exactly the formula above (q/k/v biases allowed: Qwen2).
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


def lean_reason(model: Any) -> str | None:
    """None if ``model`` can run lean, else why not (one phrase)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in LEAN_MODEL_TYPES:
        return f"model type {kind!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(cfg, "mlp_bias", False):
        return "the MLP has biases"
    if any(p.device.type == "meta" for p in model.parameters()):
        return "its weights are offloaded by a device map (the model's own forward loads them)"
    from treespec.kv import attention_windows

    if attention_windows(cfg).by_type is not None:
        return "its layers mix sliding-window and full attention (one mask per layer type)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return f"{type(model).__name__} does not keep model.layers and model.rotary_emb"
    for layer in inner.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "attention has q/k norms"
        if getattr(attn, "scaling", attn.head_dim**-0.5) != attn.head_dim**-0.5:
            return "attention scaling is not head_dim ** -0.5"
    return None


@dataclass
class _Layer:
    g_in: torch.Tensor | None  # [H]; None: the layer has no input norm
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    b_qkv: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    w_o: torch.Tensor  # [H, Hq D]
    b_o: torch.Tensor | None
    g_post: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor  # [H, I]


@dataclass
class LeanOutput:
    logits: torch.Tensor  # [B, T, V]


def lean_layers(layers: Any) -> list[_Layer]:
    """The weights of Hugging Face Llama-family decoder layers, with QKV and gate/up fused."""
    out = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        out.append(
            _Layer(
                g_in=getattr(layer.input_layernorm, "weight", None),  # None: no input norm (EAGLE's layer 0)
                w_qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                b_qkv=torch.cat(biases).detach() if all(b is not None for b in biases) else None,
                w_o=a.o_proj.weight,
                b_o=a.o_proj.bias,
                g_post=layer.post_attention_layernorm.weight,
                w_gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                w_down=m.down_proj.weight,
            )
        )
    return out


#: RoPE types whose frequencies change with the sequence length: their tables cannot be cached
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class RopeTable:
    """The model's own rotary module, read from a table: (cos, sin) at ``position_ids``.

    RoPE is a function of the position alone (except the length-dependent types, which call the
    module every time), so the table holds the module's own output for positions 0..L-1 and grows by
    doubling; a draft forward then indexes it instead of recomputing cos/sin (one op, not a dozen)."""

    def __init__(self, rotary: Any):
        self.rotary = rotary
        self.cached = str(getattr(rotary, "rope_type", "default")) not in LENGTH_DEPENDENT_ROPE
        self.cos: torch.Tensor | None = None  # [L, D]
        self.sin: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cached:
            return self.rotary(x, position_ids)
        top = int(position_ids.max()) + 1 if position_ids.numel() else 1
        if self.cos is None or top > self.cos.shape[0] or self.cos.dtype != x.dtype or self.cos.device != x.device:
            length = max(256, 2 * top, self.cos.shape[0] if self.cos is not None else 0)
            cos, sin = self.rotary(x, torch.arange(length, device=x.device)[None])  # [1, L, D]
            self.cos, self.sin = cos[0], sin[0]
        return self.cos[position_ids], self.sin[position_ids]  # [B, T, D]


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: in float32, back to the input's dtype, then the gain."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return g * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def run_layers(
    x: torch.Tensor,  # [B, T, H]
    layers: list[_Layer],
    position_embeddings: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) [B, T, D] from the rotary module
    mask: torch.Tensor | None,  # [B, 1, T, S] float; None: every row sees every cached row and itself
    cache: Any,  # a DynamicCache: layer i appends to slot i
    shape: tuple[int, int, int, float],  # (q heads, kv heads, head dim, RMSNorm eps)
) -> torch.Tensor:  # [B, T, H]
    b, t, _ = x.shape
    nq, nkv, d, eps = shape
    cos, sin = position_embeddings[0][:, None], position_embeddings[1][:, None]  # [B, 1, T, D]
    mask = mask.to(x.dtype) if mask is not None else None
    for i, L in enumerate(layers):
        n = x if L.g_in is None else rms_norm(x, L.g_in, eps)  # EAGLE's layer 0 reads fc's output as is
        qkv = linear(n, L.w_qkv, L.b_qkv)  # [B, T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q = apply_rope(q.view(b, t, nq, d).transpose(1, 2), cos, sin)  # [B, Hq, T, D]
        k = apply_rope(k.view(b, t, nkv, d).transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        v = v.view(b, t, nkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        k, v = cache.update(k, v, i)  # [B, Hkv, S, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nq != nkv)  # [B, Hq, T, D]
        x = x + linear(o.transpose(1, 2).reshape(b, t, nq * d), L.w_o, L.b_o)  # [B, T, H]
        gate, up = linear(rms_norm(x, L.g_post, eps), L.w_gate_up).chunk(2, dim=-1)  # [B, T, I] each
        x = x + linear(F.silu(gate) * up, L.w_down)  # [B, T, H]
    return x


def layer_shape(layers: Any, eps: float) -> tuple[int, int, int, float]:
    attn = layers[0].self_attn
    d = attn.head_dim
    return attn.q_proj.out_features // d, attn.k_proj.out_features // d, d, float(eps)


class LeanCausalLM:
    """Call it like the Hugging Face model it wraps: ``lean(input_ids=, position_ids=, attention_mask=,
    cache=)`` → ``.logits``. The mask must be the 4D float mask (no padding masks)."""

    def __init__(self, model: Any):
        reason = lean_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        cfg, inner = model.config, model.model
        self.model = model
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.rotary = RopeTable(inner.rotary_emb)
        self.g_final = inner.norm.weight  # [H]
        self.lm_head = model.get_output_embeddings().weight  # [V, H]
        self.layers = lean_layers(inner.layers)
        self.shape = layer_shape(inner.layers, cfg.rms_norm_eps)

    @inference
    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, T]
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, 1, T, S]
        cache: Any,
        use_cache: bool = True,
    ) -> LeanOutput:
        x = F.embedding(input_ids, self.embed)  # [B, T, H]
        x = run_layers(x, self.layers, self.rotary(x, position_ids), attention_mask, cache, self.shape)
        logits = linear(rms_norm(x, self.g_final, self.shape[3]), self.lm_head)  # [B, T, V]
        return LeanOutput(logits=logits)
