"""Builder `static`: the same tree shape every step (EAGLE-1's and Medusa's published trees, chains,
k-ary trees, or your own).

A shape is a list of *paths of child ranks* from the root: ``[0]`` is the root's best child, ``[0, 1]``
the second-best child of that node, and so on (the format of EAGLE's ``choices.py`` and Medusa's
``medusa_choices.py``). The published presets are data, kept in ``shapes.json`` with their sources.

Per step the tree grows one layer at a time: ONE ``drafter.expand`` call per depth over every node of
that depth with children in the shape (k = 1 + the largest rank wanted at that depth), then the
children at the wanted ranks are added. A proposal with q = 0 (padding) is skipped, and so is its
whole subtree. The index tensors that map shape nodes to rows and columns of the proposals are built
once, in ``__init__``; ``build`` does no per-node Python work.
"""

from __future__ import annotations

import difflib
import itertools
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

from treespec.errors import ConfigError
from treespec.interfaces import Drafter, TreeBuilder
from treespec.plugins.configs import StaticConfig
from treespec.sampling import DraftSampling, propose
from treespec.tree import DraftTree

#: kary-K-D and file shapes larger than this are refused (a typo like kary-10-10 would hang)
MAX_SHAPE_NODES = 65536

_CHAIN = re.compile(r"chain-(\d+)")
_KARY = re.compile(r"kary-(\d+)-(\d+)")
_FORMS = "chain-K, kary-K-D, a JSON list of paths like [[0],[1],[0,0]], or a JSON file holding one"


# ---------------------------------------------------------------------------------------- presets
@lru_cache(maxsize=1)
def _presets() -> dict[str, dict]:
    text = resources.files("treespec.plugins").joinpath("shapes.json").read_text(encoding="utf-8")
    return json.loads(text)["presets"]


def preset_names() -> list[str]:
    """Names of the published tree shapes in ``shapes.json``."""
    return sorted(_presets())


def preset_source(name: str) -> str:
    """Where a preset's paths were copied from."""
    return _presets()[name]["source"]


# ---------------------------------------------------------------------------------------- parsing
def load_shape(spec: str) -> list[list[int]]:
    """The paths of a shape spec (a preset name, ``chain-K``, ``kary-K-D``, a JSON list of paths, or a
    JSON file holding such a list or ``{"paths": [...]}``), validated and sorted by depth then path
    (parents before children). Any problem is a one-line ``ConfigError``."""
    spec = str(spec).strip()
    if spec in _presets():
        return _validate(_presets()[spec]["paths"], f"preset {spec!r}")
    if m := _CHAIN.fullmatch(spec):
        k = int(m.group(1))
        if k < 1:
            raise ConfigError(f"tree shape {spec!r}: chain-K needs K >= 1")
        if k > MAX_SHAPE_NODES:
            raise ConfigError(f"tree shape {spec!r} has {k} nodes, more than the limit {MAX_SHAPE_NODES}")
        return [[0] * d for d in range(1, k + 1)]
    if m := _KARY.fullmatch(spec):
        k, depth = int(m.group(1)), int(m.group(2))
        if k < 1 or depth < 1:
            raise ConfigError(f"tree shape {spec!r}: kary-K-D needs K >= 1 and D >= 1")
        n = k * depth if k == 1 else (k ** (depth + 1) - k) // (k - 1)
        if n > MAX_SHAPE_NODES:
            raise ConfigError(f"tree shape {spec!r} has {n} nodes, more than the limit {MAX_SHAPE_NODES}")
        return [list(p) for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    if spec.startswith(("[", "{")):
        return _validate(_parse_json(spec, "tree shape"), "tree shape")
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"tree shape file {spec}: cannot read it ({exc})") from None
        return _validate(_parse_json(text, f"tree shape file {spec}"), f"tree shape file {spec}")
    if spec.endswith(".json") or "/" in spec or "\\" in spec:
        raise ConfigError(f"tree shape file {spec} does not exist")
    if spec.startswith(("chain", "kary")):
        raise ConfigError(f"tree shape {spec!r} is malformed; write chain-K (e.g. chain-5) or kary-K-D (e.g. kary-2-3)")
    close = difflib.get_close_matches(spec, preset_names(), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"unknown tree shape {spec!r}; {hint}presets: {', '.join(preset_names())}; or {_FORMS}")


def _parse_json(text: str, what: str) -> object:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: malformed JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if isinstance(data, dict):
        if "paths" not in data:
            raise ConfigError(f'{what}: a JSON object must hold the list of paths under "paths"')
        data = data["paths"]
    return data


def _validate(paths: object, what: str) -> list[list[int]]:
    """Check a list of rank paths; returns a sorted copy (depth, then path)."""
    if not isinstance(paths, list):
        raise ConfigError(f"{what}: expected a list of paths like [[0],[1],[0,0]], got {type(paths).__name__}")
    if not paths:
        raise ConfigError(f"{what}: the shape has no paths; give at least [[0]]")
    if len(paths) > MAX_SHAPE_NODES:
        raise ConfigError(f"{what} has {len(paths)} nodes, more than the limit {MAX_SHAPE_NODES}")
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        if not isinstance(p, list) or not p or not all(isinstance(r, int) and not isinstance(r, bool) for r in p):
            raise ConfigError(f"{what}: path {json.dumps(p)} is not a non-empty list of integer ranks")
        if any(r < 0 for r in p):
            raise ConfigError(f"{what}: path {json.dumps(p)} has a negative rank")
        t = tuple(p)
        if t in seen:
            raise ConfigError(f"{what}: path {json.dumps(p)} appears twice")
        seen.add(t)
    for t in map(tuple, paths):
        if len(t) > 1 and t[:-1] not in seen:
            raise ConfigError(f"{what}: path {list(t)} has no parent path {list(t[:-1])}")
    return [list(t) for t in sorted(seen, key=lambda t: (len(t), t))]


