"""Hook implementations of the example plugin, named by the entry point
``[project.entry-points.treespec] example = "treespec_example.hooks"``.

This module is imported whenever plugins are listed, so it stays light: it imports no torch and
names the implementations as lazy ``"module:Class"`` strings.
"""

from __future__ import annotations

import treespec
from treespec import PluginSpec
from treespec_example.configs import BestFirstConfig, BigramConfig


@treespec.hookimpl
def treespec_drafters() -> list[PluginSpec]:
    return [
        PluginSpec(
            name="bigram",
            summary="retrieval: the most frequent followers of a node's token in the prompt and the output so far",
            config=BigramConfig,
            load="treespec_example.bigram:BigramDrafter",
        ),
    ]


@treespec.hookimpl
def treespec_builders() -> list[PluginSpec]:
    return [
        PluginSpec(
            name="best-first",
            summary="grow the tree one expansion at a time, always expanding the frontier node with the highest p̂",
            config=BestFirstConfig,
            load="treespec_example.best_first:BestFirstBuilder",
        ),
    ]
