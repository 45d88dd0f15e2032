"""The plugin hooks of treespec. Plugins are found through the ``treespec`` entry-point group.

A plugin is a module named by an entry point in that group::

    [project.entry-points.treespec]
    my-plugin = "my_package.treespec_plugin"

whose hook implementations are module-level functions decorated with ``treespec.hookimpl``. The two
listing hooks are called once, when plugins are first needed; each implementation returns a list of
``PluginSpec`` records and all the lists are concatenated (no first-result rule). The naming hook
``treespec_drafter_name`` is called per lookup and follows the first-result rule. Hook modules should stay light
(no torch import): put the implementation in another module and name it as ``"module:Class"``.
"""

from __future__ import annotations

from typing import Any

import pluggy

from treespec.interfaces import PluginSpec

hookspec = pluggy.HookspecMarker("treespec")
hookimpl = pluggy.HookimplMarker("treespec")


@hookspec
def treespec_builders() -> list[PluginSpec]:
    """Return the tree builders this plugin provides.

    Each record's ``load`` resolves to a ``treespec.TreeBuilder`` subclass whose ``Config`` is
    ``record.config``. Called once per process, on first use of the registry. A name that another
    plugin already registered is an error naming both plugins.
    """


@hookspec
def treespec_drafters() -> list[PluginSpec]:
    """Return the drafters this plugin provides.

    Each record's ``load`` resolves to a ``treespec.Drafter`` subclass whose ``Config`` is
    ``record.config``; ``aliases`` are extra names for the same drafter. Called once per process, on
    first use of the registry. A name or alias that another plugin already registered is an error
    naming both plugins.
    """


@hookspec(firstresult=True)
def treespec_drafter_name(name: str) -> tuple[str, dict[str, Any]] | None:
    """Read a ``--drafter`` value that is no registered drafter name or alias.

    Return ``(drafter name, implied options)`` or None when ``name`` means nothing to this plugin.
    Called by ``treespec.factory.resolve_drafter_name`` each time such a value is looked up;
    first-result rule: third-party plugins are asked before the built-ins (later registrations
    first), and the first answer that is not None wins. The implied options are merged into the
    user's options; a user option that contradicts one of them is an error. The built-ins read
    ``a+b`` as drafter ``compose`` with ``parts=[a, b]`` and a model alias, hub id or directory as
    drafter ``model`` with ``model=<that>``.
    """


def reference() -> str:
    """The hook reference in Markdown, generated from this module (``docs/hooks.md``)."""
    import inspect
    import sys

    module = sys.modules[__name__]
    parts = [
        "# treespec hooks",
        "",
        "Generated from `treespec/hookspecs.py`: `python -c 'import treespec.hookspecs as h; print(h.reference(), end=\"\")' > docs/hooks.md`.",
        "",
    ]
    parts += [inspect.cleandoc(module.__doc__ or ""), ""]
    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if name.startswith("treespec_"):
            parts += [f"## `{name}{inspect.signature(fn)}`", "", inspect.cleandoc(fn.__doc__ or ""), ""]
    return "\n".join(parts).rstrip() + "\n"
