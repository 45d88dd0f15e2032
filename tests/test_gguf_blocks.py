"""A GGUF's blocks read by the compiled product (``treespec.gguf_blocks``): the same bits as the float32
product on the weights gguf dequantises, attached only where exact, dropped when a weight changes, and
a decode from them is the target's own ``generate``.

Blocks come from the format's publisher: ``gguf.quantize`` (llama.cpp's gguf-py) for the kernel, and
GGUF files written by it (tests/gguf_fixture.py) for the model path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treespec
from treespec import gguf as tg
from treespec import gguf_blocks, native_matmul, weight_blocks
from treespec.weight_blocks import Q4_1, Q8_0

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(native_matmul.compiler() is None, reason="no C compiler: no compiled product")

from test_gguf import SOURCE, _hf_gguf, assert_decodes_as_transformers  # noqa: E402


def _blocks(kind: int, w: np.ndarray) -> tuple[weight_blocks.Blocks, torch.Tensor]:
    """``w`` quantised by gguf: its blocks, and the float32 weights gguf dequantises them to."""
    qtype = gguf.GGMLQuantizationType(kind)
    raw = gguf.quantize(w, qtype)  # [N, bytes per row], llama.cpp's layout
    floats = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).contiguous()
    return gguf_blocks.from_gguf_rows(kind, raw), floats


def _float_product(x, w, b=None):
    """The compiled product on the floats (nothing attached to this tensor)."""
    assert weight_blocks.find(w) is None
    return native_matmul.linear(x, w, b)


@given(
    kind=st.sampled_from([Q4_1, Q8_0]),
    rows=st.integers(1, native_matmul.MAX_ROWS),
    n=st.integers(1, 23),
    blocks=st.integers(1, 5),
    bias=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_block_products_have_the_float_products_bits(kind, rows, n, blocks, bias):
    """Any row count (tiles of 4 and their remainders), rows of W beyond the last tile, several blocks a
    row, a bias: every output equal bit for bit to the float32 product on the dequantised weights."""
    g = np.random.default_rng(rows * 131 + n * 7 + blocks)
    w = (g.standard_normal((n, 32 * blocks)) * g.uniform(0.01, 2)).astype(np.float32)
    found, floats = _blocks(kind, w)
    assert torch.equal(found.dequantised(), floats)  # what the kernel multiplies is what gguf gives
    x = torch.from_numpy(g.standard_normal((rows, 32 * blocks)).astype(np.float32))
    b = torch.from_numpy(g.standard_normal(n).astype(np.float32)) if bias else None
    want = _float_product(x, floats, b)
    attached = floats.clone()
    assert weight_blocks.attach(attached, found)
    assert weight_blocks.find(attached) is found
    assert torch.equal(native_matmul.linear(x, attached, b), want)


def test_blocks_that_are_not_the_weights_are_refused():
    """One weight's worth of q flipped, or another weight: not attached (the check that makes it exact)."""
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for kind in (Q4_1, Q8_0):
        found, floats = _blocks(kind, w)
        q = found.q.clone()
        q[3, 5] ^= 1
        bad = weight_blocks.Blocks(kind, q, found.d, found.m)
        assert not weight_blocks.attach(floats, bad) and weight_blocks.find(floats) is None
        assert not weight_blocks.attach(floats * 2, found)
        assert not weight_blocks.attach(floats.double(), found)  # float32 only


