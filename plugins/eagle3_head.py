"""The EAGLE-3 draft head: one decoder layer predicting tokens from the target's fused features.

Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test" (arXiv 2503.01840). Item j of the head's sequence pairs a feature with the NEXT token:

    g_j   = fc([h^a_j ; h^b_j ; h^c_j])       the target's hidden states at x_j from three layers (low,
                                             middle, high: the inputs of layers 2, L//2, L−3), fused
                                             fc: Linear(3·Ht → H, no bias)
    x     = [rmsnorm_in(embed(x_{j+1})) ; rmsnorm_hidden(g_j)]          [2H]: q/k/v read 2H
    h     = g_j + o_proj(attn(x))                                       the residual is g_j itself
    out_j = h + mlp(rmsnorm_post(h))                                    pre-norm output, [H]
    q(x_{j+2}) = softmax(lm_head(rmsnorm(out_j)))  over the DRAFT vocabulary (Vd ≤ V tokens)

A deeper tree level feeds the head's own ``out`` in place of g (fc is skipped: it maps 3·Ht only);
``out`` is not a prediction of any target feature, unlike EAGLE-1's. A draft id d is target id
d + d2t[d] (``d2t`` holds offsets). Item j sits at position j.

Checkpoints use the published layout (SafeAILab's EAGLE-3 release, e.g.
``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``; the same keys load in vLLM and SGLang): ``config.json`` (a
Llama config with ``draft_vocab_size``; ``architectures`` LlamaForCausalLM or
LlamaForCausalLMEagle3; optional ``target_hidden_size`` and the feature layers, see ``config_layers``;
or vLLM's speculators layout: ``transformer_layer_config`` + top-level fields, weights ``layers.0.*``) and ``model.safetensors`` or ``pytorch_model.bin``
(fp16 as published; cast to the target's dtype) with ``fc.weight``, ``midlayer.{self_attn,mlp}.*``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``, ``norm.weight``,
``lm_head.weight`` [Vd, H], ``d2t`` [Vd] int64 and ``t2d`` [V] bool. No embedding table: the
target's is used (a copy, if present, is checked and ignored).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from treespec.errors import ConfigError, ModelLoadError
from treespec.files import save_safetensors_atomic, write_text_atomic, writing
from treespec.lean import RopeTable, apply_rope, rms_norm
from treespec.row_matmul import linear

#: config keys that are not LlamaConfig's
EXTRA_KEYS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "treespec",
    "bias",
    "norm_before_residual",
)


def default_layers(target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's feature layers for a target of ``target_layers`` decoder layers, as indices into
    Hugging Face's ``hidden_states`` (i = the input of layer i): (2, L//2, L−3), as the reference
    code, vLLM and SGLang capture them (clamped into range for targets of fewer than 5 layers)."""
    top = max(0, target_layers - 1)
    return tuple(min(max(i, 0), top) for i in (2, target_layers // 2, target_layers - 3))


def config_layers(raw: dict[str, Any]) -> tuple[int, ...] | None:
    """Feature layers named by a head's config, as hidden_states indices (i = the input of decoder
    layer i); None if the config names none. The two engines number them differently:

    * top level ``eagle_aux_hidden_state_layer_ids`` (vLLM's key, and the speculators layout's):
      vLLM captures id i as the residual stream entering layer i (``vllm/model_executor/models/
      interfaces.py`` ``_maybe_add_hidden_state``) = hidden_states[i]: read as it is;
    * ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge's and SGLang's key): SGLang takes the
      OUTPUT of layer id (``python/sglang/srt/models/llama.py`` ``set_eagle3_layers_to_capture``: id + 1)
      = hidden_states[id + 1]."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return tuple(int(i) for i in top)
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) + 1 for i in nested) if nested else None


def flatten_speculators(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """A head config in the speculators layout (``speculators_model_type``, as vLLM serves EAGLE-3:
    ``vllm/transformers_utils/configs/speculators/``) as the flat Llama config the rest reads: the
    ``transformer_layer_config`` plus the top-level EAGLE-3 fields. Variants treespec does not compute
    (a norm before fc, per-layer fc norms, a normed output) are refused in one line."""
    if "speculators_model_type" not in raw:
        return raw
    if raw.get("speculators_model_type") != "eagle3":
        raise ConfigError(
            f"head {name!r} is a speculators {raw.get('speculators_model_type')!r} model: treespec loads "
            "eagle3 speculators only"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"head {name!r}: its speculators config has no transformer_layer_config object")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            raise ConfigError(
                f"EAGLE-3 head {name!r} sets {flag}: treespec computes the published EAGLE-3 layer only "
                f"(export it without {flag})"
            )
    flat = {k: v for k, v in layer.items() if k != "architectures"}
    flat["architectures"] = ["LlamaForCausalLMEagle3"]
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "treespec"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    # vLLM's reading: absent = True (transformers_utils/configs/speculators/algos.py, update_eagle3)
    flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))
    return flat


class Eagle3Head(nn.Module):
    """Weights in the published key layout; ``forward`` is the formula above."""

    def __init__(self, config: LlamaConfig, target_hidden: int, draft_vocab: int, target_vocab: int):
        super().__init__()
        self.config = config
        h = config.hidden_size
        d = getattr(config, "head_dim", None) or h // config.num_attention_heads
        nq, nkv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.shape = (nq, nkv, d, float(config.rms_norm_eps))
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = nn.Module()
        attn, mlp = nn.Module(), nn.Module()
        attn.q_proj = nn.Linear(2 * h, nq * d, bias=False)
        attn.k_proj = nn.Linear(2 * h, nkv * d, bias=False)
        attn.v_proj = nn.Linear(2 * h, nkv * d, bias=False)
        attn.o_proj = nn.Linear(nq * d, h, bias=False)
        mlp.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.midlayer.self_attn, self.midlayer.mlp = attn, mlp
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self.midlayer, norm, nn.Module())
            getattr(self.midlayer, norm).weight = nn.Parameter(torch.ones(h))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # target id = d + d2t[d]
        self.register_buffer("t2d", torch.ones(target_vocab, dtype=torch.bool))  # target ids in the draft vocab
        self.rotary = LlamaRotaryEmbedding(config)
        self._rope: RopeTable | None = None
        self.norm_before_residual = False  # speculators' variant: the residual is hidden_norm(g), not g
        self.embed_tokens: nn.Embedding | None = None  # its own, when its hidden size is not the target's

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def qkv(self, embeds: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Hq, T, D], k and v [B, Hkv, T, D] (before RoPE) from embeddings and features [B, T, H]."""
        m, (nq, nkv, d, eps) = self.midlayer, self.shape
        b, t, _ = g.shape
        x = torch.cat(
            [rms_norm(embeds, m.input_layernorm.weight, eps), rms_norm(g, m.hidden_norm.weight, eps)], -1
        )  # [B, T, 2H]
        q = linear(x, m.self_attn.q_proj.weight).view(b, t, nq, d).transpose(1, 2)
        k = linear(x, m.self_attn.k_proj.weight).view(b, t, nkv, d).transpose(1, 2)
        v = linear(x, m.self_attn.v_proj.weight).view(b, t, nkv, d).transpose(1, 2)
        return q, k, v

    def finish(self, g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer's output [B, T, H] from its residual g and the attention's output o [B, Hq, T, D]."""
        m, eps = self.midlayer, self.shape[3]
        b, _, t, _ = o.shape
        h = g + linear(o.transpose(1, 2).reshape(b, t, -1), m.self_attn.o_proj.weight)  # [B, T, H]
        n = rms_norm(h, m.post_attention_layernorm.weight, eps)
        gate, up = linear(n, m.mlp.gate_proj.weight), linear(n, m.mlp.up_proj.weight)
        return h + linear(F.silu(gate) * up, m.mlp.down_proj.weight)  # [B, T, H]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g from a feature [.., 3·Ht] (fc) or from the head's own output [.., H] (as is)."""
        return linear(features, self.fc.weight) if features.shape[-1] != self.hidden_size else features

    def forward(
        self,
        features: torch.Tensor,  # [B, T, 3·Ht] the target's fused layers, or [B, T, H] the head's own outputs
        embeds: torch.Tensor,  # [B, T, H] embeddings of x_{j+1}
        position_ids: torch.Tensor,  # [B, T]
        mask: torch.Tensor | None,  # [B, 1, T, S] float: 0 = attend, finfo.min = blocked; None: all
        cache: Any = None,  # a DynamicCache (slot 0) or None
    ) -> torch.Tensor:  # [B, T, H] pre-norm outputs
        g = self.fuse(features)  # [B, T, H]
        q, k, v = self.qkv(embeds, g)
        if self._rope is None or self._rope.rotary is not self.rotary:
            self._rope = RopeTable(self.rotary)
        cos, sin = self._rope(g, position_ids)  # [B, T, D]
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
        if cache is not None:
            k, v = cache.update(k, v, 0)  # [B, Hkv, S, D]
        nq, nkv = self.shape[0], self.shape[1]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask.to(q.dtype), enable_gqa=nq != nkv
        )  # [B, Hq, T, D]
        if self.norm_before_residual:
            g = rms_norm(g, self.midlayer.hidden_norm.weight, self.shape[3])
        return self.finish(g, o)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] from outputs [.., H]."""
        return linear(rms_norm(out, self.norm.weight, self.shape[3]), self.lm_head.weight)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------------ files
    def save(self, out: str | Path, extra: dict[str, Any] | None = None, layers: tuple[int, ...] | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the published layout (``layers``: the
        feature layers as hidden_states indices, written as the config's layer ids = index − 1), each
        atomically, the weights first; a failed write is one ``ConfigError`` line."""
        out = Path(out)
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg.pop("_attn_implementation_autoset", None)
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=int(self.lm_head.out_features),
            target_hidden_size=int(self.fc.in_features // 3),
            vocab_size=int(self.t2d.numel()),
        )
        if layers is not None:
            cfg["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
                "use_aux_hidden_state": True,
            }
        if extra:
            cfg["treespec"] = extra
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        save_safetensors_atomic(state, out / "model.safetensors")
        write_text_atomic(out / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def is_eagle3(raw: dict[str, Any], state: dict[str, torch.Tensor] | None = None) -> bool:
    """An EAGLE-3 head, by its config (architecture, draft_vocab_size) or its keys (midlayer.*)."""
    if any("eagle3" in str(a).lower() for a in raw.get("architectures") or []) or "draft_vocab_size" in raw:
        return True
    return bool(state) and any(k.startswith(("midlayer.", "midlayers.")) for k in state)


def load_head3(
    name: str, hidden: int, vocab: int, target_name: str = "the target"
) -> tuple[Eagle3Head, dict[str, Any]]:
    """Load an EAGLE-3 head (local directory, hub id, or the Hugging Face cache); refuse one that does
    not fit a target of hidden size ``hidden`` and vocabulary ``vocab``, in one line."""
    from treespec.plugins.eagle_head import fit_weights, read_config, read_weights

    raw, folder = read_config(name)
    raw = flatten_speculators(raw, name)
    state = read_weights(folder, name)
    if (
        is_eagle3(raw)
        and any(k.startswith("layers.0.") for k in state)
        and not any(k.startswith("midlayer.") for k in state)
    ):
        state = {("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    if not is_eagle3(raw, state):
        raise ConfigError(f"EAGLE head {name!r} is an EAGLE-1/2 head (no midlayer.* weights): use --drafter eagle")
    if any(k.startswith("midlayers.") for k in state) or int(raw.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(
            f"EAGLE-3 head {name!r} has {raw.get('num_hidden_layers')} layers: treespec loads the published "
            "one-layer EAGLE-3 heads only"
        )
    h = raw.get("hidden_size")
    th = raw.get("target_hidden_size") or h
    emb = state.pop("embed_tokens.weight", None)
    _check_fit(name, raw, emb, hidden, vocab, target_name)
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if "d2t" not in state:  # published heads without a reduced vocabulary may omit the maps
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    if "t2d" not in state:
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(
            0, torch.arange(draft_vocab) + state["d2t"].long(), True
        )
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in EXTRA_KEYS})
    head = Eagle3Head(config, target_hidden=int(th), draft_vocab=draft_vocab, target_vocab=vocab)
    head.norm_before_residual = bool(raw.get("norm_before_residual", False))
    fit_weights(head, state, f"EAGLE-3 head {name!r}", "the EAGLE-3 layout")
    if (
        h != hidden
    ):  # a head narrower or wider than its target (SpecForge/vLLM ``target_hidden_size``): its own embedding
        head.embed_tokens = nn.Embedding(vocab, h)
        head.embed_tokens.weight.data.copy_(emb)
    # (a head as wide as the target embeds with the target's table, of which published heads ship a copy)
    ids = head.target_ids(torch.arange(draft_vocab))
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft_vocab:
        raise ModelLoadError(
            f"EAGLE-3 head {name!r}: its d2t does not map the draft vocabulary onto distinct target ids"
        )
    return head.eval(), raw


def _check_fit(
    name: str, raw: dict[str, Any], emb: torch.Tensor | None, hidden: int, vocab: int, target_name: str
) -> None:
    """One line for a head that does not fit the target: the features it reads, its vocabulary, and its
    own embedding where its width differs from the target's."""
    h = raw.get("hidden_size")
    th = raw.get("target_hidden_size") or h
    if th != hidden:
        raise ConfigError(
            f"EAGLE-3 head {name!r} reads target features of size {th} but {target_name} has {hidden}: "
            "use a head trained for this target (`treespec train eagle --version 3 --target ...`)"
        )
    if raw.get("vocab_size") != vocab:
        raise ConfigError(
            f"EAGLE-3 head {name!r} has a vocabulary of {raw.get('vocab_size')} tokens but {target_name} has "
            f"{vocab}: use a head trained for this target (`treespec train eagle --version 3 --target ...`)"
        )
    if h != hidden and emb is None:
        raise ConfigError(
            f"EAGLE-3 head {name!r} has hidden size {h} ≠ the target's {hidden} and no embedding of its own"
        )
    if emb is not None and tuple(emb.shape) != (vocab, h):
        raise ConfigError(
            f"EAGLE-3 head {name!r}: its embed_tokens is {tuple(emb.shape)}, but its vocabulary and hidden size "
            f"need {(vocab, h)}"
        )
