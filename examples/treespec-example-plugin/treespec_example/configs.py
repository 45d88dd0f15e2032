"""Options of the example plugins. No torch import: ``treespec plugins`` reads these classes."""

from __future__ import annotations

from pydantic import Field

import treespec


class BigramConfig(treespec.PluginConfig):  # extra="forbid" and frozen, inherited
    min_count: int = Field(1, ge=1, description="propose a follower only if it was seen at least this often")


class BestFirstConfig(treespec.PluginConfig):
    nodes: int = Field(16, gt=0, description="drafted nodes per tree (root excluded)")
    branch: int = Field(2, gt=0, description="children asked of the drafter per expanded node")
    max_depth: int = Field(8, gt=0, description="deepest layer of the tree")
