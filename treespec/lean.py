"""A lean forward for Llama-family models: the same weights and math, without the framework's overhead.

A Hugging Face forward costs ~1 ms + ~0.5 ms per layer of Python on a CPU (measured: docs/drafters.md),
which is more than a 2-layer draft's arithmetic. A drafter calls its model once per tree level, so
that overhead, not the FLOPs, decides whether drafting pays. ``LeanCausalLM`` runs the same model in
a dozen tensor ops per layer: the projections (for drafts fused: QKV and gate/up as concatenated
copies), the model's own rotary embedding module (so every RoPE variant it supports is honoured),
SDPA with grouped KV heads, and a ``DynamicCache`` so ``crop_cache``/``keep_rows`` work unchanged.

Targets verify trees with it too (``lean_target``: SmolLM2's 30 layers spend ~13 ms of a 63 ms
forward in that Python here; docs/design.md, "The lean target forward"), unfused: the model's own
weight tensors, no copy. Its logits are the model's own to the bit on the models tested, and a
target uses it only where it is sure to compute the same thing: a known layer formula
(``lean_reason``), plain modules without hooks (``altered_reason``), and a probe against the
model's own forward (``agrees``). ``TREESPEC_LEAN_TARGET=off`` keeps the model's forward.

Per layer, with x: [B, T, H] and a float mask [B, 1, T, S] (0 = attend, finfo.min = blocked):

    h   = x + W_o · attn(rope(W_q·n), rope(W_k·n), W_v·n)      n = rmsnorm(x) ⊙ g_in
    out = h + W_down · (silu(W_gate·m) ⊙ W_up·m)               m = rmsnorm(h) ⊙ g_post
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from treespec.inference import inference
from treespec.kv import attention_windows, causal_mask
from treespec.row_matmul import linear, product

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
    return altered_reason(model)


def altered_reason(model: Any) -> str | None:
    """None if every module the lean forward reads by its weights computes only what its class says:
    plain ``nn.Linear`` projections (not LoRA, quantised or offloaded wrappers) and no hooks or forwards
    of their own on any module (accelerate, peft, a user's patch); else what is altered."""
    inner = model.model
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        for name, proj in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj)):
            if type(proj) is not torch.nn.Linear:
                return f"its {name}_proj is a {type(proj).__name__}, not a plain Linear"
        for proj in (m.gate_proj, m.up_proj, m.down_proj):
            if type(proj) is not torch.nn.Linear:
                return f"its MLP projections are {type(proj).__name__}, not plain Linear"
    every = torch.nn.modules.module  # hooks registered for every module (register_module_forward_hook)
    if any(
        not _recorder(h) for h in (*every._global_forward_hooks.values(), *every._global_forward_pre_hooks.values())
    ):
        return "a global forward hook is registered for every module"
    for name, module in model.named_modules():
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if any(not _recorder(hook) for hook in hooks) or "forward" in vars(module):
            return f"module {name or 'the model'} has hooks or a forward of its own"
    return None


def _recorder(hook: Any) -> bool:
    """Transformers' own output-capturing hooks (installed by a forward with ``output_hidden_states``)
    only record; the lean forward returns hidden states itself."""
    return getattr(hook, "__module__", "") == "transformers.utils.output_capturing"


@dataclass
class _Layer:
    g_in: torch.Tensor | None  # [H]; None: the layer has no input norm
    w_qkv: tuple[torch.Tensor, ...]  # fused: ([(Hq + 2 Hkv) D, H],); else (W_q, W_k, W_v), the model's own
    b_qkv: tuple[torch.Tensor | None, ...]  # their biases (None: none)
    w_o: torch.Tensor  # [H, Hq D]
    b_o: torch.Tensor | None
    g_post: torch.Tensor  # [H]
    w_gate_up: tuple[torch.Tensor, ...]  # fused: ([2 I, H],); else (W_gate, W_up)
    w_down: torch.Tensor  # [H, I]


@dataclass
class LeanOutput:
    logits: torch.Tensor  # [B, T, V]
    hidden_states: tuple[torch.Tensor, ...] | None = None  # L + 1 of [B, T, H], as Hugging Face's


