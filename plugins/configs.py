"""Options of the built-in plugins. Kept free of torch so that `treespec plugins` stays light."""

from __future__ import annotations

from pydantic import Field

from treespec.config import PluginConfig


class OptTreeConfig(PluginConfig):
    nodes: int = Field(50, gt=0, description="node budget n: drafted nodes per tree (root excluded)")
    threshold: float = Field(0.5, ge=0.0, description="δ: keep adding layers while E(A) grows by more than this")
    max_depth: int = Field(10, gt=0, description="deepest layer of the tree")


class ChainConfig(PluginConfig):
    k: int = Field(4, gt=0, description="drafted tokens per step")


class ModelDrafterConfig(PluginConfig):
    model: str = Field(description="alias (llama-68m, ...), hub id or local directory of the draft model")
    layers: int | None = Field(None, gt=0, description="keep only the model's first k decoder layers")
    attn_implementation: str | None = Field(None, description="eager | sdpa | ... (default: the model's)")
    trust_remote_code: bool = Field(False, description="allow the model's own code from the hub")


class StaticConfig(PluginConfig):
    shape: str = Field(
        "eagle-mc_sim_7b_63",
        description="a preset (`treespec tree presets`: eagle-mc_sim_7b_63 (25 nodes), eagle-25, "
        "medusa-mc_sim_7b_63 (63 nodes), chain-K, kary-K-D), a JSON list of paths of child ranks, or a JSON file",
    )


class SequoiaConfig(PluginConfig):
    nodes: int = Field(50, gt=0, description="node budget n: drafted nodes per tree (root excluded)")
    max_depth: int = Field(10, gt=0, description="deepest layer of the tree")
    acceptance: str | list[float] = Field(
        description="per-rank acceptance vector: a JSON file made by `treespec sequoia-measure` (or a list in Python)"
    )


class Eagle2Config(PluginConfig):
    top_k: int = Field(10, gt=0, description="frontier nodes expanded per step, and children proposed per node")
    depth: int = Field(6, gt=0, description="expansion steps (the tree's maximum depth)")
    total_tokens: int = Field(60, gt=0, description="drafted nodes kept after reranking by p̂ (root excluded)")


class NgramConfig(PluginConfig):
    max_ngram: int = Field(3, gt=0, description="longest n-gram looked up (the longest one that matches wins)")
    min_ngram: int = Field(1, gt=0, description="shortest n-gram looked up (at most max_ngram)")
    max_matches: int = Field(8, gt=0, description="at most this many candidate continuations per node")


class SelfDrafterConfig(PluginConfig):
    layers: int = Field(
        2, gt=0, description="draft with the target's own first k decoder layers (fewer than the target has)"
    )