# ---------------------------------------------------------------------------------------- builder
@dataclass(frozen=True)
class _Layer:
    """Shape nodes of one depth d ≥ 1, in shape order, and where to find each among the proposals."""

    expand: torch.Tensor  # [E] long: indices (into layer d-1) of the nodes expanded at this depth
    row: torch.Tensor  # [C] long: for each node of layer d, its parent's index into ``expand``
    rank: torch.Tensor  # [C] long: its child rank, the column of the proposals
    k: int  # 1 + max(rank): children asked per expanded node
    slot: torch.Tensor | None = None  # [C] long: its position among its siblings (the draw, when sampling)


def _slots(nodes: list[tuple[int, ...]]) -> list[int]:
    """Position of each node among its siblings, in the given (rank) order."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for p in nodes:
        out.append(seen.get(p[:-1], 0))
        seen[p[:-1]] = out[-1] + 1
    return out


def shape_layers(paths: list[list[int]]) -> list[_Layer]:
    """Index tensors per depth for sorted (by depth, then path), validated ``paths``."""
    by_depth: dict[int, list[tuple[int, ...]]] = {}
    for p in paths:
        by_depth.setdefault(len(p), []).append(tuple(p))
    if not by_depth:
        return []
    index = {(): 0}  # path -> index within its layer
    layers = []
    for d in range(1, max(by_depth) + 1):
        nodes = by_depth[d]
        parents = sorted({index[p[:-1]] for p in nodes})
        slot = {j: i for i, j in enumerate(parents)}
        layers.append(
            _Layer(
                expand=torch.tensor(parents, dtype=torch.long),
                row=torch.tensor([slot[index[p[:-1]]] for p in nodes], dtype=torch.long),
                rank=torch.tensor([p[-1] for p in nodes], dtype=torch.long),
                k=1 + max(p[-1] for p in nodes),
                slot=torch.tensor(_slots(nodes), dtype=torch.long),
            )
        )
        index.update({p: i for i, p in enumerate(nodes)})
    return layers


def grow(
    layers: list[_Layer], drafter: Drafter, root_token: int, max_depth: int, sampling: DraftSampling | None = None
) -> DraftTree:
    """Walk a shape: ONE ``drafter.expand`` per depth, the wanted ranks added, padding (q = 0) and its
    subtree skipped, never deeper than ``max_depth``. Shared by ``static`` and ``sequoia``.

    With ``sampling`` the children are drawn from the draft instead of ranked: a node with c children
    in the shape gets the first c draws (without replacement), its i-th child in shape order the i-th
    draw, so the children are always a prefix of the draws, as SpecInfer's rule requires."""
    tree = DraftTree(root_token)
    ids = torch.zeros(1, dtype=torch.long)  # [n_{d-1}] tree id of each shape node of the last layer, -1: absent
    for layer in layers[: max(0, max_depth)]:
        parent_ids = ids[layer.expand]  # [E]
        present = parent_ids >= 0  # [E] nodes cut by padding above have no children either
        if not bool(present.any()):
            break
        prop = propose(
            drafter, tree, parent_ids[present], layer.k, sampling
        )  # tokens, q: [E', k] (draw order if sampled)
        tokens, q_all = prop.tokens.to(ids.device), prop.q.to(ids.device)
        cols = q_all.shape[1]  # k, unless a drafter returns fewer columns (missing ranks: padding)
        if cols == 0:
            break
        pos = torch.cumsum(present.long(), 0) - 1  # [E] row of each expanded node in the proposals
        row = pos[layer.row].clamp(min=0)  # [C]
        rank = layer.rank if sampling is None else layer.slot  # [C]
        col = rank.clamp(max=cols - 1)  # [C]
        q = q_all[row, col]  # [C]
        keep = present[layer.row] & (rank < cols) & (q > 0)  # [C] padding: no node, no subtree
        ids = torch.full((layer.row.numel(),), -1, dtype=torch.long)
        ids[keep] = tree.add_children(parent_ids[layer.row][keep], tokens[row, col][keep], q[keep])
        if not bool(keep.any()):
            break
    return tree


class StaticBuilder(TreeBuilder):
    Config = StaticConfig
    config: StaticConfig

    def __init__(self, config: StaticConfig):
        super().__init__(config)
        self.paths = load_shape(config.shape)  # sorted: depth, then path
        self.layers = shape_layers(self.paths)

    @property
    def size(self) -> int:
        """Drafted nodes of the full shape (the root excluded)."""
        return len(self.paths)

    @property
    def max_nodes(self) -> int:
        return len(self.paths)

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        return grow(self.layers, drafter, root_token, max_depth, self.sampling)
