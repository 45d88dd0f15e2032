"""The EAGLE-1/EAGLE-2 draft head: one decoder layer that extrapolates the target's features.

Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (2024). The head
never sees raw text alone: item j of its sequence is the pair

    (f_j, x_{j+1})     f_j = the target's last hidden state (after its final norm) at token x_j
                       x_{j+1} = the next token, embedded with the TARGET's embedding table

and its output at item j is a prediction f̂_{j+1} of the target's feature at x_{j+1}; the TARGET's
output head turns it into a distribution over x_{j+2}:

    h_j   = fc([embed(x_{j+1}); f_j])                    fc: Linear(2H → H, bias)
    f̂_j+1 = DecoderLayer(h_j)  (Llama layer; layer 0 has no input norm, and there is no final norm)
    q(x_{j+2}) = softmax(lm_head(f̂_{j+1}))

Item j sits at position j. Checkpoints use the published layout (SafeAILab's ``cnets1.py``; e.g.
``yuhuili/EAGLE-llama2-chat-7B``): ``config.json`` (a Llama config with ``num_hidden_layers`` = head
layers, ``bias`` absent = true; LLaMA-3 heads say ``"bias": false``) and ``model.safetensors`` or
``pytorch_model.bin`` (fp32 or fp16; cast to the target's dtype) holding ``fc.*`` and ``layers.N.*`` —
layer 0 without ``input_layernorm`` — and an ``embed_tokens.weight`` copy, which is checked and
ignored: the target's table is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from treespec.errors import ConfigError, ModelLoadError
from treespec.files import read_json, save_safetensors_atomic, write_text_atomic, writing
from treespec.inference import inference
from treespec.kv import cache_keyword
from treespec.row_matmul import linear

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def target_dims(config: Any) -> tuple[int, int]:
    """(hidden size, vocabulary size) of a target's text config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    return int(hidden), int(cfg.vocab_size)


def drafter_dims(target: Any) -> tuple[int, int]:
    """(hidden size, vocabulary size) a drafter on ``target`` works in: the config's vocabulary cut to
    the tokenizer's where the output layer is padded past it."""
    hidden, vocab = target_dims(target.config)
    return hidden, min(vocab, target.vocab_size)


def shipped_drafter(target: Any, table: dict[str, str], drafter: str, kind: str, train: str) -> str:
    """The drafter alias ``table`` (``catalog.SHIPPED_HEADS`` / ``SHIPPED_BLOCKS``) ships for ``target``,
    or one line naming the fix: pass ``head=``, or make one (a ``kind``) with ``train``."""
    from treespec.catalog import shipped_for

    found = shipped_for(target.name, table)
    if found is None:
        raise ConfigError(
            f"drafter {drafter!r} needs a {kind} trained for target "
            f"{target.name!r}: pass -D head=DIR-or-HUB-ID (make one with `{train} --target ...`)"
        )
    return found


