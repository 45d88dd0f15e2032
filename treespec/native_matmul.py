"""A few-row product compiled on this machine: every weight read once at memory speed, for 1 to ~16 rows.

Why. A decode step's products are X·Wᵀ with a handful of rows in X and every weight of the model in
W, so they cost what reading W costs, if the kernel reads it once. BLAS kernels are tuned for many
rows: on this repository's Intel Xeon (2 threads, MKL) SmolLM2-135M's 211 weight matrices (538 MB)
multiplied in a loop by 1, 2, 4, 8, 16 rows took 21.5, 24.2, 38.1, 46.9, 59.1 ms with torch's
product: 4 rows (a root and 3 drafted nodes) cost 1.8 times one. ``csrc/few_rows.c`` keeps up to 4
rows of X in registers against 4 rows of W at a time and prefetches the next rows of W: 20.4, 21.0,
23.7, 28.3, 39.5 ms. Whole forwards: ``python examples/row_matmul.py --target smollm2 --compare native``.

How. On first use the C file is compiled with the system's C compiler (``$CC``, else ``cc``; flags
``-O3 -march=native -fopenmp``, then without ``-march=native``, then without OpenMP) into
``native/`` in treespec's cache (``~/.cache/treespec/native/`` by default), named by a hash of the
source, the compiler's version, the flags and the CPU, so a new compiler, CPU or source compiles again
and nothing stale is loaded (~0.5 s, once; 15 kB). It is loaded with ctypes; its threads are OpenMP's, whose runtime torch has already loaded,
so the two share one pool. No compiler, or a failed compile: ``available()`` is False and the few-row
products' verdict (``treespec.row_matmul``) never offers it; where it is offered the verdict measures it
against torch's product at each row count and uses it only where it is faster.
``TREESPEC_NATIVE=off`` never compiles or loads it.

Same arithmetic, another summation order (16 partial sums per output, then a tree): logits differ from
torch's in the last bits, as they already do between torch's one-row and many-row products.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from treespec.weight_blocks import find, float_matrix

SOURCE = Path(__file__).with_name("csrc") / "few_rows.c"
SYMBOL = "treespec_few_rows"
BLOCK_SYMBOL = "treespec_block_rows"  # the same product with W as a GGUF's blocks (treespec.weight_blocks)
#: tried in order until one compiles: the fastest code for this CPU, then portable, then single-threaded
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3", "-march=native"),
)
F32 = torch.float32
MAX_ROWS = 64  # above this many rows torch's product is always the faster (a prompt's prefill)

#: [] not tried yet; [None] unavailable; [(function, its block twin, library name)]
_LIB: list[tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, str] | None] = []


def enabled() -> bool:
    """``TREESPEC_NATIVE``: on (the default) or off."""
    return os.environ.get("TREESPEC_NATIVE", "on").strip().lower() not in ("off", "0", "false", "no")


def library_dir() -> Path:
    """Where compiled products are kept: ``native/`` in treespec's cache (``treespec.gguf.cache_root``:
    ``$TREESPEC_CACHE``, else ``$XDG_CACHE_HOME/treespec``, else ``~/.cache/treespec``)."""
    from treespec.gguf import cache_root

    return cache_root() / "native"


def compiler() -> str | None:
    """The C compiler's path: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH; None if none."""
    found = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc") or shutil.which("clang")
    return found


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(compiler: str, flags: tuple[str, ...]) -> Path | None:
    """The shared library compiled with ``flags`` (from the cache when it is there), or None."""
    from treespec.devices import cpu_name

    source = SOURCE.read_bytes()
    stamp = b"\0".join([source, _version(compiler).encode(), " ".join(flags).encode(), cpu_name().encode()])
    path = library_dir() / f"few_rows-{hashlib.sha256(stamp).hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            cmd = [compiler, *flags, "-shared", "-fPIC", str(SOURCE), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, timeout=120)
            if done.returncode != 0 or not out.exists():
                return None
            os.replace(out, path)  # atomic: a concurrent process finds a whole file or none
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def _load() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, str] | None:
    cc = compiler() if enabled() else None
    if cc is None or not SOURCE.exists():
        return None
    for flags in FLAG_SETS:
        path = _build(cc, flags)
        if path is None:
            continue
        try:
            lib = ctypes.CDLL(str(path))
            fn, blocks = getattr(lib, SYMBOL), getattr(lib, BLOCK_SYMBOL)
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        blocks.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [ctypes.c_int]
        fn.restype = blocks.restype = None
        return fn, blocks, path.stem
    return None


def function() -> ctypes._CFuncPtr | None:
    """The compiled product (compiled and loaded on the first call), or None where it cannot be."""
    if not _LIB:
        _LIB.append(_load())
    return _LIB[0][0] if _LIB[0] else None


def library_name() -> str | None:
    """The loaded library's name (``few_rows-<hash of source, compiler, flags, CPU>``), or None."""
    return _LIB[0][2] if function() is not None and _LIB[0] else None


def available() -> bool:
    """Whether the compiled product can be used in this process."""
    return function() is not None


def usable(weight: torch.Tensor) -> bool:
    """A contiguous float32 CPU matrix: what the kernel reads."""
    return float_matrix(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the compiled product for float32 CPU inputs of at most MAX_ROWS
    rows that need no gradient; torch's product otherwise (which also raises on mismatched shapes: the
    kernel is never handed one). A forward calls this ~200 times: the checks are kept cheap."""
    k = x.shape[-1] if x.dim() else 0
    rows = x.numel() // k if k else 0
    fn = function()
    if (
        fn is None
        or not 0 < rows <= MAX_ROWS
        or x.dtype is not F32
        or weight.dtype is not F32
        or not x.is_cpu
        or not weight.is_cpu
        or weight.dim() != 2
        or weight.shape[1] != k
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype is not F32 or bias.shape != weight.shape[:1] or not bias.is_contiguous()))
        or (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
    ):
        return F.linear(x, weight, bias)
    if not x.is_contiguous():
        x = x.contiguous()  # [..., I]: its rows read as [R, I]
    n = weight.shape[0]
    y = torch.empty((*x.shape[:-1], n))  # [..., O], written as [R, O]
    blocks = find(weight)
    if blocks is not None:  # the same bits from the GGUF's blocks (treespec.weight_blocks)
        _LIB[0][1](
            blocks.kind,
            x.data_ptr(),
            blocks.q.data_ptr(),
            blocks.d.data_ptr(),
            blocks.m.data_ptr(),
            y.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            rows,
            n,
            k,
            torch.get_num_threads(),
        )
        return y
    fn(
        x.data_ptr(),
        weight.data_ptr(),
        y.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        rows,
        n,
        k,
        torch.get_num_threads(),
    )
    return y
