"""Option syntax, in one place. Two syntaxes, on purpose, because they say different things:

* **Plugin options** (``-B``/``-D`` of ``run``, ``tree show``, ...; ``parse_pairs``): ``name=value``
  pairs, repeatable, and a comma separates PAIRS: ``-B nodes=25,threshold=0.3`` is two options. A
  comma followed by something that is not ``name=`` stays in the value, so ``-B shape=[[0],[1]]``
  works. An option given twice is an error (it would silently keep the last).
* **Benchmark specs** (``bench --builder/--drafter``; ``parse_spec``): ``"NAME key=v1,v2 key2=v"``,
  words separated by spaces, and a comma separates VALUES of one key: each combination is one
  configuration (``"opt-tree nodes=10,25"`` sweeps two budgets).

Names may use ``-`` for ``_`` in both. Values stay strings; each plugin's pydantic ``Config`` converts
them (``"25"`` -> 25).
"""

from __future__ import annotations

import itertools
import re
import shlex

from treespec.errors import ConfigError


def parse_pairs(pairs: list[str] | None, what: str) -> dict[str, str]:
    """``["nodes=25,threshold=0.5", "max-depth=4"]`` -> ``{"nodes": "25", "threshold": "0.5", "max_depth": "4"}``."""
    options: dict[str, str] = {}
    for pair in pairs or []:
        # a name may be routed to a composed drafter's part: ngram.max_ngram=4, 1.layers=3
        for item in re.split(r",(?=\s*\w[\w.-]*=)", pair):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"{what} option {item!r} is not name=value; write e.g. nodes=25")
            key = key.strip().replace("-", "_")
            if key in options and options[key] != value.strip():
                raise ConfigError(
                    f"{what} option {key!r} is given twice ({options[key]} and {value.strip()}): give it once"
                )
            options[key] = value.strip()
    return options


def parse_spec(text: str) -> list[tuple[str, dict[str, str]]]:
    """``"opt-tree nodes=10,25 threshold=0.5"`` -> ``[("opt-tree", {"nodes": "10", "threshold": "0.5"}),
    ("opt-tree", {"nodes": "25", "threshold": "0.5"})]``: every combination of the listed values."""
    try:
        parts = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f'{text!r}: {exc}; quote a spec as "NAME key=v1,v2"') from None
    if not parts:
        raise ConfigError("empty configuration spec; write e.g. 'opt-tree nodes=10,25,60'")
    name, sweeps = parts[0], {}
    for part in parts[1:]:
        key, sep, values = part.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"{text!r}: {part!r} is not key=value[,value...]")
        key = key.replace("-", "_")
        if key in sweeps:
            raise ConfigError(f"{text!r}: {key!r} is given twice; list its values once, e.g. {key}=1,2")
        sweeps[key] = values.split(",")
    keys = list(sweeps)
    return [(name, dict(zip(keys, combo))) for combo in itertools.product(*(sweeps[k] for k in keys))]
