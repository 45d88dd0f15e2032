"""What one step costs on this machine, measured: the cost model cost-aware builders plan with.

    T(step) = T_draft + T_verify(n) + T_bookkeeping(n)
    T_draft = T_first + Σ over the step's later expand calls of T_expand(m)   (m = nodes expanded in one call)

``T_first`` is the step's first expansion (the root's children): it also carries the drafter's
catch-up on what was committed since it last drafted (an EAGLE head feeds the accepted tokens, a
draft model its pending ones), so it is a fixed cost of speculating at all, kept apart from T_expand.

Each term is a ``Curve``: seconds at a few sizes (a grid), linear between grid points, and linear
beyond the measured ones. A curve starts from a profile (``treespec profile`` measures the grid for a
target, drafter, device, dtype and thread count, and saves it as JSON) or empty, and is refined
online from every step the Decoder times: an observation moves its two neighbouring grid points
toward it (least-mean-squares on the interpolation weights, learning rate ``rate``), clipped to a
factor of 2 of the current prediction once the point has been seen a few times, so one slow step
(another process, a page fault) cannot wreck it. Memory is bounded: the grid never grows.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from treespec.errors import TreespecWarning
from treespec.isotonic import isotonic

#: verification sizes (drafted nodes, root excluded) a profile measures and a curve keeps
VERIFY_GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # every size to 4: T(n) can step there
#: expand sizes (nodes expanded in one call)
EXPAND_GRID = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Curve:
    """Seconds as a function of a size; ``counts[i]`` = observations that moved point ``i``."""

    xs: list[int]
    ys: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    rate: float = 0.2  # learning rate of the online refinement

    def __post_init__(self) -> None:
        if not self.ys:
            self.ys = [0.0] * len(self.xs)
        if not self.counts:
            self.counts = [0.0] * len(self.xs)
        self.seen = sum(c > 0 for c in self.counts)  # measured points (planners re-read a curve when it grows)

    @property
    def known(self) -> bool:
        """Whether any point has been measured."""
        return any(c > 0 for c in self.counts)

    def _at(self, x: np.ndarray) -> np.ndarray:
        """Seconds at sizes ``x``: interpolated between measured points, extrapolated linearly beyond
        them (flat if only one is measured), never negative; 0.0 if nothing is measured yet."""
        seen = [i for i, c in enumerate(self.counts) if c > 0]
        if len(seen) < 2:
            return np.full(x.shape, self.ys[seen[0]] if seen else 0.0)
        xs = np.array([self.xs[i] for i in seen], dtype=float)
        # seconds never fall as the size grows: a few noisy points must not make a larger size look cheaper
        ys = np.array(isotonic([self.ys[i] for i in seen], [self.counts[i] for i in seen]), dtype=float)
        out = np.interp(x, xs, ys)
        lo, hi = x < xs[0], x > xs[-1]  # np.interp is flat outside: extrapolate the edge segments
        out[lo] = ys[0] + (ys[1] - ys[0]) * (x[lo] - xs[0]) / (xs[1] - xs[0])
        out[hi] = ys[-2] + (ys[-1] - ys[-2]) * (x[hi] - xs[-2]) / (xs[-1] - xs[-2])
        return np.maximum(out, 0.0)

    def predict(self, x: float) -> float:
        """Seconds at size ``x`` (see ``_at``)."""
        return float(self._at(np.array([x], dtype=float))[0])

    def table(self, n: int) -> list[float]:
        """``[predict(0), predict(1), ..., predict(n)]`` in one pass (what a planner reads per step)."""
        return self._at(np.arange(n + 1, dtype=float)).tolist()

    def observe(self, x: float, seconds: float) -> None:
        """Refine the curve with one measurement of ``seconds`` at size ``x``."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        x = min(max(x, self.xs[0]), self.xs[-1])
        if len(self.xs) == 1:  # a single point (e.g. the step's first expansion)
            weights = ((0, 1.0),)
        else:
            j = min(max(bisect.bisect_right(self.xs, x), 1), len(self.xs) - 1)
            w1 = (x - self.xs[j - 1]) / (self.xs[j] - self.xs[j - 1])  # interpolation weights of points j-1, j
            weights = ((j - 1, 1.0 - w1), (j, w1))
        for i, w in weights:
            if w <= 0:
                continue
            if self.counts[i] == 0:  # first sight: take it as is
                self.ys[i], self.counts[i] = seconds, w
                self.seen += 1
                continue
            here = self.ys[i]
            target = min(max(seconds, here / 2), here * 2) if self.counts[i] >= 3 else seconds  # robust
            self.ys[i] += self.rate * w * (target - here)
            self.counts[i] += w


class BadProfile(ValueError):
    """A file that is not a valid cost profile; the message says what is wrong, in one line."""


