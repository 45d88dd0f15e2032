"""`treespec export sglang`: a treespec head in the layout SGLang loads, and the command that serves it.

Read from SGLang's source (``python/sglang/srt/`` of sgl-project/sglang):

EAGLE-3 (``--speculative-algorithm EAGLE3``): ``models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``)
  * config: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``
    (None: the lm_head is the target's), ``target_hidden_size`` (fc reads 3 × it), ``bias`` (fc's; absent
    = none), ``tie_word_embeddings`` (true would make lm_head the embedding: written false);
  * weights: ``fc.weight``, ``midlayer.*`` (mapped onto ``model.midlayer``), ``norm.weight``,
    ``lm_head.weight`` [Vd, H], ``d2t`` (offsets: ``hot_token_id = d2t + arange``), ``t2d`` (skipped);
    no embedding: the target's is shared;
  * feature layers: ``model_executor/model_runner.py`` reads
    ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` and ``models/llama.py``
    (``set_eagle3_layers_to_capture``) captures ``[id + 1 for id in ids]`` before layer id + 1: SGLang's
    id is the layer whose OUTPUT is taken = Hugging Face ``hidden_states[id + 1]``, so the export writes
    treespec's indices minus one (SpecForge writes the same convention).

EAGLE-1 (``--speculative-algorithm EAGLE``): ``models/llama_eagle.py`` (``LlamaForCausalLMEagle``)
  * fc is ``nn.Linear(2H, H)`` WITH a bias (written as zeros for a head without one, so nothing is left
    uninitialised); the attention takes biases when ``attention_bias`` or ``bias`` is true
    (``models/llama.py``), so ``bias`` (treespec's fc-bias flag) is written false;
  * layer 0 without ``input_layernorm``, no final norm, lm_head the target's;
  * a reduced draft vocabulary is SGLang's ``--speculative-token-map FILE``: a list of hot target ids
    that ``speculative/eagle_utils.py`` (``load_token_map``) reads with ``torch.load(weights_only=True)``;
    written as ``hot_token_map.pt`` (one int64 tensor). treespec itself reads the same ids from
    ``draft_vocab.safetensors``, also written.

Adaptive mode (``--speculative-adaptive --speculative-adaptive-config FILE``; read in SGLang 0.5.23's
``speculative/adaptive_spec_params.py``, ``_load_adaptive_config`` and ``AdaptiveSpeculativeParams``;
flags in ``arg_groups/fields/spec.py``): topk 1 and ``num_draft_tokens = steps + 1`` always; the JSON's
digit keys are the LOWER bounds of batch-size ranges (a batch of bs uses the largest key ≤ bs), each
``{"candidate_steps": [...]}`` (0 = no drafting); the controller moves between neighbouring candidates
by an EMA of accepted drafts. ``--speculative-num-steps`` must be one of the candidates.

Shapes: ``--speculative-num-steps`` levels of ``--speculative-eagle-topk`` children per frontier node,
``--speculative-num-draft-tokens`` verified (the root included); ``tree.sglang_shape`` picks them.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import torch

from treespec.export.heads import HeadFiles, TargetInfo, cast, llama_config, write_json

TOKEN_MAP = "hot_token_map.pt"
ADAPTIVE = "sglang-adaptive.json"


def eagle3_config(head: HeadFiles, target: TargetInfo) -> dict[str, Any]:
    cfg = llama_config(head)
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        vocab_size=target.vocab,
        tie_word_embeddings=False,
        draft_vocab_size=int(head.state["lm_head.weight"].shape[0]),
        target_hidden_size=int(head.state["fc.weight"].shape[1] // 3),
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in head.layers or ()],
            "use_aux_hidden_state": True,
        },
    )
    cfg["treespec"] = {
        **head.meta,
        "exported_for": "sglang",
        "layer_ids": "SGLang: the decoder layer whose output is taken (hidden_states index - 1)",
    }
    return cfg


def eagle1_config(head: HeadFiles) -> dict[str, Any]:
    cfg = llama_config(head)
    cfg.update(architectures=["LlamaForCausalLMEagle"], bias=False, attention_bias=bool(cfg.get("attention_bias")))
    cfg["treespec"] = {
        **head.meta,
        "exported_for": "sglang",
        "draft_vocab": f"{TOKEN_MAP} (--speculative-token-map)" if head.draft_vocab is not None else "full",
    }
    return cfg


def write(head: HeadFiles, target: TargetInfo, out: Path, dtype: torch.dtype | None = None) -> list[str]:
    """Write the head into ``out``; returns the files written."""
    from safetensors.torch import save_file

    files = ["config.json", "model.safetensors"]
    state = dict(head.state)
    if head.version == 3:
        if any(i < 1 for i in head.layers or ()):
            from treespec.errors import ConfigError

            raise ConfigError(
                f"EAGLE-3 head {head.name!r} reads hidden_states {list(head.layers or ())}: SGLang can only "
                "capture the output of a decoder layer (index ≥ 1); retrain with --layers of 1 or more"
            )
        if head.config.get("norm_before_residual"):
            from treespec.errors import ConfigError

            raise ConfigError(
                f"EAGLE-3 head {head.name!r} normalises before its residual (a speculators variant): "
                "SGLang's LlamaForCausalLMEagle3 takes the residual before hidden_norm; serve it with vLLM"
            )
        config = eagle3_config(head, target)
    else:
        if "fc.bias" not in state:
            state["fc.bias"] = torch.zeros(state["fc.weight"].shape[0], dtype=state["fc.weight"].dtype)
        config = eagle1_config(head)
        if head.draft_vocab is not None:
            from treespec.plugins import draft_vocab

            torch.save(head.draft_vocab.to(torch.long).clone(), out / TOKEN_MAP)
            draft_vocab.save(out, head.draft_vocab)
            files += [TOKEN_MAP, draft_vocab.FILE]
    write_json(out / "config.json", config)
    save_file(cast(state, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    return files


def adaptive_config(slots: dict[int, list[int]]) -> dict[str, Any]:
    """SGLang's adaptive JSON from {batch size: candidate chain lengths} (module docstring)."""
    return {str(b): {"candidate_steps": list(steps)} for b, steps in sorted(slots.items())}


def adaptive_start(slots: dict[int, list[int]]) -> int | None:
    """``--speculative-num-steps`` for adaptive mode: the smallest batch's longest candidate (steps move
    down by acceptance from there), or None when every slot is 0 only (the head never pays: no adaptive)."""
    for b in sorted(slots):
        if max(slots[b]) > 0:
            return max(slots[b])
    return None


def launch(
    target: TargetInfo,
    head_dir: Path,
    version: int,
    steps: int,
    topk: int,
    draft_tokens: int,
    token_map: bool,
    adaptive: Path | None = None,
) -> str:
    """The ``python -m sglang.launch_server`` command line serving ``target`` with the exported head
    (with ``adaptive``, SGLang's adaptive mode reading that file: topk 1, draft tokens = steps + 1)."""
    parts = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        target.folder,
        "--speculative-algorithm",
        "EAGLE3" if version == 3 else "EAGLE",
        "--speculative-draft-model-path",
        str(head_dir.resolve()),
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]
    if token_map:
        parts += ["--speculative-token-map", str((head_dir / TOKEN_MAP).resolve())]
    if adaptive is not None:
        parts += ["--speculative-adaptive", "--speculative-adaptive-config", str(adaptive.resolve())]
    return " ".join(shlex.quote(p) for p in parts)
