"""A head and its target, read for export: what both engine writers start from.

``read_head`` reads any EAGLE-1 or EAGLE-3 head treespec loads (a folder, an alias such as
``smollm2-eagle``, a cached hub id) through the drafters' own readers (``plugins/eagle_head.py``,
``plugins/eagle3_head.py``): config.json as data, tensors from safetensors (or a weights-only
``pytorch_model.bin``), keys in the layout EAGLE's authors publish. ``read_target`` reads the target's
config.json only (no weights): layers, hidden size, vocabulary, architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treespec.errors import ConfigError, ModelLoadError
from treespec.files import read_json


@dataclass
class TargetInfo:
    name: str  # as given (alias, path, hub id)
    folder: str  # the local folder (GGUF names: the converted one) or the hub id
    layers: int
    hidden: int
    vocab: int
    architecture: str
    tie_embeddings: bool


@dataclass
class HeadFiles:
    name: str
    folder: Path
    version: int  # 1: EAGLE-1/2, 3: EAGLE-3
    config: dict[str, Any]  # config.json as read
    state: dict[
        str, torch.Tensor
    ]  # published keys (EAGLE-1: fc.*, layers.N.*; EAGLE-3: fc, midlayer.*, norm, lm_head, d2t, t2d)
    draft_vocab: torch.Tensor | None  # EAGLE-1: the ranked target ids of draft_vocab.safetensors
    layers: tuple[int, ...] | None  # EAGLE-3: feature layers as hidden_states indices (= vLLM's ids)

    @property
    def meta(self) -> dict[str, Any]:
        return self.config.get("treespec") or {}


def read_target(name: str) -> TargetInfo:
    """The target's config.json (local folder, GGUF alias, or a cached hub id); one line if missing."""
    from treespec.models import locate, snapshot_dir

    folder = locate(name, "target")
    path = (
        Path(folder) / "config.json"
        if Path(folder).is_dir()
        else snapshot_dir(folder, ["config.json"], "target") / "config.json"
    )
    raw = read_json(path, f"target {name!r}:", "pass a model folder", ModelLoadError)
    text = raw.get("text_config") or raw
    try:
        return TargetInfo(
            name=name,
            folder=str(folder),
            layers=int(text["num_hidden_layers"]),
            hidden=int(text["hidden_size"]),
            vocab=int(text["vocab_size"]),
            architecture=(raw.get("architectures") or ["?"])[0],
            tie_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"target {name!r}: {path} lacks {exc} (num_hidden_layers, hidden_size, vocab_size)"
        ) from None


def read_head(name: str, target: TargetInfo) -> HeadFiles:
    """An EAGLE-1 or EAGLE-3 head for ``target``, checked as the drafters check it (one line if not)."""
    from treespec.plugins import draft_vocab
    from treespec.plugins.eagle3_head import config_layers, default_layers, is_eagle3, load_head3
    from treespec.plugins.eagle_head import load_head, read_config, read_weights

    raw, folder = read_config(name)
    state = read_weights(folder, name)
    if is_eagle3(raw, state):
        head, raw = load_head3(name, target.hidden, target.vocab, f"target {target.name!r}")  # the checks
        layers = config_layers(raw) or default_layers(target.layers)
        out = {k: v.detach().clone() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
        return HeadFiles(name, folder, 3, raw, out, None, tuple(layers))
    head, _ = load_head(name, target.hidden, target.vocab, f"target {target.name!r}")
    out = {k: v.detach().clone() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    return HeadFiles(name, folder, 1, raw, out, draft_vocab.load(folder, target.vocab, name), None)


def llama_config(head: HeadFiles) -> dict[str, Any]:
    """The head's Llama fields, without treespec's own block and without keys engines read differently."""
    drop = {
        "treespec",
        "bias",
        "architectures",
        "eagle_config",
        "eagle_aux_hidden_state_layer_ids",
        "draft_vocab_size",
        "target_hidden_size",
        "_name_or_path",
        "id2label",
        "label2id",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "norm_before_residual",
        "speculators_model_type",
    }
    cfg = {k: v for k, v in head.config.items() if k not in drop}
    cfg["model_type"] = "llama"
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]  # transformers < 5 and the engines' configs read rope_theta
    return cfg


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` (None: kept), contiguous, on the CPU; integer maps kept."""
    return {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()
        for k, v in state.items()
    }


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "", "keep"):
        return None
    table = {
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float32": torch.float32,
        "fp32": torch.float32,
        "float64": torch.float64,
    }
    if name not in table:
        raise ConfigError(f"--dtype {name!r}: use one of keep, float16, bfloat16, float32, float64")
    return table[name]


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def prepare_out(out: Path, force: bool) -> None:
    """An empty (or new) output folder; a non-empty one only with ``force`` (then its files are replaced)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder to write the export into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} is not empty: give a new folder, or --force to replace its files")
    out.mkdir(parents=True, exist_ok=True)
