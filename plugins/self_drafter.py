"""Drafter `self`: the target's own first k decoder layers, plus its final norm and output head.

The draft model is a shallow view of the target: a copy of the target's top-level module (and of each
module on the way down to the decoder-layer list) whose submodules ARE the target's modules, with the
layer list cut to its first k entries and a config saying ``num_hidden_layers=k``. No weight is copied.
It keeps its own KV cache (k layers) and reuses ``ModelDrafter``'s tree-masked forwards and commit.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from treespec.errors import ConfigError
from treespec.plugins.configs import SelfDrafterConfig
from treespec.plugins.model_drafter import ModelDrafter

# where the decoder-layer list lives: (path of the module holding it, attribute name)
LAYER_PATHS = (
    ("model", "layers"),  # Llama, Mistral, Qwen2, Gemma, Phi-3, ...
    ("transformer", "h"),  # GPT-2, GPT-J, Bloom, ...
    ("model.decoder", "layers"),  # OPT
    ("gpt_neox", "layers"),  # GPT-NeoX, Pythia
)


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object with the same submodules, parameters and buffers, but its own registries:
    assigning a submodule (or a hook) on the copy leaves the original untouched."""
    new = copy.copy(module)
    for key, value in list(new.__dict__.items()):
        if isinstance(value, (dict, set)):  # _modules, _parameters, _buffers, hook tables, ...
            new.__dict__[key] = copy.copy(value)
    return new


def _layer_list(model: torch.nn.Module) -> tuple[str, str, torch.nn.ModuleList] | None:
    for path, attr in LAYER_PATHS:
        holder: Any = model
        for part in path.split("."):
            holder = getattr(holder, part, None)
        layers = getattr(holder, attr, None) if holder is not None else None
        if isinstance(layers, torch.nn.ModuleList):
            return path, attr, layers
    return None


def shallow_model(model: torch.nn.Module, k: int) -> torch.nn.Module:
    """The target's first ``k`` decoder layers behind its own embeddings, final norm and head, sharing
    every weight with ``model``."""
    found = _layer_list(model)
    if found is None:
        raise ConfigError(
            f"drafter 'self' does not know where {type(model).__name__} keeps its decoder layers "
            f"(supported: {', '.join(p + '.' + a for p, a in LAYER_PATHS)})"
        )
    path, attr, layers = found
    if k >= len(layers):
        raise ConfigError(f"drafter 'self': layers={k} must be fewer than the target's {len(layers)} decoder layers")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = k  # GPT-2 & co. map it to n_layer
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:k]
    top = _shallow_copy(model)
    top.config = config
    holder = top
    for part in path.split("."):  # copy each module on the way down, so the target's stay intact
        child = _shallow_copy(getattr(holder, part))
        if hasattr(child, "config"):
            child.config = config
        setattr(holder, part, child)
        holder = child
    setattr(holder, attr, torch.nn.ModuleList(list(layers)[:k]))
    for i, layer in enumerate(getattr(holder, attr)):  # each layer indexes its own cache slot
        for sub in layer.modules():
            idx = getattr(sub, "layer_idx", None)
            if idx is not None and idx != i:
                raise ConfigError(f"drafter 'self': decoder layer {i} has layer_idx {idx}; unsupported model")
    return top


class SelfDrafter(ModelDrafter):
    Config = SelfDrafterConfig
    config: SelfDrafterConfig

    def load_model(self) -> torch.nn.Module:
        """Nothing is loaded: the draft is a view of the target's first ``layers`` layers."""
        if getattr(self.target.model, "hf_device_map", None) and "disk" in self.target.model.hf_device_map.values():
            raise ConfigError(
                "drafter 'self' shares the target's own layers, which a device map offloaded to disk: "
                "use a draft model or an EAGLE head with an offloaded target"
            )
        return shallow_model(self.target.model, self.config.layers)
