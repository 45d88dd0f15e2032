"""The product compiled on this machine (``treespec.native_matmul``) is ``F.linear``, is compiled once
and found again, is never a hard requirement, and decodes exactly as the target's own ``generate``."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec import native_matmul, row_matmul
from treespec.row_matmul import RowMatmul

COMPILER = native_matmul.compiler()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not loaded the product yet, compiling into an empty cache."""
    monkeypatch.setattr(native_matmul, "_LIB", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_a_machine_with_a_compiler_has_the_product():
    """Where a C compiler exists (this repository's machines and CI) the product must build: a silent
    fallback would leave every other test here checking torch's product."""
    if COMPILER is None:
        pytest.skip("no C compiler on this machine")
    assert native_matmul.available(), "compiled and loaded"
    assert native_matmul.library_name().startswith("few_rows-")


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
@given(
    rows=st.integers(1, native_matmul.MAX_ROWS),
    lead=st.sampled_from([(), (1,), (2,)]),
    dims=st.tuples(st.integers(1, 70), st.integers(1, 45)),
    bias=st.booleans(),
    transposed=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_the_product_is_linear(rows, lead, dims, bias, transposed):
    """Any row count up to MAX_ROWS (tiles of 4 rows and their remainders), any width (vectors of 16
    and their tails), rows of W beyond the last tile of 4, a bias, and a non-contiguous X."""
    g = torch.Generator().manual_seed(rows * 131 + dims[0] * 7 + dims[1])
    k, n = dims
    x = torch.randn(*lead, k, rows, generator=g).transpose(-1, -2) if transposed else torch.randn(*lead, rows, k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = native_matmul.linear(x, w, b)
    assert got.shape == (*lead, rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
def test_the_compiled_product_runs(monkeypatch):
    """The product above is the compiled one, not torch's fallback: its kernel is called."""
    calls = []
    fn, name = native_matmul.function(), native_matmul.library_name()
    monkeypatch.setattr(native_matmul, "_LIB", [(lambda *a: calls.append(a) or fn(*a), name)])
    x, w = torch.randn(3, 40), torch.randn(9, 40)
    torch.testing.assert_close(native_matmul.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 and calls[0][4:7] == (3, 9, 40)


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
def test_what_it_does_not_compute_is_torchs(monkeypatch):
    """A gradient, another dtype, a non-contiguous weight or more than MAX_ROWS rows: torch's product."""
    monkeypatch.setattr(native_matmul, "_LIB", [(lambda *a: pytest.fail("the kernel must not be called"), "none")])
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(2, 16)
    y = native_matmul.linear(x, w)
    assert y.grad_fn is not None, "differentiable: torch's product"
    for x, w in (
        (torch.randn(2, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)),
        (torch.randn(2, 16), torch.randn(16, 8).t()),
        (torch.randn(native_matmul.MAX_ROWS + 1, 16), torch.randn(8, 16)),
    ):
        torch.testing.assert_close(native_matmul.linear(x, w), F.linear(x, w))
    for x, w, b in (
        (torch.randn(2, 16), torch.randn(8, 15), None),
        (torch.randn(2, 16), torch.randn(8, 16), torch.randn(7)),
    ):
        with pytest.raises(RuntimeError):  # mismatched shapes: torch's own error, never the kernel
            native_matmul.linear(x, w, b)


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
def test_compiled_once_then_found(fresh, monkeypatch):
    """The first process compiles into the cache; the next loads the same file without compiling."""
    assert native_matmul.available()
    built = list((fresh / "treespec" / "native").glob("few_rows-*.so"))
    assert len(built) == 1 and built[0].stem == native_matmul.library_name()
    monkeypatch.setattr(native_matmul, "_LIB", [])
    run = native_matmul.subprocess.run  # the compiler's --version still runs: it names the library
    monkeypatch.setattr(
        native_matmul.subprocess,
        "run",
        lambda cmd, **kw: pytest.fail("compiled again") if "-shared" in cmd else run(cmd, **kw),
    )
    assert native_matmul.available() and native_matmul.library_name() == built[0].stem


def test_without_a_working_compiler_it_is_simply_absent(fresh, monkeypatch):
    """A compiler that fails (or none) leaves the product unavailable, no error; linear is torch's."""
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    assert native_matmul.compiler() == (shutil.which("false") or "/bin/false")
    assert not native_matmul.available() and native_matmul.library_name() is None
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    torch.testing.assert_close(native_matmul.linear(x, w), F.linear(x, w))
    assert not list((fresh / "treespec" / "native").glob("*.so"))


def test_switched_off_it_is_never_compiled(fresh, monkeypatch):
    monkeypatch.setenv("TREESPEC_NATIVE", "off")
    monkeypatch.setattr(native_matmul.subprocess, "run", lambda *a, **k: pytest.fail("compiled"))
    assert not native_matmul.available()
    assert RowMatmul(torch.nn.Sequential(torch.nn.Linear(16, 8))).native() is None


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
def test_the_verdict_times_it_and_keys_it(monkeypatch, tmp_path):
    """The verdict's measurement times the compiled product at every size, and a verdict is keyed by
    the library it timed (a new source or compiler measures again)."""
    from test_packed_matmul import _tiny_model

    monkeypatch.setenv("TREESPEC_ROW_MATMUL", "auto")
    monkeypatch.setenv("TREESPEC_PROFILE_DIR", str(tmp_path))
    rm = RowMatmul(_tiny_model())
    verdict = rm.verdict()
    threads = torch.get_num_threads()
    assert all(t > 0 for t in rm.timings[threads]["native"]), "timed at every size"
    assert all(v in row_matmul.CHOICES for v in verdict)
    assert rm.key(threads)["native"] == native_matmul.library_name()


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
def test_a_decode_with_the_compiled_product_everywhere_is_the_targets_own(monkeypatch):
    """Every linear layer of target and draft computed by the compiled product at every size, on
    float32 stories260K: exactly the target's own ``generate`` on real prompts."""
    from conftest import assert_greedy_with_product

    calls = []
    real = native_matmul.linear
    monkeypatch.setattr(native_matmul, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    assert_greedy_with_product(monkeypatch, "native")
    assert calls, "the compiled product ran"
