"""Drafter ``compose``: one drafter made of several (``--drafter model+ngram``, ``treespec.compose(a, b)``).

Every part is asked for up to k children of each requested node; the parts' candidates are merged
per node by token. The same token from two parts becomes ONE child, and since a node below is named
by its path, merging children per node is exactly merging the parts' candidate trees by shared
prefixes. The merged q of a token:

    merge="max"   max_i q_i(t)                       the most confident part decides
    merge="mix"   Σ_i ŵ_i q_i(t),  ŵ_i = w_i / Σ_{j active} w_j
                  over the parts "active" at that node (that proposed anything there), so a silent
                  part (an n-gram lookup without a match) does not deflate the others' q.
                  Parts answer with their k best only: a token outside a part's k best gets
                  nothing from it, so mixed q depend on k (max's top k do not, ties aside)

With merge="max" each part's q is first mapped to how often the target took that part's proposals
(``plugins/part_calibration.py``; ``calibrate=false`` merges the raw q): an n-gram lookup's q = 1
after one match and a head's q = 1 mean different things.

The k best merged children come back best first (ties: the token that an earlier part proposed
first, at its earlier rank there). The builder then ranks everything by p̂ under its one node
budget: composing needs no builder change. Every part sees the same tree, including nodes that only
another part proposed; ``prefill`` and ``commit`` go to every part.

Flags, per instance: ``needs_target_hidden`` if any part needs the target's hidden states;
``provides_probabilities`` only for ``mix`` (a sub-distribution) of parts that all provide
probabilities (the max over parts is not a distribution).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from treespec.config import build_config
from treespec.errors import ConfigError
from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals
from treespec.plugins.configs import ComposeConfig
from treespec.plugins.part_calibration import PartCalibration, exclusive
from treespec.tree import DraftTree


def merge_proposals(
    props: Sequence[Proposals], k: int, merge: str = "max", weights: Sequence[float] | None = None
) -> Proposals:
    """Merge the parts' proposals for the same M nodes into the k best children per node (in numpy: a
    step merges a few dozen numbers three times, where each torch call costs more than its arithmetic)."""
    m = int(props[0].tokens.shape[0])
    if m == 0 or k <= 0:
        return Proposals(torch.zeros(m, max(k, 0), dtype=torch.long), torch.zeros(m, max(k, 0)))
    qs = [p.q.detach().cpu().double().numpy() for p in props]  # each [M, k_i]
    if merge == "mix":
        w = np.asarray(weights if weights is not None else [1.0] * len(props), dtype=np.float64)  # [P]
        active = np.stack([(q > 0).any(axis=1) for q in qs], axis=1)  # [M, P] parts that proposed anything
        wa = w[None, :] * active  # [M, P]
        wn = wa / np.maximum(wa.sum(axis=1, keepdims=True), 1e-300)  # [M, P] renormalised over active parts
        qs = [q * wn[:, i : i + 1] for i, q in enumerate(qs)]
    tok = np.concatenate([p.tokens.detach().cpu().long().numpy() for p in props], axis=1)  # [M, C], C = Σ k_i
    q = np.concatenate(qs, axis=1)  # [M, C]; columns: part by part, each in the part's own order
    row, col = np.nonzero(q > 0)  # [E] padding (q = 0) never becomes a child
    tok, q = tok[row, col], q[row, col]  # [E]
    out_tok, out_q = np.zeros((m, k), dtype=np.int64), np.zeros((m, k), dtype=np.float32)  # [M, k] padding
    if row.size:
        base = int(tok.max()) + 1
        uniq, inv = np.unique(row * base + tok, return_inverse=True)  # [U] one per (node, token)
        uq = np.full(uniq.size, -np.inf if merge != "mix" else 0.0)  # [U]
        (np.add if merge == "mix" else np.maximum).at(uq, inv, q)
        first = np.full(uniq.size, int(col.max()) + 1, dtype=np.int64)
        np.minimum.at(first, inv, col)  # [U] earliest column: part, then its rank
        urow, utok = uniq // base, uniq % base  # [U]
        order = np.lexsort((first, -uq, urow))  # [U] by node, then q desc, then first
        srow = urow[order]  # [U]
        count = np.bincount(srow, minlength=m)  # [M] merged children per node
        rank = np.arange(uniq.size) - (np.cumsum(count) - count)[srow]  # [U] position within its node
        keep = rank < k
        out_tok[srow[keep], rank[keep]] = utok[order][keep]
        out_q[srow[keep], rank[keep]] = uq[order][keep]
    return Proposals(tokens=torch.from_numpy(out_tok), q=torch.from_numpy(out_q))  # [M, k] each


class ComposedDrafter(Drafter):
    Config = ComposeConfig
    config: ComposeConfig

    def __init__(self, parts: Sequence[Drafter], config: ComposeConfig | None = None, target: Any = None):
        config = config if config is not None else ComposeConfig()
        parts = list(parts)
        if not all(isinstance(p, Drafter) for p in parts):
            raise ConfigError("ComposedDrafter takes Drafter instances; to compose by name use treespec.compose(...)")
        if len(parts) < 2:
            raise ConfigError(
                "compose needs two or more drafters; e.g. --drafter model+ngram or treespec.compose(a, b)"
            )
        if config.weights is not None and config.merge != "mix":
            raise ConfigError("compose: weights apply to merge=mix only; add merge=mix or drop weights")
        if config.calibrate and config.merge != "max":
            raise ConfigError("compose: calibrate applies to merge=max only; drop calibrate or use merge=max")
        if config.weights is not None and len(config.weights) != len(parts):
            raise ConfigError(
                f"compose: {len(config.weights)} weights for {len(parts)} parts; give one weight per part"
            )
        if target is None:
            target = next((p.target for p in parts if p.target is not None), None)
        super().__init__(config, target)
        self.parts = parts
        on = config.merge == "max" and config.calibrate is not False
        self.calibration = PartCalibration(len(parts)) if on else None  # plugins/part_calibration.py
        # per instance (the class attributes are the defaults the Decoder would otherwise read)
        self.needs_target_hidden = any(p.needs_target_hidden for p in parts)  # type: ignore[misc]
        wanted = {p.target_hidden_layers for p in parts if p.needs_target_hidden}
        if len(wanted) > 1:
            raise ConfigError(
                "compose: its parts need different hidden states of the target (e.g. eagle and eagle3); "
                "compose at most one kind of EAGLE head"
            )
        self.target_hidden_layers = next(iter(wanted), None)  # type: ignore[misc]
        self.provides_probabilities = (  # type: ignore[misc]
            config.merge == "mix" and all(p.provides_probabilities for p in parts)
        )

    def fork(self) -> ComposedDrafter:
        import copy

        twin = copy.copy(self)
        twin.parts = [part.fork() for part in self.parts]
        twin.calibration = self.calibration.fork() if self.calibration is not None else None
        return twin

    def prefill(self, context: PrefillContext) -> None:
        for part in self.parts:
            part.prefill(context)

    @classmethod
    def from_options(cls, options: dict[str, Any], target: Any, owner: str) -> ComposedDrafter:
        """``--drafter a+b`` (options ``parts=[a, b]``): each part is built by name with the options
        routed to it (``PART.option``, PART being the part's drafter name or its 1-based position, or
        in Python ``{PART: {option: value}}``); the other options are ``ComposeConfig``'s."""
        from treespec.factory import make_named, resolve_drafter_name  # the factory loads this class

        own, routed = _split_options(options)
        unknown = [key for key in own if key not in ComposeConfig.model_fields]  # reported once parts are known
        config = build_config(ComposeConfig, {k: v for k, v in own.items() if k not in unknown}, owner)
        raw = config.parts
        if len(raw) < 2:
            raise ConfigError(
                f"{owner} needs two or more parts; write e.g. --drafter model+ngram or -D parts=model,ngram"
            )
        names = [resolve_drafter_name(part, None)[0] for part in raw]  # unknown names: "did you mean"
        if COMPOSE in names:
            raise ConfigError(f"{owner}: a part cannot be {COMPOSE!r}; list all parts in one a+b+c")
        listing = ", ".join(f"{i}={n}" for i, n in enumerate(names, 1))
        if unknown:
            raise ConfigError(
                f"{owner}: {unknown[0]!r} is not an option of the composition ({', '.join(ComposeConfig.model_fields)}); "
                f"for a part write PART.{unknown[0]}=VALUE, PART being a part's name or position ({listing})"
            )
        label = owner.removeprefix("drafter ")
        parts = []
        for i, (part, opts) in enumerate(zip(raw, _route(routed, names, owner, listing)), 1):
            name, opts = resolve_drafter_name(part, opts)
            if name == "model" and "model" not in opts:
                raise ConfigError(
                    f"{owner}: part {i} 'model' needs a draft model; write the model in its place "
                    "(e.g. llama-68m+ngram) or add the option model.model=PATH"
                )
            parts.append(make_named(name, opts, target, f"drafter {name!r} (part {i} of {label})"))
        return cls(parts, config, target)

    def begin_step(self, root_token: int) -> None:
        if self.calibration is not None:
            self.calibration.begin_step()
        for part in self.parts:
            part.begin_step(root_token)

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        props = [part.expand(tree, nodes, k) for part in self.parts]  # each [M, ≤k]
        if self.calibration is None:
            return merge_proposals(props, k, self.config.merge, self.config.weights)  # [M, k]
        props = self.calibration.apply(tree, nodes, props)  # each part's q → its acceptance rate
        return exclusive(merge_proposals(props, k, self.config.merge))  # [M, k], Σ_j q ≤ 1 per node

    def commit(self, commit: Commit) -> None:
        if self.calibration is not None:
            self.calibration.learn(commit.tokens)
        for part in self.parts:
            part.commit(commit)

    def close(self) -> None:
        for part in self.parts:
            part.close()


