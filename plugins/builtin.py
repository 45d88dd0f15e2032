"""Hook implementations for the built-in builders and drafters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treespec.hookspecs import hookimpl
from treespec.interfaces import PluginSpec
from treespec.plugins.configs import (
    BlockConfig,
    ChainConfig,
    ComposeConfig,
    DatastoreConfig,
    Eagle2Config,
    Eagle3Config,
    EagleConfig,
    ModelDrafterConfig,
    NgramConfig,
    OptTreeConfig,
    SelfDrafterConfig,
    SequoiaConfig,
    StaticConfig,
)


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
        PluginSpec(
            name="static",
            summary="a fixed tree shape: EAGLE's and Medusa's published trees, chains, k-ary trees, or your own paths",
            config=StaticConfig,
            load="treespec.plugins.static:StaticBuilder",
        ),
        PluginSpec(
            name="sequoia",
            summary="Sequoia: the optimal static tree for a measured per-rank acceptance vector (dynamic programming)",
            config=SequoiaConfig,
            load="treespec.plugins.sequoia:SequoiaBuilder",
        ),
        PluginSpec(
            name="eagle2",
            summary="EAGLE-2's dynamic tree: expand the top-k frontier by p̂ for `depth` steps, keep the best total_tokens",
            config=Eagle2Config,
            load="treespec.plugins.eagle2:Eagle2Builder",
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
        PluginSpec(
            name="ngram",
            summary="prompt lookup: the tokens that followed earlier occurrences of a node's last n-gram (longest n first)",
            config=NgramConfig,
            load="treespec.plugins.ngram:NgramDrafter",
        ),
        PluginSpec(
            name="datastore",
            summary="retrieval (REST): the tokens that followed a node's longest context suffix in a corpus's suffix array",
            config=DatastoreConfig,
            load="treespec.plugins.datastore:DatastoreDrafter",
        ),
        PluginSpec(
            name="self",
            summary="the target's own first k decoder layers plus its norm and head, sharing its weights, own KV cache",
            config=SelfDrafterConfig,
            load="treespec.plugins.self_drafter:SelfDrafter",
        ),
        PluginSpec(
            name="compose",
            summary="several drafters as one, their candidate trees merged by token: --drafter model+ngram "
            "(a part's options: -D ngram.max_ngram=4)",
            config=ComposeConfig,
            load="treespec.plugins.compose:ComposedDrafter",
        ),
        PluginSpec(
            name="eagle",
            summary="an EAGLE-1/2 head: one decoder layer drafting from the target's features, reusing its embeddings and head",
            config=EagleConfig,
            load="treespec.plugins.eagle:EagleDrafter",
        ),
        PluginSpec(
            name="eagle3",
            summary="an EAGLE-3 head: one decoder layer drafting over its own vocabulary from three of the target's layers",
            config=Eagle3Config,
            load="treespec.plugins.eagle3:Eagle3Drafter",
        ),
        PluginSpec(
            name="block",
            summary="a block drafter: one forward over the target's features proposes every depth of the tree "
            "(DFlash-style marginals; DDTree's trees with --builder opt-tree)",
            config=BlockConfig,
            load="treespec.plugins.block:BlockDrafter",
        ),
    ]


@hookimpl
def treespec_drafter_name(name: str) -> tuple[str, dict[str, Any]] | None:
    """``a+b`` is drafter ``compose`` with ``parts=[a, b]``; a model (alias, hub id, directory) is
    drafter ``model`` with ``model=<that>``."""
    from treespec.models import looks_like_model

    if "+" in name and not Path(name).expanduser().exists():
        return "compose", {"parts": name.split("+")}
    if looks_like_model(name):
        return "model", {"model": name}
    return None
