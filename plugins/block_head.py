"""The block drafter's network: one forward gives a distribution for each of the next K positions.

After DFlash (arXiv 2602.06036): a few Llama decoder layers read a *block* [root, m, m, …, m] whose
K mask rows stand for the unknown next tokens, while the target's features of the committed
context enter every layer as extra keys and values ("KV injection"). With a = the root's position
(the context is x_0..x_{a−1}, the root x_a is the last committed token, not yet run by the target):

    c_t    = rmsnorm_hidden(fc([h^1_t ; h^2_t ; h^3_t]))    t < a: the target's hidden states at x_t
                                                             from three layers, fused
    layer l, context rows (keys/values only, never queries):
           K^l_t = RoPE_t(W^l_k c_t),  V^l_t = W^l_v c_t
    block  x_0 = embed_target(root),  x_i = m (one learned vector), i = 1..K,  at positions a + i;
           with ``last_feature`` every row also adds c_{a−1} (the newest context row as an input, the
           way an EAGLE head reads f_{a−1}; not in DFlash)
    layer l, block rows: a Llama pre-norm layer whose queries are the block rows and whose keys and
           values are [context rows ; block rows]: every context row and the WHOLE block are visible
           (bidirectional inside the block)
    q_i    = softmax(rmsnorm(out_i) · W_targetᵀ[draft ids])   row i predicts x_{a+i}, i = 1..K

Row 0's output predicts nothing (x_a is known). The output layer is the target's own (rows of the
draft vocabulary, ``draft_ids``), frozen and shared, as DFlash shares it; so is the embedding table.
Context keys and values do not depend on the block, so the drafter caches them and a step projects
only the newly committed rows (``context_one``); the block itself is never cached. Decoding reads the
layers' weights concatenated (``Fused``: [Wq; Wk; Wv], [Wgate; Wup], every layer's [Wk; Wv]), the same
dot products in fewer calls: on the default pair a step's drafting 4.24 → 3.87 ms (chain of 7,
2 threads, ``examples/block_draft_ab.py``; docs/bench/block3-default-pair/NOTES.md).

Files: ``config.json`` (a Llama config for the layers + a ``block`` section, ``BlockSpec``) and
``model.safetensors`` (``fc``, ``hidden_norm``, ``mask``, ``layers.i.*`` in Llama's names, ``norm``,
``draft_ids``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from treespec.errors import ConfigError, ModelLoadError
from treespec.files import save_safetensors_atomic, write_text_atomic, writing
from treespec.lean import RopeTable, apply_rope, rms_norm, rotate, signed_sin
from treespec.plugins.eagle_head import fit_weights, read_config, read_weights
from treespec.row_matmul import linear

ARCHITECTURE = "TreespecBlockDrafter"

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's context keys and values, each [B, Hkv, S, D]


@dataclass(frozen=True)
class BlockSpec:
    """The ``block`` section of config.json: what the network reads and predicts."""

    block_size: int  # K: draft positions per forward (the block has K + 1 rows)
    target_layers: tuple[int, ...]  # the target's hidden_states indices fused into c (i = input of layer i)
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    last_feature: bool = False  # every block row also adds c of the last context row (its input, not only keys)


@dataclass(frozen=True)
class Fused:
    """The decoding forward's weights, concatenated by rows (``BlockHead.fused``): one product where
    the layers' own take two or three, each output row the same dot product."""

    kv: torch.Tensor  # [L·2·Hkv·D, H] every layer's k_proj then v_proj: a step's new context rows in one product
    qkv: list[torch.Tensor]  # per layer [(Hq + 2Hkv)·D, H]: q_proj, k_proj, v_proj
    gate_up: list[torch.Tensor]  # per layer [2I, H]: gate_proj, up_proj


def _gain(h: int) -> nn.Module:
    norm = nn.Module()
    norm.weight = nn.Parameter(torch.ones(h))
    return norm


