"""MKL's packed matrix product: a weight packed once for one row count, reused by every forward of it.

Why. A BLAS matrix product repacks its weight operand into the kernel's blocked layout on every call,
which costs about one more read and write of the weight: nothing next to a prompt's hundreds of rows,
most of the product at a draft tree's 4–16. MKL can keep the packed copy (``cblas_sgemm_pack``; torch
exposes it as ``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, what its own CPU
inductor uses), but only for the row count it was packed for: torch falls back to the plain product
for any other. On this repository's Intel Xeon (2 threads) SmolLM2-135M's output layer (49,152 × 576)
took, plain vs packed, 5.7 vs 4.3 ms at 4 rows, 9.5 vs 5.2 at 8, 10.6 vs 7.4 at 16, and a whole
verification behind 300 cached tokens 59.6 vs 48.8 ms at 4 rows, 72.3 vs 58.4 at 8, 82.5 vs 70.8 at
16 (``python examples/row_matmul.py --target smollm2``); at 1–3 rows it gains nothing.

How. ``product(size)`` is ``F.linear`` for inputs of at most ``size`` rows, padded with zero rows to
exactly ``size`` and computed with the weight's copy packed for ``size``. A copy is made once its size
has been asked for USES_BEFORE_PACKING times (torch's product until then), and kept in a registry keyed
weakly by the weight tensor, so a freed model frees them; a weight
changed in place (its version counter) or given new storage is packed again, so a copy never goes
stale. Each size costs one more copy of every weight it is used with (``drop`` frees a size): the few-row
products (``treespec.row_matmul``) choose the sizes, as many as ``copies`` allows. Zero rows change no other
row's result; the packed kernel sums in another order than the plain one, so logits differ in the
last bits, as they do between one-row and many-row products.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

#: weight → {size: (version, storage address, packed copy)}
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_USES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → {size: products computed before its copy}
_PRODUCTS: dict[int, Callable[..., torch.Tensor]] = {}  # size → its product (one function per size)
BUDGET_SHARE = 0.25  # of the memory available when measured: what packed copies may take by default
MAX_COPIES = 3  # by default at most this many sizes packed (4, 8 and 16 rows where each wins)
#: products of a size computed with torch's product before the weight's copy for it is made: a size a
#: run meets rarely (a one-sequence decode's odd large tree, a cost measurement's few forwards) costs
#: no memory; one it meets every step (a batch's) is packed within its first steps
USES_BEFORE_PACKING = 16


def available() -> bool:
    """Whether this torch has MKL's packed product (x86 builds with MKL)."""
    mkl = getattr(torch.ops, "mkl", None)
    return bool(torch.backends.mkl.is_available() and hasattr(mkl, "_mkl_linear"))


def usable(weight: torch.Tensor) -> bool:
    """A float32 CPU matrix: what MKL's single-precision packing takes."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def copies(weight_bytes: int) -> int:
    """How many packed copies of weights taking ``weight_bytes`` may be made: as many as
    ``TREESPEC_PACKED_MB`` holds (0: none), else at most MAX_COPIES within BUDGET_SHARE of the memory the
    system reports available (Linux ``/proc/meminfo``; elsewhere none)."""
    value = os.environ.get("TREESPEC_PACKED_MB", "").strip()
    if value:
        try:
            budget = max(0, int(float(value) * 2**20))
        except ValueError:
            raise ValueError(f"TREESPEC_PACKED_MB must be a number of MiB, got {value!r}") from None
        return budget // max(weight_bytes, 1)
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
    return min(MAX_COPIES, int(BUDGET_SHARE * kib * 1024) // max(weight_bytes, 1))


def packed(weight: torch.Tensor, size: int, force: bool = False) -> torch.Tensor | None:
    """``weight`` [O, I] packed for products of exactly ``size`` rows (made again if the weight changed),
    or None while fewer than USES_BEFORE_PACKING products of that size have asked (``force``: now)."""
    sizes = _PACKED.get(weight)
    if sizes is None:
        sizes = _PACKED[weight] = {}
    stamp = (weight._version, weight.data_ptr())
    found = sizes.get(size)
    if found is not None and found[:2] == stamp:
        return found[2]
    uses = _USES.get(weight)
    if uses is None:
        uses = _USES[weight] = {}
    uses[size] = uses.get(size, 0) + 1
    if not force and uses[size] < USES_BEFORE_PACKING:
        return None
    with torch.inference_mode():
        found = sizes[size] = (*stamp, torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), size))
    return found[2]


def product(size: int) -> Callable[..., torch.Tensor]:
    """``F.linear(x, weight, bias)`` for x of at most ``size`` rows (any leading shape), computed with
    ``weight`` packed for ``size`` rows once that copy exists (``packed``; until then torch's product)."""
    found = _PRODUCTS.get(size)
    if found is not None:
        return found

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        copy = packed(weight, size) if rows <= size and usable(weight) and x.dtype == torch.float32 else None
        if copy is None:
            return F.linear(x, weight, bias)
        x2 = x.reshape(rows, x.shape[-1])  # [R, I]
        if rows < size:
            x2 = torch.cat([x2, x2.new_zeros(size - rows, x2.shape[1])])  # [S, I]: zero rows change no other
        y = torch.ops.mkl._mkl_linear(x2, copy, weight, bias, size)  # [S, O]
        return y[:rows].view(*x.shape[:-1], weight.shape[0])  # [..., O]

    _PRODUCTS[size] = linear
    return linear


def drop(sizes: set[int] | None = None, weights: list[torch.Tensor] | None = None) -> None:
    """Free the packed copies of ``sizes`` (None: every size) of ``weights`` (None: every weight)."""
    chosen = list(_PACKED.values()) if weights is None else [_PACKED[w] for w in weights if w in _PACKED]
    for per_size in chosen:
        for size in list(per_size):
            if sizes is None or size in sizes:
                del per_size[size]
