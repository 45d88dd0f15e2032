"""Write a GGUF file the way llama.cpp's converter does, with the ``gguf`` package (llama.cpp's own
gguf-py): the fixture of the GGUF tests comes from the format's publisher, not from treespec.

``write_llama_gguf(folder, out, qtype)`` turns a Hugging Face Llama folder with a byte-level BPE
tokenizer into a GGUF file: llama.cpp's tensor names (``gguf.get_tensor_name_map``), its rotary
permutation of q/k (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``), the ``llama.*`` hyper-parameters
and a ``gpt2`` tokenizer (tokens, types, merges), matrices quantised to ``qtype`` (norms stay F32,
as llama.cpp keeps 1-D tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for rotary pairs (interleaved), from convert_hf_to_gguf.py."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(folder: Path, out: Path, qtype: str = "F32") -> Path:
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    state: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    arch = gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(folder.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}"))
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["id"] for a in tok.get("added_tokens", [])}
    tokens = [t for t, _ in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_add_bos_token(bool(json.loads((folder / "tokenizer_config.json").read_text()).get("add_bos_token", True)))
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        data = tensor.astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            data = _permute(data, cfg["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            data = _permute(data, cfg["num_key_value_heads"])
        name = names.get_name(hf_name.removeprefix("model."), try_suffixes=(".weight", ".bias"))
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