def lean_layers(layers: Any, fuse: bool = True) -> list[_Layer]:
    """The weights of Hugging Face Llama-family decoder layers: with QKV and gate/up fused (copies: a
    draft's few matrices, one product each), or ``fuse=False`` the model's own tensors (no copy: a
    target's weights are most of its memory; measured as fast on SmolLM2, docs/design.md)."""
    out = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        qkv, gate_up = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
        biases = [p.bias for p in qkv]
        if fuse:
            w_qkv = (torch.cat([p.weight for p in qkv]).detach(),)
            b_qkv = (torch.cat(biases).detach() if all(b is not None for b in biases) else None,)
            w_gate_up = (torch.cat([p.weight for p in gate_up]).detach(),)
        else:
            w_qkv, b_qkv, w_gate_up = tuple(p.weight for p in qkv), tuple(biases), tuple(p.weight for p in gate_up)
        out.append(
            _Layer(
                g_in=getattr(layer.input_layernorm, "weight", None),  # None: no input norm (EAGLE's layer 0)
                w_qkv=w_qkv,
                b_qkv=b_qkv,
                w_o=a.o_proj.weight,
                b_o=a.o_proj.bias,
                g_post=layer.post_attention_layernorm.weight,
                w_gate_up=w_gate_up,
                w_down=m.down_proj.weight,
            )
        )
    return out


def project(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple, sizes: list[int], mm: Callable = linear
) -> list[torch.Tensor]:
    """x through one fused matrix, split into ``sizes``, or through each matrix in turn (``mm``: the
    product, ``row_matmul.product`` resolved for x's rows)."""
    if len(weights) == 1:
        return list(mm(x, weights[0], biases[0] if biases else None).split(sizes, dim=-1))
    return [mm(x, w, b) for w, b in zip(weights, biases or (None,) * len(weights))]


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
    """Llama's RMSNorm: in float32, back to the input's dtype, then the gain. Float32 on a CPU: torch's
    ``rms_norm``, which there runs these same operations in one call (equal to the bit,
    tests/test_lean.py); elsewhere its fused kernels sum in another order, and other dtypes apply the
    gain before the cast back, so those keep the formula."""
    if x.device.type == "cpu" and x.dtype == g.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], g, eps)
    var = x.float().pow(2).mean(-1, keepdim=True)
    return g * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``x·cos + rotate_half(x)·sin``, rotate_half(x) = (−x₂, x₁), to the bit."""
    return rotate(x, cos, signed_sin(sin))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x)·sin = roll(x, D/2)·signed_sin(sin) exactly
    ((−a)·b and a·(−b) round alike), so a forward negates once instead of once per layer and tensor."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    """RoPE with ``ssin = signed_sin(sin)``: three ops on x (roll, two products, a sum) instead of six."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * ssin


