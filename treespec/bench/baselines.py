"""The Hugging Face baselines of ``treespec bench``: their names and settings (assisted generation,
prompt lookup), the defaults a run compares with, and the forward hook every baseline runs under.
"""

from __future__ import annotations

import math
from typing import Any

from treespec import threads
from treespec.errors import ConfigError
from treespec.factory import make_builder
from treespec.options import parse_spec

BASELINES = {"hf-greedy", "hf-assisted", "hf-lookup"}
ASSISTED_KEYS = {"num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"}
LOOKUP_DEFAULTS = {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}


def default_baselines(builders: list[str]) -> list[str]:
    """hf-assisted with transformers' defaults, hf-assisted drafting exactly k tokens for every chain k
    (the like-for-like comparison), and hf-lookup."""
    ks = sorted(
        {
            int(make_builder(name, opts).config.k)
            for spec in builders
            for name, opts in parse_spec(spec)
            if name == "chain"
        }
    )  # through the registry: chain's own default k
    fixed = [
        f"hf-assisted num_assistant_tokens={k} num_assistant_tokens_schedule=constant assistant_confidence_threshold=0"
        for k in ks
    ]
    return ["hf-assisted", *fixed, "hf-lookup"]


def assisted_for(row: dict[str, Any], assisted: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The assisted-generation row to compare a row with: same draft, and for a chain of k the one
    drafting exactly k tokens per step, if measured."""
    same = [a for a in assisted if a["drafter"] == row["drafter"]] or assisted
    if row["builder"] == "chain":
        k = row["options"].get("k")
        for a in same:
            o = a["options"]
            if (
                o.get("num_assistant_tokens") == k
                and o.get("num_assistant_tokens_schedule") == "constant"
                and not o.get("assistant_confidence_threshold")
            ):
                return a
    return same[0] if same else None


def assistant_settings(model: Any, options: dict[str, str]) -> dict[str, Any]:
    """The assistant's settings: the options given, else its generation_config, else transformers' defaults."""
    gc = model.generation_config
    defaults = {
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
    }
    if hasattr(gc, "_get_default_generation_params"):
        defaults.update({k: v for k, v in gc._get_default_generation_params().items() if k in defaults})
    value = {
        k: options.get(k, getattr(gc, k, None) if getattr(gc, k, None) is not None else defaults[k]) for k in defaults
    }
    try:
        threshold = float(value["assistant_confidence_threshold"])
    except ValueError:
        threshold = math.nan
    if not 0 <= threshold <= 1:  # also NaN
        raise ConfigError(
            f"hf-assisted: assistant_confidence_threshold must be a number in [0, 1], got "
            f"{value['assistant_confidence_threshold']!r}"
        )
    settings = {
        "num_assistant_tokens": whole("hf-assisted num_assistant_tokens", value["num_assistant_tokens"]),
        "num_assistant_tokens_schedule": str(value["num_assistant_tokens_schedule"]),
        "assistant_confidence_threshold": threshold,
    }
    if settings["num_assistant_tokens_schedule"] not in ("constant", "heuristic", "heuristic_transient"):
        raise ConfigError(
            "hf-assisted: num_assistant_tokens_schedule must be constant, heuristic or heuristic_transient"
        )
    return settings


def whole(what: str, value: Any) -> int:
    """A baseline's count setting: a whole number > 0 (``k=x`` was a ValueError traceback)."""
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number <= 0:
        raise ConfigError(f"{what} must be a whole number > 0, got {value!r}")
    return number


def count_and_follow(calls: list[int]) -> None:
    """A Hugging Face forward: count it, and let torch's threads follow the machine's load, as every
    treespec row's do at its step boundaries (treespec/threads.py): the same rule for every row."""
    calls[0] += 1
    threads.follow()
