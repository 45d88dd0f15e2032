"""Plugin discovery and lookup.

``load_plugins()`` is lazy and idempotent: the first lookup imports every module of the ``treespec``
entry-point group (built-ins included: they are entry points of the ``treespec`` distribution), asks
their hooks for ``PluginSpec`` records and indexes them by name.

Environment switches (read at load time):

- ``TREESPEC_LOAD_PLUGINS=a,b`` loads only the third-party entry points named a and b (empty: none);
- ``TREESPEC_BLOCK_PLUGINS=a,b`` skips the entry points named a and b.

Built-ins (entry points of the ``treespec`` distribution) always load.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from treespec import hookspecs
from treespec.errors import ConfigError, PluginError
from treespec.interfaces import PluginSpec

Kind = Literal["builder", "drafter"]
GROUP = "treespec"


@dataclass(frozen=True)
class Entry:
    """A registered plugin: its record and where it came from."""

    kind: Kind
    spec: PluginSpec
    source: str  # entry-point name
    package: str  # distribution name
    version: str

    @property
    def origin(self) -> str:
        return f"{self.package} {self.version} (entry point {self.source!r})"


@dataclass
class Registry:
    builders: dict[str, Entry] = field(default_factory=dict)
    drafters: dict[str, Entry] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # "kind:alias" -> name
    failures: list[tuple[str, str, str]] = field(default_factory=list)  # (entry point, package, error)
    skipped: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # names in the env switches that match no entry point
    conflicts: dict[str, list[Entry]] = field(default_factory=dict)  # "kind:name" -> every plugin claiming it
    hooks: pluggy.PluginManager = field(default_factory=lambda: _manager())  # every loaded plugin module

    def interpret(self, name: str) -> tuple[str, dict[str, Any]] | None:
        """What the plugins make of a drafter value that is no registered name (hook
        ``treespec_drafter_name``, first result wins)."""
        return self.hooks.hook.treespec_drafter_name(name=name)

    def _table(self, kind: Kind) -> dict[str, Entry]:
        return self.builders if kind == "builder" else self.drafters

    def add(self, entry: Entry) -> None:
        """Register ``entry``. A name (or alias) that another plugin registered already is recorded
        as a conflict, not raised: listing still works, and only using that name fails (``get``)."""
        claimed = False
        for name in (entry.spec.name, *entry.spec.aliases):
            other = self.find(entry.kind, name)
            if other is not None:
                owners = self.conflicts.setdefault(f"{entry.kind}:{name}", [other])
                owners.append(entry)
                claimed = claimed or name == entry.spec.name
        if not claimed:
            self._table(entry.kind)[entry.spec.name] = entry
        for alias in entry.spec.aliases:
            self.aliases.setdefault(f"{entry.kind}:{alias}", entry.spec.name)

    def conflict_message(self, kind: Kind, name: str) -> str | None:
        """Why ``name`` cannot be used (two plugins register it), or None."""
        owners = self.conflicts.get(f"{kind}:{name}")
        if not owners:
            return None
        first, *rest = owners
        by = " and by ".join(e.origin for e in rest)
        return (
            f"{kind} name {name!r} is registered twice: by {first.origin} and by {by}; "
            f"uninstall one of them or block one with TREESPEC_BLOCK_PLUGINS={rest[-1].source}"
        )

    def alias_names(self, kind: Kind) -> list[str]:
        return sorted(a.partition(":")[2] for a in self.aliases if a.startswith(f"{kind}:"))

    def names(self, kind: Kind) -> list[str]:
        return sorted(self._table(kind))

    def find(self, kind: Kind, name: str) -> Entry | None:
        return self._table(kind).get(self.aliases.get(f"{kind}:{name}", name))

    def get(self, kind: Kind, name: str, extra_choices: list[str] | None = None) -> Entry:
        conflict = self.conflict_message(kind, self.aliases.get(f"{kind}:{name}", name)) or self.conflict_message(
            kind, name
        )
        if conflict is not None:
            raise PluginError(conflict)
        entry = self.find(kind, name)
        if entry is not None:
            return entry
        choices = self.names(kind) + self.alias_names(kind) + (extra_choices or [])
        close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        if "=" in name and " " in name.strip():  # a bench-style spec "NAME key=v" given where a name goes
            flag = "-D" if kind == "drafter" else "-B"
            hint = f"options are not part of the name: pass --{kind} {name.split()[0]} {flag} key=value; "
        failed = f" ({len(self.failures)} plugin(s) failed to load: see `treespec plugins`)" if self.failures else ""
        raise ConfigError(f"unknown {kind} {name!r}; {hint}available: {', '.join(self.names(kind)) or 'none'}{failed}")


_lock = threading.Lock()
_registry: Registry | None = None


def _env_list(name: str) -> set[str] | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


def _is_builtin(ep: md.EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.metadata["Name"] == "treespec"


def _manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    return pm


def _collect(module: Any, ep_name: str, package: str, version: str) -> list[Entry]:
    """Ask one plugin module's hooks for its records."""
    pm = _manager()
    pm.register(module, name=ep_name)
    entries = []
    for kind, hook in (("builder", pm.hook.treespec_builders), ("drafter", pm.hook.treespec_drafters)):
        for specs in hook():
            for spec in specs or []:
                if not isinstance(spec, PluginSpec):
                    raise PluginError(f"hook returned {type(spec).__name__}, not PluginSpec")
                entries.append(Entry(kind, spec, ep_name, package, version))  # type: ignore[arg-type]
    return entries


def discover(entry_points: list[md.EntryPoint] | None = None) -> Registry:
    """Build a registry from entry points (default: the installed ``treespec`` group)."""
    reg = Registry()
    eps = list(entry_points if entry_points is not None else md.entry_points(group=GROUP))
    only, blocked = _env_list("TREESPEC_LOAD_PLUGINS"), _env_list("TREESPEC_BLOCK_PLUGINS") or set()
    reg.unmatched = sorted(((only or set()) | blocked) - {ep.name for ep in eps})
    seen: set[tuple[str, str]] = set()
    for ep in sorted(eps, key=lambda e: (not _is_builtin(e), e.name)):
        package = ep.dist.metadata["Name"] if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        if (ep.name, ep.value) in seen:  # one distribution seen twice on sys.path
            continue
        seen.add((ep.name, ep.value))
        if not _is_builtin(ep) and ((only is not None and ep.name not in only) or ep.name in blocked):
            reg.skipped.append(ep.name)
            continue
        try:  # a broken plugin (import or hook) is reported and must not take the others down
            module = ep.load()
            entries = _collect(module, ep.name, package, version)
        except Exception as exc:
            reg.failures.append((ep.name, package, f"{type(exc).__name__}: {exc}"))
            continue
        for entry in entries:
            reg.add(entry)  # a duplicate name is recorded: using it is an error naming both plugins
        if not reg.hooks.is_registered(module):
            reg.hooks.register(module, name=f"{package}:{ep.name}")
    return reg


def load_plugins() -> Registry:
    """The process-wide registry, discovered on first call."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                _registry = discover()
    return _registry


def reset() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin at run time)."""
    global _registry
    with _lock:
        _registry = None