def run_layers(
    x: torch.Tensor,  # [B, T, H]
    layers: list[_Layer],
    position_embeddings: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) [B, T, D] from the rotary module
    mask: torch.Tensor | None,  # [B, 1, T, S] float; None: every row sees every cached row and itself
    cache: Any,  # a DynamicCache: layer i appends to slot i
    shape: tuple[int, int, int, float],  # (q heads, kv heads, head dim, RMSNorm eps)
    inputs: list[torch.Tensor] | None = None,  # if given: each layer's input x is appended to it
) -> torch.Tensor:  # [B, T, H]
    b, t, _ = x.shape
    nq, nkv, d, eps = shape
    cos, ssin = position_embeddings[0][:, None], signed_sin(position_embeddings[1][:, None])  # [B, 1, T, D]
    mask = mask.to(x.dtype) if mask is not None else None
    mm = product(x)  # every product of this forward reads b·t rows: W·Xᵀ or torch's, chosen once
    for i, L in enumerate(layers):
        if inputs is not None:
            inputs.append(x)
        n = x if L.g_in is None else rms_norm(x, L.g_in, eps)  # EAGLE's layer 0 reads fc's output as is
        q, k, v = project(n, L.w_qkv, L.b_qkv, [nq * d, nkv * d, nkv * d], mm)  # [B, T, Hq D], [B, T, Hkv D] x2
        q = rotate(q.view(b, t, nq, d).transpose(1, 2), cos, ssin)  # [B, Hq, T, D]
        k = rotate(k.view(b, t, nkv, d).transpose(1, 2), cos, ssin)  # [B, Hkv, T, D]
        v = v.view(b, t, nkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        k, v = cache.update(k, v, i)  # [B, Hkv, S, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nq != nkv)  # [B, Hq, T, D]
        x = x + mm(o.transpose(1, 2).reshape(b, t, nq * d), L.w_o, L.b_o)  # [B, T, H]
        gate, up = project(rms_norm(x, L.g_post, eps), L.w_gate_up, (), [L.w_down.shape[1]] * 2, mm)  # [B, T, I] each
        x = x + mm(F.silu(gate) * up, L.w_down)  # [B, T, H]
    return x


def layer_shape(layers: Any, eps: float) -> tuple[int, int, int, float]:
    attn = layers[0].self_attn
    d = attn.head_dim
    return attn.q_proj.out_features // d, attn.k_proj.out_features // d, d, float(eps)


def lean_target(model: Any) -> LeanCausalLM | None:
    """The lean forward a target verifies trees with, or None: ``TREESPEC_LEAN_TARGET=off``, a model it
    cannot run (``lean_reason``), one placed across devices, or one on which it does not give the
    model's own logits (``agrees``: checked once per model). Unfused, so it costs no memory: it reads
    the model's own weights and computes their products as the model's forward does (the logits are
    the same to the bit on the default pair and SmolLM2; tests/test_lean.py)."""
    if os.environ.get("TREESPEC_LEAN_TARGET", "auto").strip().lower() == "off":
        return None
    placed = getattr(model, "hf_device_map", None) or {}
    if len({str(d) for d in placed.values()}) > 1 or lean_reason(model) is not None:
        return None
    lean = LeanCausalLM(model, fuse=False)
    if model not in _AGREES:
        _AGREES[model] = agrees(model, lean)
    return lean if _AGREES[model] else None


#: models whose lean forward was checked against their own (``agrees``), and the answer
_AGREES: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


@inference
def agrees(model: Any, lean: LeanCausalLM, tokens: int = 6) -> bool:
    """Whether ``lean`` gives ``model``'s own logits on a short causal probe (the same argmax, and values
    equal up to summation order): a guard against a model whose forward computes something the
    formula above does not (a config option it does not know), which would otherwise decide tokens."""
    device = next(model.parameters()).device
    ids = (torch.arange(tokens, device=device) * 7919 % model.config.vocab_size)[None]  # [1, T]
    pos = torch.arange(tokens, device=device)[None]  # [1, T]
    mask = causal_mask(0, tokens, lean.embed.dtype).to(device)  # [T, T]
    want = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()  # [1, T, V]
    got = lean(input_ids=ids, position_ids=pos, attention_mask=mask[None, None], cache=DynamicCache()).logits.float()
    scale = float(want.abs().max())
    close = float((got - want).abs().max()) <= 1e-3 * scale + 1e-5
    return close and bool(torch.equal(got.argmax(-1), want.argmax(-1)))


class LeanCausalLM:
    """Call it like the Hugging Face model it wraps: ``lean(input_ids=, position_ids=, attention_mask=,
    cache=, output_hidden_states=)`` → ``.logits`` (and ``.hidden_states`` as Hugging Face gives them:
    the input of each decoder layer, then the final norm's output). The mask is the 4D float mask, or
    None when every row sees the whole cache and itself (one new token)."""

    def __init__(self, model: Any, fuse: bool = True):
        reason = lean_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        cfg, inner = model.config, model.model
        self.model = model
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.rotary = RopeTable(inner.rotary_emb)
        self.g_final = inner.norm.weight  # [H]
        self.lm_head = model.get_output_embeddings().weight  # [V, H]
        self.layers = lean_layers(inner.layers, fuse)
        self.shape = layer_shape(inner.layers, cfg.rms_norm_eps)

    @inference
    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, T]
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None,  # [B, 1, T, S]
        cache: Any,
        use_cache: bool = True,
        output_hidden_states: Any = False,
    ) -> LeanOutput:
        x = F.embedding(input_ids, self.embed)  # [B, T, H]
        inputs: list[torch.Tensor] | None = [] if output_hidden_states else None
        x = run_layers(x, self.layers, self.rotary(x, position_ids), attention_mask, cache, self.shape, inputs)
        x = rms_norm(x, self.g_final, self.shape[3])  # [B, T, H]
        hidden = (*inputs, x) if inputs is not None else None  # L + 1 of [B, T, H]
        return LeanOutput(logits=linear(x, self.lm_head), hidden_states=hidden)  # logits [B, T, V]
