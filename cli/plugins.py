"""`treespec plugins`: the installed builders and drafters, their package, version and options, and
any plugin that failed to load or registers a name another plugin has. Imports no torch."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from treespec.cli import fail
from treespec.errors import TreespecError

SWITCHES = "TREESPEC_LOAD_PLUGINS/TREESPEC_BLOCK_PLUGINS"


def plugins(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """List the builders and drafters that are installed, with their package, version and options."""
    from treespec.registry import load_plugins

    try:
        reg = load_plugins()
    except TreespecError as exc:
        fail(str(exc))
    rows = _rows(reg)
    failures = [{"entry_point": n, "package": p, "error": err} for n, p, err in reg.failures]
    conflicts = [reg.conflict_message(*key.split(":", 1)) for key in sorted(reg.conflicts)]
    if as_json:
        print(
            json.dumps(
                {
                    "plugins": rows,
                    "failed": failures,
                    "skipped": reg.skipped,
                    "unmatched": reg.unmatched,
                    "conflicts": conflicts,
                },
                default=str,
            )
        )
        return
    _print(rows, failures, conflicts, reg)


def _rows(reg: Any) -> list[dict[str, Any]]:
    from treespec.config import describe_options

    rows = []
    for kind, table in (("builder", reg.builders), ("drafter", reg.drafters)):
        for name in sorted(table):
            e = table[name]
            rows.append(
                {
                    "kind": kind,
                    "name": name,
                    "aliases": list(e.spec.aliases),
                    "summary": e.spec.summary,
                    "package": e.package,
                    "version": e.version,
                    "entry_point": e.source,
                    "options": describe_options(e.spec.config),
                }
            )
    return rows


def _print(rows: list[dict[str, Any]], failures: list[dict[str, str]], conflicts: list[str], reg: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="treespec plugins")
    for col in ("kind", "name", "package", "options", "summary"):
        table.add_column(col, overflow="fold")
    for r in rows:
        opts = ", ".join(
            f"{o['name']}" + (" (required)" if o["required"] else f"={o['default']}") for o in r["options"]
        )
        name = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
        table.add_row(r["kind"], name, f"{r['package']} {r['version']}", opts, r["summary"])
    console.print(table)
    for f in failures:
        console.print(f"[red]failed to load[/red] {f['entry_point']} ({f['package']}): {f['error']}")
    for message in conflicts:
        console.print(f"[red]conflict[/red] {message}", markup=True, highlight=False)
    if reg.unmatched:
        console.print(
            f"[yellow]no entry point is named[/yellow] {', '.join(reg.unmatched)} ({SWITCHES} take entry-point names)"
        )
    if reg.skipped:
        console.print(f"skipped by {SWITCHES}: {', '.join(reg.skipped)}")
