"""Linear layers over a few rows on a CPU: computed as W·Xᵀ where that is measured to be faster.

Why. A decode step multiplies every weight matrix by a handful of rows: one token (a plain step) or a
draft tree's nodes. torch computes ``F.linear(x, W) = X·Wᵀ`` (X: [R, I], W: [O, I]); for one row
that is a matrix-vector product, for a few rows a GEMM that BLAS libraries tune for many rows. On this
repository's 2-core CPU (AMD EPYC, MKL) SmolLM2-135M's whole forward behind 200 cached tokens took,
torch's product vs the same product computed as (W·Xᵀ)ᵀ (``python examples/row_matmul.py --target
smollm2``, interleaved, medians; docs/bench/smollm2-mtbench/NOTES.md):

    rows      1     2     3     4     8    16    32
    stock    56    93   114    80    77    98   140  ms
    W·Xᵀ     32    33    45    45    62    88   125  ms

with 2 threads; with 1 thread better at 1–4 rows, worse at 8–16. So the choice depends on the
machine, the thread count and the row count, and is measured, never assumed.

How. ``RowMatmul(model)`` finds the model's plain ``nn.Linear`` layers whose weights live on a CPU.
``verdict()`` times whole forwards of the model (no cache, arbitrary tokens) at R = 1, 2, 3, 4, 8, ...
64 rows with each product — torch's (``stock``), W·Xᵀ (``rows``), where torch has MKL's packed
product, float32 weights and the memory for a copy of them, the weights packed for R rows
(``packed``, ``treespec.packed_matmul``), and where a C compiler built it, the product compiled on
this machine (``native``, ``treespec.native_matmul``: a whole SmolLM2 forward of 4 rows 56.5 → 42.9 ms) —
interleaved, and keeps the fastest where its median is at
least 3% faster than stock's. A forward of r rows follows the verdict of the smallest size ≥ r (up to 16
rows; W·Xᵀ pads X to a power of two there, the packed product to that size), else of the largest
measured size ≤ r (up to 2·64 − 1 rows, the packed product excepted; above, stock). Each size kept
packed costs one more copy of the weights: at most ``packed_matmul.copies`` (3 by default).
Verdicts are per thread count, kept for the process and saved beside the cost profiles
(``treespec.cost.profile_dir``), keyed by the model's shape, dtype (fp32/fp64 only), threads, torch
and CPU. A measurement taken on a disturbed machine is neither used nor saved (``plausible``: no size
more than JUMP× slower than a larger one; measured again up to ATTEMPTS times, else torch's product
for the process), one taken while other processes kept BUSY cores or more busy (``threads.LoadMeter``:
a neighbour inflates every size evenly, which ``plausible`` cannot see) is used but not saved, and a
saved verdict whose timings fail that check is measured again: one busy minute must not decide for
every later run. ``applied()`` brackets one of treespec's own forwards: it
installs a forward on each such layer that reads the verdict from a context variable, so the switch
holds only inside that forward on that thread (the user's model is as it was outside it, and between
forwards nothing is installed).

Same arithmetic, another summation order: logits differ in the last bits, as they already do between
a one-row and a many-row forward; every decoding test compares tokens with the target's own
``generate``. ``TREESPEC_ROW_MATMUL=off`` keeps torch's own product everywhere, ``on`` uses W·Xᵀ at
every measured size without measuring, ``native`` the compiled product (``treespec.native_matmul``),
``auto`` (the default) measures; ``TREESPEC_PACKED_MB`` caps the
packed copies (0: none).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from treespec import native_matmul, packed_matmul, weight_blocks
from treespec.devices import cpu_name
from treespec.kv import max_positions
from treespec.threads import LoadMeter
from treespec.transposed_matmul import PAD_UP_TO, linear_rows

SIZES = (1, 2, 3, 4, 8, 16, 32, 64)  # rows measured; r rows follow the smallest size ≥ r up to PAD_UP_TO
#: the products: torch's, W·Xᵀ (``treespec.transposed_matmul``), MKL's packed one (``treespec.packed_matmul``), the one
#: compiled here (``treespec.native_matmul``)
CHOICES = ("stock", "rows", "packed", "native")
MARGIN = 0.97  # another product is kept only where its median is at most this fraction of stock's
REPEATS = 3  # timed forwards per size and variant (after one warm-up each)
#: a size whose fastest product and torch's are within this fraction of each other is a close call:
#: timed again (REPEATS more each, up to CLOSE_ROUNDS times) before the medians decide
CLOSE = 0.06
CLOSE_ROUNDS = 3
#: a forward of fewer rows measured this many times slower than one of more rows: the machine was
#: disturbed (BLAS oddities stay under 1.5×; a busy minute gave 535 ms at 8 rows against 23 at 32)
JUMP = 2.0
ATTEMPTS = 3  # measurements tried before giving up on a disturbed machine (then: stock, nothing saved)
#: other processes' mean load during a measurement (cores, ``treespec.threads.LoadMeter``) from which its
#: verdict is used by this process but not saved: timings inflated by a neighbour must not decide later runs
BUSY = 0.5
MODES = ("auto", "on", "native", "off")

#: the verdict of the forward running in this context: per size index, one of CHOICES (None: stock)
_VERDICT: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("treespec_rows", default=None)
#: the last verdict measured or loaded in this process, per thread count: what treespec's own draft code
#: follows (``linear``) outside a target's forward
_LATEST: dict[int, tuple[str, ...]] = {}


def mode() -> str:
    """``TREESPEC_ROW_MATMUL``: auto (measure, the default), on (W·Xᵀ), native (compiled here), or off."""
    value = os.environ.get("TREESPEC_ROW_MATMUL", "auto").strip().lower() or "auto"
    return value if value in MODES else "auto"


def plausible(ms: dict[str, list[float]]) -> bool:
    """Whether a measurement's medians (per variant, per size in SIZES, in ms; 0 = not measured) look
    like an undisturbed machine: no size more than JUMP times slower than a larger one."""
    for times in ms.values():
        seen = [t for t in times if t > 0]
        if any(seen[i] > JUMP * min(seen[i + 1 :]) for i in range(len(seen) - 1)):
            return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for treespec's own few-row code (drafts: ``treespec.lean``, EAGLE's output layer):
    W·Xᵀ where the verdict in force (this forward's, else the process's latest for this thread count)
    says it is faster, on a CPU."""
    return product(x)(x, weight, bias)