def _layer(config: LlamaConfig, nq: int, nkv: int, d: int) -> nn.Module:
    h, inner = config.hidden_size, config.intermediate_size
    layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
    attn.q_proj = nn.Linear(h, nq * d, bias=False)
    attn.k_proj = nn.Linear(h, nkv * d, bias=False)
    attn.v_proj = nn.Linear(h, nkv * d, bias=False)
    attn.o_proj = nn.Linear(nq * d, h, bias=False)
    mlp.gate_proj = nn.Linear(h, inner, bias=False)
    mlp.up_proj = nn.Linear(h, inner, bias=False)
    mlp.down_proj = nn.Linear(inner, h, bias=False)
    layer.self_attn, layer.mlp = attn, mlp
    layer.input_layernorm, layer.post_attention_layernorm = _gain(h), _gain(h)
    return layer


class BlockHead(nn.Module):
    """The network of the module docstring; ``context`` + ``forward`` (batched, any visibility, for
    training) or ``context_one`` + ``forward_one`` (one block seeing its whole context, for decoding)
    are the same math."""

    def __init__(self, config: LlamaConfig, spec: BlockSpec):
        super().__init__()
        self.config, self.spec = config, spec
        h = config.hidden_size
        d = getattr(config, "head_dim", None) or h // config.num_attention_heads
        nq, nkv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.shape = (nq, nkv, d, float(config.rms_norm_eps))
        self.fc = nn.Linear(len(spec.target_layers) * spec.target_hidden_size, h, bias=False)
        self.hidden_norm = _gain(h)
        self.mask = nn.Parameter(torch.zeros(h))  # the mask rows' input
        self.layers = nn.ModuleList([_layer(config, nq, nkv, d) for _ in range(config.num_hidden_layers)])
        self.norm = _gain(h)
        self.register_buffer("draft_ids", torch.arange(spec.draft_vocab_size))  # [Vd] target ids, ascending
        self.rotary = LlamaRotaryEmbedding(config)
        self.rope = RopeTable(self.rotary)

    # ------------------------------------------------------------------ the math
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """c = rmsnorm_hidden(fc(features)): [.., S, k·Ht] → [.., S, H]."""
        return rms_norm(linear(features, self.fc.weight), self.hidden_norm.weight, self.shape[3])

    def context(self, c: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Each layer's keys and values [B, Hkv, S, D] for fused context rows c [B, S, H] at ``positions`` [B, S]."""
        _, nkv, d, _ = self.shape
        b, s, _ = c.shape
        cos, sin = self.rope(c, positions)  # [B, S, D]
        out = []
        for layer in self.layers:
            a = layer.self_attn
            k = linear(c, a.k_proj.weight).view(b, s, nkv, d).transpose(1, 2)  # [B, Hkv, S, D]
            v = linear(c, a.v_proj.weight).view(b, s, nkv, d).transpose(1, 2)
            out.append((apply_rope(k, cos[:, None], sin[:, None]), v))
        return out

    def block_input(self, roots: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """The block [.., K+1, H]: the roots' embeddings [.., H] then K mask rows; with ``spec.last_feature``,
        plus ``last`` [.., H] (c of the last context row; None or zeros: an empty context) in every row."""
        masks = self.mask.to(roots.dtype).expand(*roots.shape[:-1], self.spec.block_size, roots.shape[-1])
        x = torch.cat([roots[..., None, :], masks], -2)
        if self.spec.last_feature and last is not None:
            x = x + last[..., None, :].to(x.dtype)
        return x

    def forward(
        self,
        x: torch.Tensor,  # [B, N, R, H] N blocks of R rows per sequence
        positions: torch.Tensor,  # [B, N, R]
        ctx: list[KV],  # per layer, [B, Hkv, S, D] each
        visible: torch.Tensor,  # [B, N, S] bool: context rows each block sees
    ) -> torch.Tensor:  # [B, N, R, H] pre-norm outputs
        nq, nkv, d, eps = self.shape
        b, n, r, _ = x.shape
        cos, sin = self.rope(x, positions.reshape(b, n * r))  # [B, N·R, D]
        cos, sin = cos.view(b, 1, n, r, d), sin.view(b, 1, n, r, d)
        acc = torch.promote_types(x.dtype, torch.float32)  # scores in float32 at least
        blocked = torch.zeros(visible.shape, dtype=acc, device=x.device).masked_fill(~visible, float("-inf"))
        for layer, (k_ctx, v_ctx) in zip(self.layers, ctx):
            a = layer.self_attn
            y = rms_norm(x, layer.input_layernorm.weight, eps)  # [B, N, R, H]
            q = apply_rope(linear(y, a.q_proj.weight).view(b, n, r, nq, d).permute(0, 3, 1, 2, 4), cos, sin)
            k = apply_rope(linear(y, a.k_proj.weight).view(b, n, r, nkv, d).permute(0, 3, 1, 2, 4), cos, sin)
            v = linear(y, a.v_proj.weight).view(b, n, r, nkv, d).permute(0, 3, 1, 2, 4)  # [B, Hkv, N, R, D]
            rep = nq // nkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, Hq, N, R, D]
            kc, vc = k_ctx.repeat_interleave(rep, 1)[:, :, None], v_ctx.repeat_interleave(rep, 1)[:, :, None]
            s_ctx = (q @ kc.transpose(-1, -2)).to(acc) * d**-0.5 + blocked[:, None, :, None]  # [B, Hq, N, R, S]
            s_blk = (q @ k.transpose(-1, -2)).to(acc) * d**-0.5  # [B, Hq, N, R, R]
            w = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1).to(q.dtype)
            s = s_ctx.shape[-1]
            o = w[..., :s] @ vc + w[..., s:] @ v  # [B, Hq, N, R, D]
            x = self._finish(layer, x, o.permute(0, 2, 3, 1, 4).reshape(b, n, r, nq * d))
        return x

    def fused(self) -> Fused:
        """The decoding forward's matrices, concatenated from the layers' (a copy: take it again after
        the weights change)."""
        kv = [w for layer in self.layers for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)]
        return Fused(
            kv=torch.cat(kv).detach(),
            qkv=[
                torch.cat([la.self_attn.q_proj.weight, la.self_attn.k_proj.weight, la.self_attn.v_proj.weight]).detach()
                for la in self.layers
            ],
            gate_up=[torch.cat([la.mlp.gate_proj.weight, la.mlp.up_proj.weight]).detach() for la in self.layers],
        )

    def context_one(self, c: torch.Tensor, positions: torch.Tensor, fused: Fused) -> list[KV]:
        """``context`` for one sequence's new rows c [1, S, H] at ``positions`` [1, S] in one product for every
        layer's keys and values and one rotation for every layer's keys (decoding; the same math)."""
        _, nkv, d, _ = self.shape
        s, n = c.shape[1], len(self.layers)
        cos, sin = self.rope(c, positions)  # [1, S, D]
        kv = linear(c, fused.kv).view(s, n, 2, nkv, d).permute(1, 2, 3, 0, 4)  # [L, 2, Hkv, S, D]
        k = rotate(kv[:, 0], cos, signed_sin(sin))  # [L, Hkv, S, D]
        return [(k[i : i + 1], kv[i, 1][None]) for i in range(n)]

    def forward_one(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: list[KV], fused: Fused | None = None
    ) -> torch.Tensor:
        """One block [R, H] at ``positions`` [R] seeing all of ``ctx`` ([1, Hkv, S, D] per layer, S ≥ 0):
        ``forward`` with B = N = 1, through scaled_dot_product_attention, with the layers' products
        fused (``fused``: [Wq; Wk; Wv] and [Wgate; Wup], 4 products a layer instead of 7). Returns [R, H]."""
        nq, nkv, d, eps = self.shape
        fused = fused or self.fused()
        r = x.shape[0]
        cos, sin = self.rope(x, positions[None])  # [1, R, D]
        cos, ssin = cos[:, None], signed_sin(sin)[:, None]
        x = x[None]  # [1, R, H]
        for layer, (k_ctx, v_ctx), qkv_w, gu_w in zip(self.layers, ctx, fused.qkv, fused.gate_up):
            y = rms_norm(x, layer.input_layernorm.weight, eps)
            qkv = linear(y, qkv_w).view(1, r, nq + 2 * nkv, d).transpose(1, 2)  # [1, Hq + 2Hkv, R, D]
            qk = rotate(qkv[:, : nq + nkv], cos, ssin)  # [1, Hq + Hkv, R, D] queries and keys, rotated at once
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv :]
            k, v = torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2)  # [1, Hkv, S + R, D]
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=nq != nkv)  # [1, Hq, R, D]
            x = self._finish(layer, x, o.transpose(1, 2).reshape(1, r, nq * d), gu_w)
        return x[0]

    def _finish(
        self, layer: nn.Module, x: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The layer's residual, o_proj and SwiGLU MLP: x [.., H], attention output o [.., Hq·D];
        ``gate_up``: the layer's [Wgate; Wup] (``Fused``), one product for both."""
        h = x + linear(o, layer.self_attn.o_proj.weight)
        y = rms_norm(h, layer.post_attention_layernorm.weight, self.shape[3])
        m = layer.mlp
        if gate_up is None:
            gate, up = linear(y, m.gate_proj.weight), linear(y, m.up_proj.weight)
        else:
            gate, up = linear(y, gate_up).chunk(2, -1)
        return h + linear(F.silu(gate) * up, m.down_proj.weight)

    def logits(self, out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] from outputs [.., H]; ``weight`` [Vd, H] = the target's output
        rows of ``draft_ids``."""
        return linear(rms_norm(out, self.norm.weight, self.shape[3]), weight, bias)

    # ------------------------------------------------------------------ files
    def save(self, out: str | Path, extra: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> None:
        """Write ``model.safetensors`` then ``config.json``, each atomically (``dtype``: the floats' type)."""
        out = Path(out)
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg.pop("_attn_implementation_autoset", None)
        spec = asdict(self.spec)
        spec["target_layers"] = list(self.spec.target_layers)
        cfg.update(architectures=[ARCHITECTURE], block=spec, treespec=extra or {})
        state = {}
        for key, value in self.state_dict().items():
            if not key.startswith("rotary."):
                value = value.detach()
                state[key] = (
                    value.to(dtype) if dtype is not None and value.is_floating_point() else value
                ).contiguous()
        save_safetensors_atomic({k: v.cpu() for k, v in state.items()}, out / "model.safetensors")
        write_text_atomic(out / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_block_head(name: str, hidden: int, vocab: int, target_name: str) -> tuple[BlockHead, dict[str, Any]]:
    """A block drafter by local directory or hub id; one line when it is not one or does not fit the
    target (``hidden``: the target's hidden size, ``vocab``: its vocabulary)."""
    raw, folder = read_config(name, "block drafter")
    spec_raw = raw.get("block")
    if not isinstance(spec_raw, dict):
        raise ConfigError(
            f"block drafter {name!r}: its config.json has no 'block' section, so it is not a block drafter "
            "(EAGLE heads load with --drafter eagle/eagle3); make one with `treespec train block`"
        )
    try:
        spec = BlockSpec(**{**spec_raw, "target_layers": tuple(spec_raw["target_layers"])})
    except (TypeError, KeyError) as exc:
        raise ModelLoadError(f"block drafter {name!r}: its config.json 'block' section is malformed ({exc})") from None
    if spec.target_hidden_size != hidden or spec.target_vocab_size != vocab:
        raise ConfigError(
            f"block drafter {name!r} was trained for a target of hidden size {spec.target_hidden_size} and "
            f"{spec.target_vocab_size} tokens, but {target_name} has {hidden} and {vocab}: use one trained for this "
            "target (`treespec train block --target ...`)"
        )
    if spec.block_size < 1:
        raise ModelLoadError(f"block drafter {name!r}: block_size {spec.block_size} must be ≥ 1")
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("block", "treespec")})
    head = BlockHead(config, spec)
    state = read_weights(folder, name, "block drafter")
    fit_weights(head, state, f"block drafter {name!r}", "the block drafter's layout")
    ids = head.draft_ids
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ModelLoadError(f"block drafter {name!r}: draft_ids lie outside the target's {vocab} tokens")
    return head.eval(), raw.get("treespec", {})
