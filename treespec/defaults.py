"""The default pair's settings, in one place (``treespec run``/``tree show``/``bench`` with no model
arguments; docs/default-pair.md).

The pair is treespec's own, shipped in the package: the target ``treespec-py`` drafted by its EAGLE
head. ``opt-tree`` sizes every tree from the measured costs (``nodes=auto``, docs/cost-aware.md); the
fixed budgets below are those that were fastest for the pair on a 2-core CPU before that
(docs/benchmarks.md, "humaneval-default-pair"), kept for eagle2 and for comparisons.
"""

from __future__ import annotations

from treespec.models import DEFAULT_DRAFT, DEFAULT_TARGET

TARGET = DEFAULT_TARGET  # "treespec-py"
DRAFTER = "eagle"  # its EAGLE head
DRAFT_MODEL = DEFAULT_DRAFT  # "treespec-py-draft"
#: per builder, the options the default pair uses unless -B sets them
BUILDER_OPTIONS: dict[str, dict[str, str]] = {
    "opt-tree": {"nodes": "auto"},
    "eagle2": {"top_k": "4", "depth": "6", "total_tokens": "8"},
}
OPT_TREE_FIXED = 6  # the fastest fixed opt-tree budget for the pair (the comparison row of its benchmark)
CHAIN_K = 8  # the chain the default pair's benchmark compares with
PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'


def bench_drafters() -> list[str]:
    """The default pair's drafters in ``treespec bench``: its draft model and its EAGLE head."""
    return [DRAFT_MODEL, DRAFTER]


def bench_builders() -> list[str]:
    """The default pair's builders in ``treespec bench``, at their measured budgets."""
    return [f"opt-tree nodes=auto,{OPT_TREE_FIXED}", f"chain k={CHAIN_K}"]


def apply(target: str | None, drafter: str | None, builder: str | None = None,
          builder_options: dict[str, str] | None = None) -> tuple[str, str | None]:
    """No target given: the target a draft alias was made for (``--drafter llama-68m``: LLaMA-2,
    ``treespec.models.DRAFT_TARGETS``), else the default pair's target, with no drafter its default
    drafter, and for its builders the measured budget unless ``builder_options`` sets one (updated in place)."""
    from treespec.models import default_target_for

    if target is None and default_target_for(drafter) is not None:
        return default_target_for(drafter), drafter
    if target is None:
        target = TARGET
        drafter = drafter or DRAFTER
        if builder_options is not None:
            for key, value in BUILDER_OPTIONS.get(builder or "", {}).items():
                builder_options.setdefault(key, value)
    return target, drafter
