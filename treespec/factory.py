"""From names and options to builder and drafter instances (the registry replaces if/elif dispatch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treespec.config import build_config
from treespec.errors import ConfigError, PluginError
from treespec.interfaces import Drafter, TreeBuilder
from treespec.models import MODEL_ALIASES, looks_like_model
from treespec.registry import Entry, load_plugins

COMPOSE = "compose"  # the drafter that ``--drafter a+b`` names


def _plugin_class(entry: Entry, base: type) -> type:
    """The implementation class of a registered plugin; import problems name the plugin."""
    try:
        cls = entry.spec.resolve()
    except Exception as exc:
        raise PluginError(
            f"{entry.kind} {entry.spec.name!r} from {entry.origin}: cannot import {entry.spec.load!r} "
            f"({type(exc).__name__}: {exc}); reinstall the plugin or block it with TREESPEC_BLOCK_PLUGINS={entry.source}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(f"{entry.kind} {entry.spec.name!r} from {entry.origin}: {cls!r} is not a {base.__name__}")
    return cls


def resolve_drafter_name(name: str, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``--drafter`` takes a drafter name, or a model (alias, hub id, local directory), which means
    drafter ``model`` with ``model=<that>``."""
    reg = load_plugins()
    options = dict(options or {})
    if reg.find("drafter", name) is not None:
        return name, options
    if "+" in name and not Path(name).expanduser().exists():  # a+b: drafter compose with parts=[a, b]
        if "parts" in options:
            raise ConfigError(f"--drafter {name!r} names its parts; drop option parts={options['parts']!r}")
        return COMPOSE, {**options, "parts": name.split("+")}
    if looks_like_model(name):
        if "model" in options and options["model"] != name:
            raise ConfigError(f"--drafter {name!r} is a model, but option model={options['model']!r} names another")
        options["model"] = name
        return "model", options
    reg.get("drafter", name, extra_choices=list(MODEL_ALIASES))  # raises with "did you mean"
    raise AssertionError("unreachable")


def make_builder(builder: str | TreeBuilder, options: dict[str, Any] | None = None) -> TreeBuilder:
    if isinstance(builder, TreeBuilder):
        if options:
            raise ConfigError("builder options go into the builder instance's Config, not builder_options")
        return builder
    entry = load_plugins().get("builder", builder)
    cls = _plugin_class(entry, TreeBuilder)
    return cls(build_config(entry.spec.config, options, f"builder {builder!r}"))


def make_drafter(drafter: str | Drafter, options: dict[str, Any] | None, target: Any) -> Drafter:
    if isinstance(drafter, Drafter):
        if options:
            raise ConfigError("drafter options go into the drafter instance's Config, not drafter_options")
        return drafter
    name, options = resolve_drafter_name(drafter, options)
    if name == COMPOSE:
        return make_composed(options, target, drafter)
    return _make_named(name, options, target, f"drafter {name!r}")


def _make_named(name: str, options: dict[str, Any], target: Any, owner: str) -> Drafter:
    entry = load_plugins().get("drafter", name)
    cls = _plugin_class(entry, Drafter)
    return cls(build_config(entry.spec.config, options, owner), target)


def make_composed(options: dict[str, Any], target: Any, label: str = COMPOSE) -> Drafter:
    """Drafter ``compose`` (``--drafter a+b``): each part is built by name with the options routed to
    it (``PART.option``, PART being the part's drafter name or its 1-based position, or in Python
    ``{PART: {option: value}}``); the other options are ``ComposeConfig``'s."""
    from treespec.plugins.compose import ComposedDrafter
    from treespec.plugins.configs import ComposeConfig

    own: dict[str, Any] = {}
    routed: dict[str, dict[str, Any]] = {}
    for key, value in options.items():
        head, dot, rest = key.partition(".")
        if dot:
            routed.setdefault(head, {})[rest] = value
        elif isinstance(value, dict):
            routed.setdefault(key, {}).update(value)
        else:
            own[key] = value
    unknown = [key for key in own if key not in ComposeConfig.model_fields]  # reported once parts are known
    config = build_config(ComposeConfig, {k: v for k, v in own.items() if k not in unknown}, f"drafter {label!r}")
    raw = config.parts  # type: ignore[attr-defined]
    if len(raw) < 2:
        raise ConfigError(
            f"drafter {label!r} needs two or more parts; write e.g. --drafter model+ngram or -D parts=model,ngram"
        )
    names = [resolve_drafter_name(part, None)[0] for part in raw]  # unknown names: "did you mean"
    if COMPOSE in names:
        raise ConfigError(f"drafter {label!r}: a part cannot be {COMPOSE!r}; list all parts in one a+b+c")
    listing = ", ".join(f"{i}={n}" for i, n in enumerate(names, 1))
    if unknown:
        raise ConfigError(
            f"drafter {label!r}: {unknown[0]!r} is not an option of the composition (parts, merge, weights); "
            f"for a part write PART.{unknown[0]}=VALUE, PART being a part's name or position ({listing})"
        )
    part_options: list[dict[str, Any]] = [{} for _ in raw]
    for sel, opts in routed.items():
        by_position = sel.isdigit() and 1 <= int(sel) <= len(raw)
        hits = [int(sel) - 1] if by_position else [i for i, n in enumerate(names) if n == sel]
        if not hits:
            raise ConfigError(
                f"drafter {label!r}: option prefix {sel!r} names no part; "
                f"prefix a part's option with its name or position ({listing})"
            )
        if len(hits) > 1:
            raise ConfigError(
                f"drafter {label!r}: {len(hits)} parts are named {sel!r}; address them by position ({listing})"
            )
        part_options[hits[0]].update(opts)
    parts = []
    for i, (part, opts) in enumerate(zip(raw, part_options), 1):
        name, opts = resolve_drafter_name(part, opts)
        if name == "model" and "model" not in opts:
            raise ConfigError(
                f"drafter {label!r}: part {i} 'model' needs a draft model; write the model in its place "
                "(e.g. llama-68m+ngram) or add the option model.model=PATH"
            )
        parts.append(_make_named(name, opts, target, f"drafter {name!r} (part {i} of {label!r})"))
    return ComposedDrafter(parts, config, target)  # type: ignore[arg-type]
