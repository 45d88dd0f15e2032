"""treespec: lossless speculative decoding with draft trees for Hugging Face causal LMs.

Importing ``treespec`` is light (no torch); the heavy names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from treespec.config import PluginConfig
from treespec.errors import ConfigError, DecodingError, Interrupted, ModelLoadError, PluginError, TreespecError
from treespec.hookspecs import hookimpl
from treespec.interfaces import (
    Commit,
    Drafter,
    DraftRows,
    Expansion,
    PlanningBuilder,
    PlanNote,
    PluginSpec,
    PrefillContext,
    Proposals,
    TreeBuilder,
)

__version__ = "0.1.0"

_LAZY = {
    "Decoder": "treespec.decoder",
    "Output": "treespec.decoder",
    "DraftTree": "treespec.tree",
    "TreeTensors": "treespec.tree",
    "TargetModel": "treespec.target",
    "RunStats": "treespec.stats",
    "StepStats": "treespec.stats",
    "greedy_verify": "treespec.verify",
    "sampling_verify": "treespec.verify",
    "SamplingParams": "treespec.sampling",
    "Acceptance": "treespec.verify",
    "load_plugins": "treespec.registry",
    "compose": "treespec.plugins.compose",
    "ComposedDrafter": "treespec.plugins.compose",
}

if TYPE_CHECKING:
    from treespec.decoder import Decoder, Output
    from treespec.plugins.compose import ComposedDrafter, compose
    from treespec.registry import load_plugins
    from treespec.sampling import SamplingParams
    from treespec.stats import RunStats, StepStats
    from treespec.target import TargetModel
    from treespec.tree import DraftTree, TreeTensors
    from treespec.verify import Acceptance, greedy_verify, sampling_verify


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'treespec' has no attribute {name!r}")


__all__ = [
    "Commit",
    "ConfigError",
    "DecodingError",
    "Drafter",
    "DraftRows",
    "Expansion",
    "Interrupted",
    "ModelLoadError",
    "PluginConfig",
    "PluginError",
    "PlanNote",
    "PlanningBuilder",
    "PluginSpec",
    "PrefillContext",
    "Proposals",
    "TreeBuilder",
    "TreespecError",
    "hookimpl",
    *_LAZY,
]
