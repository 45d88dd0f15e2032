"""Hook implementations for the built-in builders and drafters."""

from __future__ import annotations

from treespec.hookspecs import hookimpl
from treespec.interfaces import PluginSpec
from treespec.plugins.configs import ChainConfig, ModelDrafterConfig, OptTreeConfig


@hookimpl
def treespec_builders() -> list[PluginSpec]:
    return [
        PluginSpec(
            name="opt-tree",
            summary="OPT-Tree: per step, the tree maximising E(A) = Σ p̂ under a node budget (Wang et al. 2024)",
            config=OptTreeConfig,
            load="treespec.plugins.opt_tree:OptTreeBuilder",
        ),
        PluginSpec(
            name="chain",
            summary="classic speculative decoding: a single chain of k drafted tokens",
            config=ChainConfig,
            load="treespec.plugins.chain:ChainBuilder",
        ),
    ]


@hookimpl
def treespec_drafters() -> list[PluginSpec]:
    return [
        PluginSpec(
            name="model",
            summary="an independent Hugging Face causal LM sharing the target's tokenizer, with its own KV cache",
            config=ModelDrafterConfig,
            load="treespec.plugins.model_drafter:ModelDrafter",
        ),
    ]