def product(x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The product ``linear`` computes inputs of x's row count with, on x's device: ``linear_rows`` or
    ``F.linear``. A forward whose products all read x's rows resolves it once (``treespec.lean``: ~230
    products a SmolLM2 forward, each paying the lookup otherwise)."""
    if x.device.type != "cpu":
        return F.linear
    return _dispatch(_VERDICT.get() or _LATEST.get(torch.get_num_threads()), x)


def _dispatch(verdict: tuple[str, ...] | None, x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The product ``verdict`` names for x's row count: W·Xᵀ, the packed product (at most its size's
    rows), else torch's own."""
    if verdict is not None and x.dim() >= 1 and x.shape[-1]:
        rows = x.numel() // x.shape[-1]
        i = _index(rows)
        if i >= 0:
            if verdict[i] == "rows":
                return linear_rows
            if verdict[i] == "packed" and rows <= SIZES[i]:
                return packed_matmul.product(SIZES[i])
            if verdict[i] == "native":
                return native_matmul.linear
    return F.linear


def choose(times: dict[str, float]) -> str:
    """The product a size uses, from its timings (any unit; only measured products): the fastest other
    than torch's where it takes at most MARGIN of torch's time, else ``stock``."""
    others = [name for name in times if name != "stock"]
    fastest = min(others, key=times.__getitem__, default="stock")
    return fastest if "stock" in times and others and times[fastest] <= MARGIN * times["stock"] else "stock"


def _index(rows: int) -> int:
    """The position in SIZES of the verdict a forward of ``rows`` rows follows: the smallest size ≥ rows
    (up to PAD_UP_TO rows), else the largest size ≤ rows; -1 above twice the last size (stock)."""
    if rows < 1 or rows > 2 * SIZES[-1] - 1:
        return -1
    if rows <= PAD_UP_TO:
        return bisect.bisect_left(SIZES, rows)
    return bisect.bisect_right(SIZES, rows) - 1


