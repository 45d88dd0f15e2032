"""From names and options to builder and drafter instances (the registry replaces if/elif dispatch)."""

from __future__ import annotations

from typing import Any

from treespec.catalog import MODEL_ALIASES
from treespec.config import build_config
from treespec.errors import ConfigError, PluginError
from treespec.inputs import is_loaded_model, model_name
from treespec.interfaces import Drafter, TreeBuilder
from treespec.registry import Entry, load_plugins


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
    """The drafter and options that ``--drafter NAME`` means: a registered drafter name or alias as
    it is; anything else as the plugins read it (hook ``treespec_drafter_name``: the built-ins read
    ``a+b`` as a composition and a model alias, hub id or directory as the ``model`` drafter), the
    options it implies merged into ``options``."""
    reg = load_plugins()
    options = dict(options or {})
    if reg.find("drafter", name) is not None:
        return name, options
    meaning = reg.interpret(name)
    if meaning is None:
        reg.get("drafter", name, extra_choices=list(MODEL_ALIASES))  # raises with "did you mean"
        raise AssertionError("unreachable")
    resolved, implied = meaning
    for key, value in implied.items():
        if key in options and options[key] != value:
            raise ConfigError(
                f"--drafter {name!r} means drafter {resolved!r} with {key}={value!r}, "
                f"but option {key}={options[key]!r} says otherwise; drop the option"
            )
    return resolved, {**options, **implied}


def make_builder(builder: str | TreeBuilder, options: dict[str, Any] | None = None) -> TreeBuilder:
    if isinstance(builder, TreeBuilder):
        if options:
            raise ConfigError("builder options go into the builder instance's Config, not builder_options")
        return builder
    entry = load_plugins().get("builder", builder)
    cls = _plugin_class(entry, TreeBuilder)
    return cls(build_config(entry.spec.config, options, f"builder {builder!r}"))


def make_drafter(drafter: str | Drafter | Any, options: dict[str, Any] | None, target: Any) -> Drafter:
    if isinstance(drafter, Drafter):
        if options:
            raise ConfigError("drafter options go into the drafter instance's Config, not drafter_options")
        return drafter
    if is_loaded_model(drafter):  # a draft model the user loaded: the `model` drafter around it
        return make_loaded_draft(drafter, options or {}, target)
    name, options = resolve_drafter_name(drafter, options)
    return make_named(name, options, target, f"drafter {drafter!r}")


def make_named(name: str, options: dict[str, Any], target: Any, owner: str) -> Drafter:
    """The registered drafter ``name`` built from raw ``options`` by its class's ``from_options``
    (by default: validate them against its Config, then ``cls(config, target)``); ``owner`` names
    it in error messages, e.g. ``"drafter 'model+ngram'"``."""
    entry = load_plugins().get("drafter", name)
    cls = _plugin_class(entry, Drafter)
    return cls.from_options(options, target, owner)


def make_loaded_draft(model: Any, options: dict[str, Any], target: Any) -> Drafter:
    """The registered ``model`` drafter around a draft model the user already loaded (``options``: the
    ``model`` drafter's, e.g. ``lean``); it drafts with the object as it is, on its device and dtype."""
    if "model" in options:
        raise ConfigError("the draft model was passed loaded: drop drafter_options['model']")
    entry = load_plugins().get("drafter", "model")
    cls = _plugin_class(entry, Drafter)
    owner = f"drafter {model_name(model)!r} (loaded)"
    return cls(build_config(entry.spec.config, {"model": model_name(model), **options}, owner), target, loaded=model)
