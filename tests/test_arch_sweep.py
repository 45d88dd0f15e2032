"""The architecture sweep (issue 29): every causal-LM architecture this transformers ships, as a tiny
random model, through treespec against its own greedy ``generate`` — lossless, or refused in one line.

Each architecture's default config is shrunk the same way (``SHRINK``: every size field it has); an
architecture whose shrunk model cannot be built, is still large, or whose own ``generate`` fails is
not a treespec case and is skipped with the reason. ``KNOWN`` lists the architectures where treespec
fails today (xfail, strict: fixing one turns its test red until it leaves the list), each with what
goes wrong. The test ids are the architecture names: ``pytest tests/test_arch_sweep.py -v`` lists them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import treespec
from treespec.errors import ConfigError, DecodingError

VOCAB, PROMPT, NEW = 96, 7, 20
MAX_PARAMETERS = 3_000_000  # a default config this shrink leaves larger is not a tiny model
SHRINK = dict(vocab_size=VOCAB, hidden_size=32, n_embd=32, d_model=32, num_hidden_layers=2, n_layer=2, num_layers=2,
              n_layers=2, num_attention_heads=4, n_head=4, n_heads=4, num_key_value_heads=2, intermediate_size=64,
              n_inner=64, ffn_dim=64, d_ff=64, head_dim=8, max_position_embeddings=256, n_positions=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, decoder_start_token_id=1,
              # mixtures of experts
              num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              n_shared_experts=1, shared_expert_intermediate_size=32, first_k_dense_replace=1, moe_topk=2,
              # latent attention (DeepSeek-style)
              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
              # encoder-decoder families used as decoders (BartForCausalLM, ...)
              encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4,
              decoder_attention_heads=4,
              # partial rotary (GPT-J, CodeGen), vision/audio towers of multimodal configs left alone
              rotary_dim=8)  # fmt: skip
#: architectures treespec gets wrong today, and how (strict xfail: each fix must remove its line)
KNOWN: dict[str, str] = {}
ARCHS = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_model(name: str):
    """The architecture's default config, shrunk; its model in float32; None and why when it is not a
    tiny model this sweep can test."""
    cfg = CONFIG_MAPPING[name]()
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key, value in SHRINK.items():
        if hasattr(text, key):
            try:
                setattr(text, key, value)
            except Exception:  # noqa: BLE001 - a read-only or validated field keeps its default
                pass
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    size = sum(p.numel() for p in meta.parameters())
    if size > MAX_PARAMETERS:
        return None, f"{size / 1e6:.0f}M parameters after shrinking"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval(), ""


@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=pytest.mark.xfail(reason=KNOWN[a], strict=True)) if a in KNOWN else a for a in ARCHS]
)
def test_architecture_is_lossless_or_refused_in_one_line(arch):
    warnings.filterwarnings("ignore")
    try:
        model, why = tiny_model(arch)
    except Exception as exc:  # noqa: BLE001 - the architecture's own config or model code
        pytest.skip(f"not built here: {type(exc).__name__}: {str(exc)[:80]}")
    if model is None:
        pytest.skip(why)
    gc = model.generation_config  # what treespec compares with is decoding itself: no forced tokens or penalties
    model.generation_config = GenerationConfig(bos_token_id=gc.bos_token_id, eos_token_id=gc.eos_token_id,
                                               pad_token_id=gc.pad_token_id)  # fmt: skip
    ids = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    try:
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                                 max_new_tokens=NEW, do_sample=False)[0, PROMPT:].tolist()  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the model's own generate: not a treespec case
        pytest.skip(f"its own generate fails: {type(exc).__name__}: {str(exc)[:80]}")
    try:
        target = treespec.TargetModel(model)
        treespec.Decoder(target, drafter=model, builder="chain")
    except ConfigError as exc:  # refused at load, target or draft: one line naming the architecture
        assert "\n" not in str(exc) and "cannot" in str(exc), str(exc)
        return
    for builder, options in (("opt-tree", {"nodes": 8}), ("chain", {"k": 3})):
        # the model drafts for itself (a loaded draft model): its drafts are right, so trees run deep
        dec = treespec.Decoder(target, drafter=model, builder=builder, builder_options=options)
        try:
            out = dec.generate(ids, max_new_tokens=NEW)
        except DecodingError as exc:
            pytest.fail(f"accepted at load, failed while decoding: {exc}")
        assert out.token_ids == ref, f"{arch} {builder}: differs from generate"
