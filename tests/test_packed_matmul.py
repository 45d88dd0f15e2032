"""MKL's packed product (``treespec.packed_matmul``) is ``F.linear``, follows a weight that changes, and
the few-row products (``treespec.row_matmul``) choose it per row count within the memory it may take."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec import packed_matmul, row_matmul
from treespec.row_matmul import SIZES, RowMatmul

needs_mkl = pytest.mark.skipif(not packed_matmul.available(), reason="this torch has no MKL packed product")


@needs_mkl
@given(
    size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    data=st.data(),
    lead=st.sampled_from([(), (1,), (2,)]),
    dims=st.tuples(st.integers(1, 40), st.integers(1, 40)),
    bias=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_packed_product_is_linear(size, data, lead, dims, bias):
    """Padded with zero rows to the packed size, or more rows than it (then torch's own product)."""
    rows = data.draw(st.integers(1, size + 3))  # with the leading dims: at most, or more than, ``size`` rows
    g = torch.Generator().manual_seed(rows * 31 + dims[0])
    x = torch.randn(*lead, rows, dims[0], generator=g)
    w = torch.randn(dims[1], dims[0], generator=g)
    b = torch.randn(dims[1], generator=g) if bias else None
    packed_matmul.packed(w, size, force=True)  # the copy now, not after USES_BEFORE_PACKING products
    got = packed_matmul.product(size)(x, w, b)
    assert got.shape == (*lead, rows, dims[1]) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_a_changed_weight_is_packed_again(monkeypatch):
    """In place (its version counter) or new storage (``.data =``): never a stale copy."""
    monkeypatch.setattr(packed_matmul, "USES_BEFORE_PACKING", 1)
    lin = torch.nn.Linear(32, 24, bias=False)
    x = torch.randn(4, 32)
    mm = packed_matmul.product(4)
    with torch.inference_mode():
        first = mm(x, lin.weight)
    copy = packed_matmul._PACKED[lin.weight][4][2]
    torch.testing.assert_close(first, F.linear(x, lin.weight.detach()), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    torch.testing.assert_close(mm(x, lin.weight), -2.0 * first, rtol=1e-5, atol=1e-5)
    assert packed_matmul._PACKED[lin.weight][4][2] is not copy, "packed again after the in-place change"
    lin.weight.data = torch.randn(24, 32)
    torch.testing.assert_close(mm(x, lin.weight), F.linear(x, lin.weight.detach()), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_copies_are_freed_with_their_weight_and_by_drop(monkeypatch):
    monkeypatch.setattr(packed_matmul, "USES_BEFORE_PACKING", 1)
    w = torch.randn(16, 8)
    packed_matmul.product(8)(torch.randn(3, 8), w)
    assert w in packed_matmul._PACKED and 8 in packed_matmul._PACKED[w]
    packed_matmul.drop({8})
    assert not packed_matmul._PACKED[w]
    packed_matmul.product(8)(torch.randn(3, 8), w)
    count = len(packed_matmul._PACKED)
    del w
    gc.collect()
    assert len(packed_matmul._PACKED) == count - 1


def test_other_inputs_take_torchs_product():
    """Half precision, float64, or a weight not on a CPU matrix: F.linear itself, bit for bit."""
    mm = packed_matmul.product(4)
    for dtype in (torch.float64, torch.bfloat16):
        x, w = torch.randn(3, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
        assert torch.equal(mm(x, w), F.linear(x, w))


def test_copies_follow_the_environment(monkeypatch):
    """TREESPEC_PACKED_MB in MiB (0: none; a word: one line naming the variable), else at most MAX_COPIES."""
    monkeypatch.setenv("TREESPEC_PACKED_MB", "3")
    assert packed_matmul.copies(2**20) == 3 and packed_matmul.copies(2**21) == 1
    monkeypatch.setenv("TREESPEC_PACKED_MB", "0")
    assert packed_matmul.copies(1) == 0
    monkeypatch.setenv("TREESPEC_PACKED_MB", "lots")
    with pytest.raises(ValueError, match="TREESPEC_PACKED_MB must be a number of MiB"):
        packed_matmul.copies(1)
    monkeypatch.delenv("TREESPEC_PACKED_MB")
    assert 0 <= packed_matmul.copies(2**20) <= packed_matmul.MAX_COPIES


def test_rows_follow_the_size_they_are_padded_to():
    """Up to 16 rows: the smallest measured size ≥ r (3 rows are measured on their own); above: the
    largest ≤ r; above twice the last size: none (torch's product)."""
    want = {1: 1, 2: 2, 3: 3, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 16, 31: 16, 32: 32, 127: 64}
    for rows, size in want.items():
        assert SIZES[row_matmul._index(rows)] == size, rows
    assert row_matmul._index(128) == -1 and row_matmul._index(0) == -1


def test_the_packed_product_is_used_only_up_to_its_size():
    verdict = ("packed",) * len(SIZES)
    assert row_matmul._dispatch(verdict, torch.ones(5, 4)) is packed_matmul.product(8)
    assert row_matmul._dispatch(verdict, torch.ones(40, 4)) is F.linear  # 40 rows: size 32's verdict, cannot pad down


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_no_budget_no_packed_product(monkeypatch, tmp_path):
    """With TREESPEC_PACKED_MB=0 the packed product is neither measured nor chosen, and the key says so."""
    monkeypatch.setenv("TREESPEC_ROW_MATMUL", "auto")
    monkeypatch.setenv("TREESPEC_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("TREESPEC_PACKED_MB", "0")
    rm = RowMatmul(_tiny_model())
    assert rm.copies() == 0 and rm.key(1)["packed"] is False
    verdict = rm.verdict()
    assert "packed" not in verdict and "packed" not in rm.timings[torch.get_num_threads()]


@needs_mkl
def test_a_saved_verdict_keeps_packed_sizes_within_the_budget(monkeypatch):
    """Loaded where fewer copies fit: the smallest packed sizes stay, the others take W·Xᵀ if their
    timings say so, else torch's product."""
    rm = RowMatmul(_tiny_model())
    weights = sum(m.weight.numel() * 4 for m in rm.layers)
    monkeypatch.setenv("TREESPEC_PACKED_MB", str(2.5 * weights / 2**20))
    assert rm.copies() == 2
    n = len(SIZES)
    verdict = ("stock", "rows", "packed", "packed", "packed", "packed", "stock", "stock")[:n]
    ms = {"stock": [10.0] * n, "rows": [9.0, 9.0, 9.0, 9.0, 9.0, 9.9, 9.0, 9.0][:n], "packed": [8.0] * n}
    assert rm._fit(verdict, ms) == ("stock", "rows", "packed", "packed", "rows", "stock", "stock", "stock")[:n]


@needs_mkl
def test_decoding_with_the_packed_product_is_the_targets_own_greedy_output(monkeypatch):
    """Every forward (the target's trees, the drafter's) through the packed product at every size, in
    float32 (what it packs): exactly the target's own ``generate`` on real prompts."""
    from conftest import assert_greedy_with_product

    packs = []
    real = packed_matmul.packed
    monkeypatch.setattr(packed_matmul, "USES_BEFORE_PACKING", 1)  # every product packed from the start
    monkeypatch.setattr(
        packed_matmul, "packed", lambda w, size, force=False: packs.append(size) or real(w, size, force)
    )
    assert_greedy_with_product(monkeypatch, "packed")
    assert {1, 2, 3, 4, 8, 16} & set(packs), "the packed product ran"


@needs_mkl
def test_a_measurement_leaves_no_copies(monkeypatch, tmp_path):
    """The verdict's measurement packs each size to time it and frees it after: a chosen size is packed
    again on its first use, one the process never computes at costs nothing."""
    monkeypatch.setenv("TREESPEC_ROW_MATMUL", "auto")
    monkeypatch.setenv("TREESPEC_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("TREESPEC_PACKED_MB", "1000")
    rm = RowMatmul(_tiny_model())
    rm.verdict()
    assert any(t > 0 for t in rm.timings[torch.get_num_threads()]["packed"]), "the packed product was timed"
    assert all(not packed_matmul._PACKED.get(m.weight) for m in rm.layers)


@needs_mkl
def test_sizes_packed_at_another_thread_count_are_shared(monkeypatch):
    """A verdict for another thread count (treespec follows the machine's load) shares its sizes' copies
    and counts them against the budget: the model never keeps more copies than ``copies()``."""
    rm = RowMatmul(_tiny_model())
    weights = sum(m.weight.numel() * 4 for m in rm.layers)
    monkeypatch.setenv("TREESPEC_PACKED_MB", str(2.5 * weights / 2**20))
    n = len(SIZES)
    other = tuple("packed" if size in (8, 16) else "stock" for size in SIZES)
    rm.verdicts[99] = other  # 99 threads: any count but this one
    mine = tuple("packed" if size in (4, 8) else "stock" for size in SIZES)
    ms = {"stock": [10.0] * n, "rows": [9.0] * n, "packed": [8.0] * n}
    want = tuple({4: "rows", 8: "packed"}.get(size, "stock") for size in SIZES)  # 4 given up: no copy left
    assert rm._fit(mine, ms) == want


@needs_mkl
def test_a_size_is_packed_once_it_is_used_often(monkeypatch):
    """Torch's product for a size's first USES_BEFORE_PACKING − 1 products, the packed copy from then on;
    the same results either way."""
    monkeypatch.setattr(packed_matmul, "USES_BEFORE_PACKING", 3)
    w, x = torch.randn(12, 8), torch.randn(3, 8)
    mm = packed_matmul.product(4)
    for use in range(1, 5):
        torch.testing.assert_close(mm(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert (4 in packed_matmul._PACKED.get(w, {})) == (use >= 3), use