def head_config_for(target_config: Any, layers: int = 1) -> LlamaConfig:
    """A head config for a target: its hidden size, heads, MLP width, RoPE and vocabulary."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden, vocab = target_dims(cfg)
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    rope = getattr(cfg, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(cfg, "rope_theta", 10000.0),
    }
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=getattr(cfg, "intermediate_size", None) or 4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
        num_hidden_layers=layers,
        vocab_size=vocab,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048),
        rope_parameters=dict(rope),
        architectures=["LlamaForCausalLM"],
    )


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig, bias: bool = True):
        super().__init__()
        config._attn_implementation = config._attn_implementation or "sdpa"
        self.config = config
        self.bias = bias
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layers[0].input_layernorm = nn.Identity()  # as published: layer 0 reads fc's output as is (no weight)
        self.cache_keyword = cache_keyword(self.layers[0].self_attn)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] the target's (or the head's own predicted) features f_j
        embeds: torch.Tensor,  # [B, T, H] embeddings of x_{j+1}
        position_ids: torch.Tensor,  # [B, T]
        mask: torch.Tensor | None,  # [B, 1, T, S] float: 0 = attend, finfo.min = blocked (S = cached + T); None: all
        cache: Any = None,
    ) -> torch.Tensor:  # [B, T, H] predicted features f̂_{j+1}
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [B, T, H]
        pos = self.rotary(x, position_ids)  # (cos, sin) [B, T, D]
        for i, layer in enumerate(self.layers):
            residual = x
            if i > 0:  # as published: the first layer's input is fc's output, not normalised
                x = layer.input_layernorm(x)
            x, _ = layer.self_attn(
                hidden_states=x, position_embeddings=pos, attention_mask=mask, **{self.cache_keyword: cache}
            )
            x = residual + x
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def lean(self) -> LeanEagleHead:
        """The same forward for inference, through ``treespec.lean`` (fused weights, no module calls)."""
        return LeanEagleHead(self)

    # ------------------------------------------------------------------ files
    def save(self, out: str | Path, extra: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the published layout (weights cast to ``dtype``),
        each atomically, the weights first; a failed write is one ``ConfigError`` line."""
        out = Path(out)
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg.pop("_attn_implementation_autoset", None)
        cfg["bias"] = self.bias
        if extra:
            cfg["treespec"] = extra
        state = {
            k: v.detach().to(dtype or v.dtype).contiguous().cpu()
            for k, v in self.state_dict().items()
            if not k.startswith("rotary.")
        }
        save_safetensors_atomic(state, out / "model.safetensors")
        write_text_atomic(out / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")


class LeanEagleHead:
    """``EagleHead.forward`` for inference without per-module overhead; same arguments, same result."""

    def __init__(self, head: EagleHead):
        from treespec.lean import RopeTable, layer_shape, lean_layers

        self.head = head
        self.rotary = RopeTable(head.rotary)
        self.layers = lean_layers(head.layers)
        self.shape = layer_shape(head.layers, head.config.rms_norm_eps)

    @inference
    def __call__(self, features, embeds, position_ids, mask, cache=None) -> torch.Tensor:
        from treespec.lean import run_layers

        x = linear(torch.cat([embeds, features], dim=-1), self.head.fc.weight, self.head.fc.bias)
        pos = self.rotary(x, position_ids)  # (cos, sin) [B, T, D]
        return run_layers(x, self.layers, pos, mask, cache, self.shape)  # [B, T, H]


def load_head(name: str, hidden: int, vocab: int, target_name: str = "the target") -> tuple[EagleHead, dict[str, Any]]:
    """Load a head by local directory, alias-free hub id, or the Hugging Face cache; refuse one whose
    hidden size or vocabulary does not match the target's (``hidden``, ``vocab``)."""
    raw, folder = read_config(name)
    if any("eagle3" in str(a).lower() for a in raw.get("architectures") or []) or "draft_vocab_size" in raw:
        raise ConfigError(f"EAGLE head {name!r} is an EAGLE-3 head: use --drafter eagle3")
    h, v = raw.get("hidden_size"), raw.get("vocab_size")
    if h != hidden:
        raise ConfigError(
            f"EAGLE head {name!r} has hidden size {h} but {target_name} has {hidden}: use a head trained for "
            f"this target (`treespec train eagle --target ...`)"
        )
    if v != vocab:
        raise ConfigError(
            f"EAGLE head {name!r} has a vocabulary of {v} tokens but {target_name} has {vocab}: use a head "
            f"trained for this target (`treespec train eagle --target ...`)"
        )
    state = read_weights(folder, name)
    state.pop("layers.0.input_layernorm.weight", None)  # never used (layer 0 has no input norm); older saves had it
    emb = state.pop("embed_tokens.weight", None)
    if emb is not None and tuple(emb.shape) != (vocab, hidden):
        raise ConfigError(
            f"EAGLE head {name!r}: its embed_tokens is {tuple(emb.shape)}, the target's is {(vocab, hidden)}"
        )
    fc = state.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] == 3 * hidden:
        raise ConfigError(
            f"EAGLE head {name!r} is an EAGLE-3 head (its fc fuses 3 feature layers): use --drafter eagle3"
        )
    stored = 1 + max(
        (int(k.split(".")[1]) for k in state if k.split(".")[0] == "layers" and k.split(".")[1].isdigit()), default=0
    )
    layers = raw.get("num_hidden_layers", 1)
    if isinstance(layers, int) and layers > stored:  # before building them: 100,000 layers are gigabytes
        raise ModelLoadError(
            f"EAGLE head {name!r}: config.json says num_hidden_layers {layers:,} but its weights hold "
            f"{stored}: fix num_hidden_layers in its config.json (EAGLE-1/2 heads have 1)"
        )
    config = LlamaConfig(**{k: val for k, val in raw.items() if k not in ("bias", "treespec")})
    # fc's bias: the config's ``bias`` (absent = on, as EAGLE publishes), or the weights' own: SGLang's
    # EAGLE-1 fc always has one and its config's ``bias`` means attention biases there
    head = EagleHead(config, bias=bool(raw.get("bias", True)) or "fc.bias" in state)
    fit_weights(head, state, f"EAGLE head {name!r}", "the EAGLE layout", "; is this an EAGLE-1/2 head?")
    return head.eval(), raw.get("treespec", {})


def fit_weights(head: nn.Module, state: dict[str, torch.Tensor], what: str, layout: str, hint: str = "") -> None:
    """Load ``state`` into ``head`` (its rotary buffers are derived, never stored); a shape mismatch, a
    missing or an unexpected key is one line naming ``what`` and the expected ``layout``."""
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape mismatch
        first = next(
            (line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc).splitlines()[0]
        )
        raise ModelLoadError(f"{what}: weights do not fit its config.json ({first}){hint}") from None
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ModelLoadError(
            f"{what}: weights do not match {layout} (missing {missing[:3]}, unexpected {list(unexpected)[:3]}){hint}"
        )


def read_config(name: str, what: str = "EAGLE head") -> tuple[dict[str, Any], Path]:
    """(config.json as a dict, the head's folder) for a local directory, hub id or cached head
    (``what`` names it in errors)."""
    from treespec.models import snapshot_dir

    folder = snapshot_dir(name, ["config.json", *WEIGHT_FILES], what=what)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{what} {name!r}: {folder} has no config.json; pass the head's directory")
    raw = read_json(cfg_path, f"{what} {name!r}:", "download or save the head again", ModelLoadError)
    return raw, folder


def read_weights(folder: Path, name: str, what: str = "EAGLE head") -> dict[str, torch.Tensor]:
    """The head's tensors from model.safetensors or pytorch_model.bin (weights_only), keys unprefixed."""
    st, pt = folder / WEIGHT_FILES[0], folder / WEIGHT_FILES[1]
    if not st.is_file() and not pt.is_file():
        raise ModelLoadError(f"{what} {name!r}: {folder} has neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]}")
    try:
        if st.is_file():
            from safetensors.torch import load_file

            state = load_file(str(st))
        else:  # plain tensors only: a pickle that holds anything else is refused, never run
            state = torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - damaged or unsafe files become one line
        path = st if st.is_file() else pt
        why = (
            "it holds more than plain tensors, which treespec never unpickles"
            if "weights_only" in str(exc)
            else f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        )
        raise ModelLoadError(
            f"{what} {name!r}: cannot read {path.name} ({why}); download or save the head again"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{what} {name!r}: its weights file is not a mapping of names to tensors")
    # some re-uploads prefix the keys; the published layout has none
    for prefix in ("model.", "ea_layer."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state