@dataclass
class CostModel:
    """The three curves of a step (see the module docstring) and what they were measured for."""

    verify: Curve = field(default_factory=lambda: Curve(list(VERIFY_GRID)))
    bookkeeping: Curve = field(default_factory=lambda: Curve(list(VERIFY_GRID)))
    expand: Curve = field(default_factory=lambda: Curve(list(EXPAND_GRID)))
    first: Curve = field(default_factory=lambda: Curve([1]))  # the step's first expansion (one node: the root)
    key: dict[str, Any] = field(default_factory=dict)  # target, drafter, device, dtype, threads, versions

    def step_seconds(self, n: int, draft_seconds: float) -> float:
        """A step that drafted for ``draft_seconds`` and verifies ``n`` drafted nodes."""
        return draft_seconds + self.verify.predict(n) + self.bookkeeping.predict(n)

    def plain_seconds(self) -> float:
        """A step without speculation: the root alone (plain decoding's one token)."""
        return self.step_seconds(0, 0.0)

    def to_json(self) -> str:
        return json.dumps({"format": "treespec-cost-model/1", **asdict(self)}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """The cost model saved by ``to_json``; ``BadProfile`` naming what is wrong for anything else:
        not JSON, not an object, another format, or a curve that is not a curve (``_curve``)."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise BadProfile(f"a JSON {type(raw).__name__}, not a treespec cost model (an object)")
        if raw.get("format") != "treespec-cost-model/1":
            raise BadProfile(f"not a treespec cost model (format {raw.get('format')!r})")
        key = raw.get("key", {})
        if not isinstance(key, dict):
            raise BadProfile(f"'key' is a {type(key).__name__}, not an object")
        curves = {name: _curve(raw, name) for name in ("verify", "bookkeeping", "expand")}
        first = _curve(raw, "first") if "first" in raw else Curve([1])
        return cls(**curves, first=first, key=key)


def _curve(raw: dict[str, Any], name: str) -> Curve:
    """``raw[name]`` as a Curve, checked: sizes strictly increasing whole numbers >= 0, and as many
    seconds and counts as sizes, each finite and >= 0 (a NaN or a negative time would plan nonsense,
    a length mismatch fail mid-run)."""
    spec = raw.get(name)
    if not isinstance(spec, dict):
        raise BadProfile(f"curve {name!r} is {'missing' if spec is None else 'not an object'}")
    if set(spec) - {"xs", "ys", "counts", "rate"} or "xs" not in spec:
        raise BadProfile(f"curve {name!r} needs xs, ys, counts (and rate), got {sorted(spec)}")
    xs, ys, counts = spec["xs"], spec.get("ys", []), spec.get("counts", [])
    rate = spec.get("rate", 0.2)

    def numbers(values: Any, what: str) -> list[float]:
        if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise BadProfile(f"curve {name!r}: {what} is not a list of numbers")
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise BadProfile(f"curve {name!r}: {what} holds a negative or non-finite value")
        return values

    numbers(xs, "xs")
    if not xs or any(x != int(x) for x in xs) or any(b <= a for a, b in itertools.pairwise(xs)):
        raise BadProfile(f"curve {name!r}: sizes xs {xs} are not whole numbers in increasing order")
    for values, what in ((ys, "ys"), (counts, "counts")):
        numbers(values, what)
        if values and len(values) != len(xs):
            raise BadProfile(f"curve {name!r}: {len(values)} {what} for {len(xs)} sizes")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
        raise BadProfile(f"curve {name!r}: rate {rate!r} is not in (0, 1]")
    return Curve(
        xs=[int(x) for x in xs], ys=[float(y) for y in ys], counts=[float(c) for c in counts], rate=float(rate)
    )


class ProfileWarning(TreespecWarning):
    """A saved profile could not be used: it is ignored, and the costs are measured again."""


def read_profile(path: Path) -> CostModel:
    """The cost profile in ``path`` (``-B profile=FILE``); ``BadProfile`` with one line saying what is
    wrong with it (missing, a folder or a pipe, not a cost model, a bad curve)."""
    if not path.exists():
        raise BadProfile("no such file")
    if not path.is_file():
        raise BadProfile("is a directory" if path.is_dir() else "is not a regular file (a pipe or a device?)")
    try:
        return CostModel.from_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadProfile(f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise BadProfile("is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise BadProfile(f"is not JSON ({exc})") from None
    except BadProfile:
        raise
    except ValueError as exc:
        raise BadProfile(str(exc).splitlines()[0] if str(exc) else "not a cost model") from None


def profile_dir() -> Path:
    """Where profiles are saved and found: ``$TREESPEC_PROFILE_DIR``, else ``$XDG_CACHE_HOME/treespec/profiles``."""
    if os.environ.get("TREESPEC_PROFILE_DIR"):
        return Path(os.environ["TREESPEC_PROFILE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "treespec" / "profiles"


def profile_path(key: dict[str, Any]) -> Path:
    """The file of the profile measured for ``key`` (a readable stem plus a hash of the whole key)."""
    import hashlib

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    stem = "-".join(str(key.get(k, "")).replace("/", "_")[-24:] for k in ("target", "drafter")).strip("-")
    return profile_dir() / f"{stem or 'profile'}-{digest}.json"


def user_profile(path: str) -> CostModel:
    """The profile given as ``-B profile=FILE``, or one ``ConfigError`` naming the file and the fix."""
    from treespec.errors import ConfigError

    try:
        return read_profile(Path(path))
    except ValueError as exc:
        raise ConfigError(
            f"opt-tree: profile {path}: {exc}; give a file written by `treespec profile --out FILE`, or leave "
            "profile out (the saved profile, or a quick measurement)"
        ) from None


def load_profile(key: dict[str, Any]) -> CostModel | None:
    """The saved profile for ``key``, or None: none saved, or one that is not a valid profile (then one
    ``ProfileWarning`` names it, and the caller measures the costs again; a damaged cache must never
    make every run fail until someone deletes it by hand)."""
    path = profile_path(key)
    if not path.exists():
        return None
    try:
        model = read_profile(path)
    except ValueError as exc:
        import warnings

        warnings.warn(
            f"the saved cost profile {path} is not usable ({exc}): ignored, the costs are measured again "
            "(`treespec profile` saves a new one)",
            ProfileWarning,
            stacklevel=2,
        )
        return None
    return model if model.key == key else None