COMPOSE = "compose"  # this drafter's registered name (plugins/builtin.py)


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The composition's own options, and the options of each part selector (``PART.option``)."""
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
    return own, routed


def _route(routed: dict[str, dict[str, Any]], names: list[str], owner: str, listing: str) -> list[dict[str, Any]]:
    """The options of each part, from selectors that are a part's name (unique) or 1-based position."""
    part_options: list[dict[str, Any]] = [{} for _ in names]
    for sel, opts in routed.items():
        by_position = sel.isdigit() and 1 <= int(sel) <= len(names)
        hits = [int(sel) - 1] if by_position else [i for i, n in enumerate(names) if n == sel]
        if not hits:
            raise ConfigError(
                f"{owner}: option prefix {sel!r} names no part; prefix a part's option with its name or position ({listing})"
            )
        if len(hits) > 1:
            raise ConfigError(f"{owner}: {len(hits)} parts are named {sel!r}; address them by position ({listing})")
        part_options[hits[0]].update(opts)
    return part_options


def compose(
    *parts: Drafter | str,
    merge: str = "max",
    weights: Sequence[float] | None = None,
    target: Any = None,
    calibrate: bool | None = None,
) -> ComposedDrafter:
    """One drafter made of ``parts``: Drafter instances, or names as ``--drafter`` takes them
    (``"ngram"``, ``"self"``, a model alias or directory) built with default options for ``target``
    (default: the target of the first instance given)."""
    from treespec.factory import make_drafter  # the factory imports this module: import on use

    target = target if target is not None else next((p.target for p in parts if isinstance(p, Drafter)), None)
    built = []
    for part in parts:
        if isinstance(part, str) and target is None:
            raise ConfigError(
                f"compose: building drafter {part!r} by name needs the target; pass target=... or Drafter instances"
            )
        built.append(part if isinstance(part, Drafter) else make_drafter(part, None, target))
    options = {"merge": merge, "weights": list(weights) if weights is not None else None, "calibrate": calibrate}
    config = build_config(ComposeConfig, options, "compose")
    return ComposedDrafter(built, config, target)  # type: ignore[arg-type]