def test_a_changed_weight_loses_its_blocks():
    """An in-place change through torch (its version) or a new storage drops the blocks at once; an edit
    through ``.data`` (which torch does not count) at the next sequence's spot check."""
    w = np.random.default_rng(1).standard_normal((12, 64)).astype(np.float32)
    found, floats = _blocks(Q4_1, w)
    x = torch.randn(3, 64)
    weight = torch.nn.Parameter(floats.clone(), requires_grad=False)
    assert weight_blocks.attach(weight, found)
    with torch.no_grad():
        weight.mul_(2)
    assert weight_blocks.find(weight) is None
    assert torch.equal(native_matmul.linear(x, weight), _float_product(x, weight.detach().clone()))
    other = torch.nn.Parameter(floats.clone(), requires_grad=False)
    assert weight_blocks.attach(other, found)
    other.data[7] += 1.0
    assert weight_blocks.spot_check([other], 6) == 0  # row 6 still matches
    assert weight_blocks.find(other) is found
    assert weight_blocks.spot_check([other], 7) == 1
    assert weight_blocks.find(other) is None


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_gguf_target_reads_its_blocks_and_decodes_as_transformers(gguf_files, gguf_cache, qtype):
    """Every linear weight of a quantised GGUF target gets its blocks (matched by rows: llama.cpp's q/k
    row order included), kept once beside the converted folder; the decode is token for token what
    transformers' own GGUF model generates."""
    path = gguf_files[qtype]
    target = treespec.TargetModel.load(str(path))  # float32
    layers = target.row_matmul.layers
    assert target.row_matmul.blocks() == len(layers) > 0
    folder = tg.converted(str(path))
    stamp = (folder / gguf_blocks.FILE).stat().st_mtime_ns
    assert_decodes_as_transformers(target, *_hf_gguf(path, torch.float32))
    again = treespec.TargetModel.load(str(path))
    assert again.row_matmul.blocks() == len(layers)
    assert (folder / gguf_blocks.FILE).stat().st_mtime_ns == stamp  # read, not built again
    # the folder stays a plain model folder: tools that load every top-level *.safetensors (vLLM) find
    # the weights alone
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]


def test_no_blocks_without_a_quantised_gguf_or_when_switched_off(gguf_files, gguf_cache, monkeypatch, tmp_path):
    assert treespec.TargetModel.load(str(gguf_files["F32"])).row_matmul.blocks() == 0  # nothing quantised
    assert treespec.TargetModel.load(str(SOURCE)).row_matmul.blocks() == 0  # not from a GGUF
    monkeypatch.setenv("TREESPEC_GGUF_BLOCKS", "off")
    assert treespec.TargetModel.load(str(gguf_files["Q4_1"])).row_matmul.blocks() == 0
    monkeypatch.delenv("TREESPEC_GGUF_BLOCKS")
    moved = tmp_path / "moved.gguf"  # converted, then the GGUF file is gone: the floats, no error
    moved.write_bytes(gguf_files["Q8_0"].read_bytes())
    folder = tg.converted(str(moved))
    moved.unlink()
    model = treespec.TargetModel(treespec.models.load_causal_lm(str(folder)), name=str(folder))
    assert model.row_matmul.blocks() == 0


def test_a_blocks_file_of_another_gguf_is_built_again(gguf_files, gguf_cache):
    target = treespec.TargetModel.load(str(gguf_files["Q4_1"]))
    folder = tg.converted(str(gguf_files["Q4_1"]))
    meta = json.loads((folder / tg.MARKER).read_text())
    weights = gguf_blocks.linear_weights(target.model)
    assert gguf_blocks.load(folder / gguf_blocks.FILE, meta["sha256"]).keys() == weights.keys()
    assert gguf_blocks.load(folder / gguf_blocks.FILE, "0" * 64) is None


def test_an_output_layers_rows_keep_their_blocks():
    """A reduced draft vocabulary's rows of the output layer (the EAGLE head's) read the same rows' blocks."""
    w = np.random.default_rng(2).standard_normal((20, 64)).astype(np.float32)
    found, floats = _blocks(Q8_0, w)
    index = torch.tensor([3, 0, 17, 5, 19])
    rows = floats[index]
    assert weight_blocks.attach(rows, found.rows(index))
    x = torch.randn(2, 64)
    assert torch.equal(native_matmul.linear(x, rows), _float_product(x, rows.clone()))
    assert not weight_blocks.attach(floats[index.flip(0)].contiguous(), found.rows(index))
