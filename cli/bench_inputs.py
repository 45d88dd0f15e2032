"""What ``treespec bench``'s options mean: the prompts (dataset, categories, turns, chat), the sampling
settings and rules, the baselines, and ``--config`` pairs; each malformed value is one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from treespec import defaults
from treespec.cli import fail
from treespec.errors import TreespecError


def parse_rules(value: str | None, sampling: dict[str, Any] | None) -> list[str] | None:
    """--sampling-rule a,b,...: every treespec configuration once per rule (same prompts, same seeds)."""
    if value is None:
        return None
    from treespec.sampling import RULES

    rules = [r.strip() for r in value.split(",") if r.strip()]
    unknown = [r for r in rules if r not in RULES]
    if not rules or unknown:
        fail(f"--sampling-rule {value!r}: rules are {', '.join(RULES)} (several: separated by commas)")
    if sampling is None:
        fail("--sampling-rule needs sampling: add --temperature T (T > 0); greedy decoding has no rule to choose")
    return list(dict.fromkeys(rules))


def parse_sampling(temperature: float, top_p: float, top_k: int) -> dict[str, Any] | None:
    from treespec.sampling import check_sampling

    try:
        params, notes = check_sampling(temperature, top_p, top_k)
    except TreespecError as exc:
        fail(str(exc))
    for note in notes:
        typer.secho(f"warning: {note}", fg=typer.colors.YELLOW, err=True)
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k} if params is not None else None


def load_items(
    dataset: str,
    data_dir: Path | None,
    limit: int | None,
    category: str | None,
    turns: int | None = None,
    chat: bool = False,
    per_category: int | None = None,
) -> list:
    from treespec.bench.datasets import as_chat, load_prompts

    try:
        items = load_prompts(dataset, data_dir, limit, category)
    except TreespecError as exc:
        fail(str(exc))
    if per_category is not None:
        kept: dict[str, list] = {}
        for item in items:
            kept.setdefault(item.category, [])
            if len(kept[item.category]) < per_category:
                kept[item.category].append(item)
        items = [i for group in kept.values() for i in group]
    if turns is not None:
        items = [replace(i, turns=i.turns[:turns]) for i in items]
    return [as_chat(i, dataset) for i in items] if chat else items


def baselines_for(baseline: list[str] | None, builder: list[str]) -> list[str]:
    if baseline == ["none"]:
        return []
    if baseline is not None:
        return baseline
    from treespec.bench.baselines import default_baselines

    try:
        return default_baselines(builder)
    except TreespecError as exc:
        fail(str(exc))


def parse_pairs(config: list[str] | None) -> list[tuple[str, str]]:
    """--config "BUILDER | DRAFTER" → (builder spec, drafter spec) pairs; one line for a malformed one."""
    pairs = []
    for c in config or []:
        parts = [p.strip() for p in c.split("|")]
        if len(parts) != 2 or not all(parts):
            fail(f'--config {c!r}: expected "BUILDER-SPEC | DRAFTER-SPEC", e.g. "opt-tree nodes=auto | eagle"')
        pairs.append((parts[0], parts[1]))
    return pairs


def rows_for(
    target: str | None,
    drafter: list[str] | None,
    builder: list[str] | None,
    config: list[str] | None,
    sampling: bool = False,
) -> tuple[str, list[str], list[str], list]:
    """(target, drafters, builders, --config pairs), the defaults filling in: the default pair's draft model
    and EAGLE head at their measured budgets; a target with a shipped head (SmolLM2) alone, its default
    drafter under the default builder, its head alone under it and the chains
    (``defaults.shipped_bench_pairs``; ``sampling``: temperature > 0); opt-tree and chain k=4 for a
    drafter given alone."""
    from treespec.catalog import SHIPPED_HEADS, shipped_for

    pairs = parse_pairs(config)
    if target is None:
        target = defaults.TARGET
        drafter = drafter or defaults.bench_drafters()
        builder = builder or defaults.bench_builders()
    elif not drafter and not pairs and shipped_for(target, SHIPPED_HEADS):
        if builder:  # the builders given, with the target's default drafter
            drafter = [defaults.drafter_for(target, sampling)]
        else:
            pairs = defaults.shipped_bench_pairs(target, sampling)
    if not drafter and not pairs:
        fail('no drafter: pass --drafter "MODEL-or-NAME [key=value ...]" or --config "BUILDER | DRAFTER"')
    drafter = drafter or []
    builder = builder or ([] if pairs and not drafter else ["opt-tree", "chain k=4"])
    return target, drafter, builder, pairs