def _forward_of(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:  # this forward's verdict only: other threads get torch's
        return _dispatch(_VERDICT.get(), x)(x, module.weight, module.bias)

    return forward


class RowMatmul:
    """The few-row products of one model: which layers, the verdicts, and the switch around a forward."""

    def __init__(self, model: Any):
        self.model = model
        self.layers = [
            m
            for m in model.modules()
            if type(m) is torch.nn.Linear
            and m.weight.dim() == 2
            and m.weight.device.type == "cpu"
            and m.weight.dtype in (torch.float32, torch.float64)  # half precision: other kernels, larger rounding
            and "forward" not in vars(m)  # a forward of its own (accelerate's hooks): left alone
        ]
        self.forwards = [_forward_of(m) for m in self.layers]
        self.verdicts: dict[int, tuple[str, ...]] = {}  # threads → per size: one of CHOICES
        self.timings: dict[int, dict[str, list[float]]] = {}  # threads → what the verdict was read from
        self.depth = 0  # nested applications (a drafter's forward inside the target's): installed once

    # ------------------------------------------------------------------ the verdict
    def verdict(self) -> tuple[str, ...]:
        """Per size in SIZES, the product used at this thread count (measured once, then saved)."""
        threads = torch.get_num_threads()
        found = self.verdicts.get(threads)
        if found is not None:
            return found
        kind = mode()
        if kind == "off" or not self.layers:
            found = ("stock",) * len(SIZES)
        elif kind == "on":
            found = ("rows",) * len(SIZES)
        elif kind == "native":  # the compiled product everywhere (where it cannot be built: W·Xᵀ)
            found = ("native" if self.native() else "rows",) * len(SIZES)
        else:
            found = self._load(threads)
            if found is None:
                try:
                    found = self._measure(threads)
                except Exception:  # a model that cannot run bare token ids (it needs other inputs): stock
                    found = ("stock",) * len(SIZES)
        self.verdicts[threads] = _LATEST[threads] = found
        return found

    def copies(self) -> int:
        """How many sizes may keep a packed copy of the weights (``packed_matmul.copies``; 0 without MKL's
        packed product or float32 weights)."""
        weights = [m.weight for m in self.layers if packed_matmul.usable(m.weight)]
        if not weights or len(weights) < len(self.layers) or not packed_matmul.available():
            return 0
        return packed_matmul.copies(
            sum(w.numel() * w.element_size() for w in {w.data_ptr(): w for w in weights}.values())
        )

    def native(self) -> str | None:
        """The compiled product's library name if it can compute every layer (``treespec.native_matmul``),
        else None."""
        if not self.layers or not all(native_matmul.usable(m.weight) for m in self.layers):
            return None
        return native_matmul.library_name()

    def blocks(self) -> int:
        """How many layers the compiled product reads from a GGUF's blocks (``treespec.weight_blocks``)."""
        return sum(weight_blocks.find(m.weight) is not None for m in self.layers)

    def key(self, threads: int) -> dict[str, Any]:
        """What a verdict was measured for."""
        cfg = getattr(self.model, "config", None)
        shape = sorted({tuple(m.weight.shape) for m in self.layers})
        first = self.layers[0].weight
        return {
            "model": type(self.model).__name__,
            "config": getattr(cfg, "model_type", None),
            "layers": len(self.layers),
            "shapes": hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:12],
            "dtype": str(first.dtype).replace("torch.", ""),
            "threads": threads,
            "torch": torch.__version__,
            "cpu": cpu_name(),
            "packed": self.copies() > 0,  # measured with the packed product offered or not
            "native": self.native(),  # and the compiled one (its library: source, compiler, flags)
            "blocks": self.blocks(),
        }

    def _path(self, key: dict[str, Any]):
        from treespec.cost import profile_dir

        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return profile_dir() / f"row-matmul-{digest}.json"

    def _load(self, threads: int) -> tuple[str, ...] | None:
        key = self.key(threads)
        try:
            saved = json.loads(self._path(key).read_text())
            rows, ms = saved["rows"], saved.get("ms", {})
            usable = saved.get("key") == key and len(rows) == len(SIZES) and all(v in CHOICES for v in rows)
            if usable and plausible(ms):  # a disturbed measurement is measured again
                self.timings[threads] = ms
                return self._fit(tuple(rows), ms)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # nothing saved, or a damaged file: measured again
        return None

    def _fit(self, verdict: tuple[str, ...], ms: dict[str, list[float]]) -> tuple[str, ...]:
        """``verdict`` with no more packed sizes than ``copies()`` allows now, counting the sizes this
        model's verdicts at other thread counts already pack (shared copies) and keeping the smallest (a
        single sequence's trees); a size given up takes the fastest other product its timings name (at least
        3% faster than stock), else stock."""
        shared = self._packed_sizes()
        allowed = self.copies() - len(shared)
        out = list(verdict)
        for i, choice in enumerate(verdict):
            if choice == "packed" and SIZES[i] not in shared:
                if allowed > 0:
                    allowed -= 1
                    continue
                out[i] = choose({name: ms[name][i] for name in ms if name != "packed" and ms[name][i] > 0})
        return tuple(out)

    def _packed_sizes(self) -> set[int]:
        """The sizes this model's verdicts (every thread count) compute with the packed product."""
        return {SIZES[i] for found in self.verdicts.values() for i, choice in enumerate(found) if choice == "packed"}

    def _measure(self, threads: int) -> tuple[str, ...]:
        """The verdict of the first undisturbed measurement (``plausible``), saved if other processes kept
        less than BUSY cores busy meanwhile; if the machine stays disturbed for ``ATTEMPTS`` measurements,
        torch's own product everywhere, for this process only."""
        for _ in range(ATTEMPTS):
            meter = LoadMeter()
            verdict, ms = self._time_sizes()
            busy = meter.others()  # other processes' load meanwhile, in cores
            self.timings[threads] = ms
            if plausible(ms):
                if busy is None or busy < BUSY:  # measured beside other work: this process's verdict only
                    self._save(threads, verdict, ms)  # as measured: the budget is applied where it is read
                return self._fit(verdict, ms)
        return ("stock",) * len(SIZES)

    def _save(self, threads: int, verdict: tuple[str, ...], ms: dict[str, list[float]]) -> None:
        key = self.key(threads)
        try:
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"key": key, "sizes": list(SIZES), "rows": list(verdict), "ms": ms}))
        except OSError:
            pass  # a read-only cache: measured again next process

    @torch.inference_mode()
    def _time_sizes(self) -> tuple[tuple[str, ...], dict[str, list[float]]]:
        """Time whole forwards (no cache) at each size, every product interleaved; medians decide (the
        packed product wherever copies are allowed at all; ``_fit`` then keeps the verdict within the
        budget). A size's packed copies are freed after it: one exists at a time, and a chosen size is
        packed again once a run uses it often (``packed_matmul.USES_BEFORE_PACKING``)."""
        emb = self.model.get_input_embeddings()
        vocab = int(getattr(emb, "num_embeddings", 0) or emb.weight.shape[0])
        device = emb.weight.device if emb.weight.device.type != "meta" else torch.device("cpu")
        offered = {"stock": True, "rows": True, "packed": self.copies() > 0, "native": self.native() is not None}
        products = [name for name in CHOICES if offered[name]]
        ms: dict[str, list[float]] = {name: [] for name in products}
        limit = max_positions(self.model.config) if hasattr(self.model, "config") else None
        verdict: list[str] = []
        for name in CHOICES[:2]:  # untimed: first calls (allocator, kernels) inflate size 1
            with self.installed((name,) * len(SIZES)):
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
        for size in SIZES:
            tried = [] if limit is not None and size > limit else list(products)
            ids = (torch.arange(size, device=device)[None] * 31 + 7) % max(vocab, 1)  # [1, R] arbitrary tokens
            medians = self._time_one(ids, tried)
            for name in products:
                ms[name].append(round(medians.get(name, 0.0) * 1e3, 3))
            verdict.append(choose(medians))
            packed_matmul.drop({size}, [m.weight for m in self.layers])
        return tuple(verdict), ms

    def _time_one(self, ids: torch.Tensor, products: list[str]) -> dict[str, float]:
        """Median seconds of a forward of ``ids`` with each of ``products``, interleaved rep by rep (the
        first rep of each a warm-up), the weights packed for this size first; a close call between the
        fastest and torch's product (within CLOSE) is timed again, up to CLOSE_ROUNDS times."""
        times: dict[str, list[float]] = {name: [] for name in products}
        if "packed" in products:  # made now, not after USES_BEFORE_PACKING forwards
            for m in self.layers:
                packed_matmul.packed(m.weight, ids.shape[-1], force=True)  # ids: [1, a size of SIZES]
        for round_ in range(CLOSE_ROUNDS):
            for rep in range(REPEATS + (round_ == 0)):
                for name in products:
                    with self.installed((name,) * len(SIZES)):
                        began = time.perf_counter()
                        self.model(input_ids=ids, use_cache=False)
                        took = time.perf_counter() - began
                    if rep or round_:
                        times[name].append(took)
            medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            if "stock" not in medians or len(medians) < 2:
                break
            best = min(v for n, v in medians.items() if n != "stock")
            if abs(best - medians["stock"]) > CLOSE * medians["stock"]:
                break
        return medians

    # ------------------------------------------------------------------ the switch
    @contextlib.contextmanager
    def applied(self, modules: bool = True) -> Iterator[None]:
        """Inside: this model's plain linear layers follow the verdict for this thread count (``modules``
        False: only ``linear`` does, for a forward that calls it on the weights, ``treespec.lean``)."""
        if not self.layers:
            yield
            return
        verdict = self.verdict()
        with self.installed(verdict if any(c != "stock" for c in verdict) else None, modules):
            yield

    @contextlib.contextmanager
    def installed(self, verdict: tuple[str, ...] | None, modules: bool = True) -> Iterator[None]:
        """Inside: the layers follow ``verdict`` (per size in SIZES, one of CHOICES; None: torch's own), whatever
        was measured (``examples/row_matmul.py`` compares the two this way)."""
        if verdict is None:
            yield
            return
        token = _VERDICT.set(verdict)
        if modules:
            if not self.depth:
                for module, forward in zip(self.layers, self.forwards):
                    vars(module)["forward"] = forward
            self.depth += 1
        try:
            yield
        finally:
            if modules:
                self.depth -= 1
                if not self.depth:
                    for module in self.layers:
                        vars(module).pop("forward", None)
            _VERDICT.reset(token)
