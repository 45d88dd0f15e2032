"""Drawing one draft tree: a rich terminal tree, Graphviz DOT, and a PNG through matplotlib."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from treespec.files import savefig_atomic
from treespec.tree import DraftTree
from treespec.verify import Acceptance


def token_text(tokenizer: Any) -> Callable[[int], str]:
    """How a token is shown: its vocabulary piece (``▁named``, ``Ġthe``, ``<0x0A>``) so spaces stay visible."""
    if tokenizer is None:
        return str
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return lambda t: str(tokenizer.convert_ids_to_tokens(int(t)))
    return lambda t: repr(tokenizer.decode([int(t)]))[1:-1]


def _token_text(show: Callable[[int], str], token: int) -> str:
    return show(token)


def rich_tree(tree: DraftTree, acc: Acceptance, decode: Callable[[int], str], max_nodes: int = 400) -> Any:
    """A ``rich.tree.Tree``: token text, q and p̂ per node; the accepted path in bold green, then the bonus."""
    from rich.text import Text
    from rich.tree import Tree

    g = tree.graph
    accepted = set(acc.nodes.tolist())
    last = int(acc.nodes[-1])

    def label(i: int) -> Text:
        d = g.nodes[i]
        style = "bold green" if i in accepted else ""
        t = Text(_token_text(decode, d["token"]), style=style or "white")
        if i:
            t.append(f"  q={d['q']:.3f} p̂={d['phat']:.3f}", style="dim" if i not in accepted else "green")
        return t

    root = Tree(Text("root ", style="bold") + label(0))
    shown = 1
    stack = [(0, root)]
    while stack:
        node, branch = stack.pop()
        children = sorted(g.successors(node), key=lambda c: -g.nodes[c]["phat"])
        subs = []
        for c in children:
            if shown >= max_nodes:
                branch.add(Text(f"… {len(children)} children not shown", style="dim"))
                break
            subs.append((c, branch.add(label(c))))
            shown += 1
        if node == last:
            branch.add(Text(f"+ bonus {_token_text(decode, acc.bonus)} (the target's own token)", style="bold magenta"))
        stack.extend(reversed(subs))
    return root


def to_dot(tree: DraftTree, acc: Acceptance, decode: Callable[[int], str]) -> str:
    """Graphviz DOT of the networkx graph; accepted nodes filled green, the bonus token dashed."""
    g = tree.graph
    accepted = set(acc.nodes.tolist())

    def esc(s: str) -> str:
        return s.replace("\\", "\\\\").replace('"', '\\"')

    lines = ["digraph draft_tree {", "  rankdir=LR;", '  node [shape=box, fontname="monospace"];']
    for i, d in g.nodes(data=True):
        text = esc(_token_text(decode, d["token"]))
        label = f"{text}" if i == 0 else f"{text}\\nq={d['q']:.3f} p̂={d['phat']:.3f}"
        style = ', style=filled, fillcolor="#b7e4b2"' if i in accepted else ""
        lines.append(f'  n{i} [label="{label}"{style}];')
    for a, b in g.edges():
        lines.append(f"  n{a} -> n{b};")
    last = int(acc.nodes[-1])
    lines.append(f'  bonus [label="{esc(_token_text(decode, acc.bonus))}\\n(bonus)", style=dashed];')
    lines.append(f"  n{last} -> bonus [style=dashed];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_png(tree: DraftTree, acc: Acceptance, decode: Callable[[int], str], path: Path) -> None:
    """A left-to-right drawing with matplotlib (leaves spread vertically, one column per depth)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency, but be clear if it is missing
        from treespec.errors import TreespecError

        raise TreespecError("--png needs matplotlib: pip install matplotlib (or use --dot and Graphviz)") from None
    g = tree.graph
    accepted = set(acc.nodes.tolist())
    y, leaves = _rows(g)
    fig, ax = plt.subplots(figsize=(2.2 * (tree.depth + 2), max(3, 0.32 * leaves + 1)))
    for a, b in g.edges():
        color = "#2e8b57" if a in accepted and b in accepted else "#bbbbbb"
        ax.plot(
            [g.nodes[a]["depth"], g.nodes[b]["depth"]], [y[a], y[b]], color=color, lw=1.5 if color != "#bbbbbb" else 0.8
        )
    for n, d in g.nodes(data=True):
        on = n in accepted
        text = _token_text(decode, d["token"]) + ("" if n == 0 else f"\n{d['phat']:.2f}")
        ax.text(
            d["depth"],
            y[n],
            text,
            ha="center",
            va="center",
            fontsize=7,
            family="monospace",
            bbox=dict(boxstyle="round", fc="#b7e4b2" if on else "white", ec="#2e8b57" if on else "#999999"),
        )
    _draw_bonus(ax, g, y, int(acc.nodes[-1]), _token_text(decode, acc.bonus))
    ax.set_xlim(-0.7, tree.depth + 1.7)
    ax.set_ylim(-1, leaves)
    ax.invert_yaxis()
    ax.axis("off")
    ax.set_title(
        f"{tree.size} drafted nodes · depth {tree.depth} · E(A) {tree.expected_accepted():.2f} · "
        f"accepted {acc.accepted} + bonus",
        fontsize=9,
    )
    fig.tight_layout()
    savefig_atomic(fig, path, "--png", format="png", dpi=120)
    plt.close(fig)


def _rows(g: Any) -> tuple[dict[int, float], int]:
    """Each node's vertical place (leaves one row apart, most probable first; a parent at its children's
    mean) and the number of leaves."""
    y: dict[int, float] = {}
    leaves = 0

    def place(n: int) -> float:
        nonlocal leaves
        kids = sorted(g.successors(n), key=lambda c: -g.nodes[c]["phat"])
        if not kids:
            y[n] = leaves
            leaves += 1
        else:
            y[n] = sum(place(c) for c in kids) / len(kids)
        return y[n]

    place(0)
    return y, leaves


def _draw_bonus(ax: Any, g: Any, y: dict[int, float], last: int, text: str) -> None:
    """The target's own token, dashed, after the last accepted node."""
    ax.plot([g.nodes[last]["depth"], g.nodes[last]["depth"] + 1], [y[last], y[last]], color="#9c36b5", ls="--", lw=1)
    ax.text(
        g.nodes[last]["depth"] + 1,
        y[last],
        text + "\n(bonus)",
        ha="center",
        va="center",
        fontsize=7,
        family="monospace",
        bbox=dict(boxstyle="round", fc="#f3d9fa", ec="#9c36b5", ls="--"),
    )
