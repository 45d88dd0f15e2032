"""W·Xᵀ: a few rows' linear layer computed as (W·Xᵀ)ᵀ, one of the few-row products ``treespec.row_matmul``
measures (``rows`` in its verdict).

torch computes ``F.linear(x, W) = X·Wᵀ``; for one row that is a matrix-vector product, for a few rows a
GEMM tuned for many. The same product with the operands swapped reads W as the left matrix of a GEMM
with a few columns, which some BLAS libraries run at memory speed (the timings: ``treespec.row_matmul``).
"""

from __future__ import annotations

import torch

PAD_UP_TO = 16  # up to this many rows, W·Xᵀ pads X to a power of two (above: measured slower padded)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as (W·Xᵀ)ᵀ. Up to PAD_UP_TO rows, X is padded to a power
    of two (one row to two: a matrix product, one read of W, instead of the matrix-vector path): BLAS
    is measured much slower at some odd column counts (13 rows: 141 ms a forward, padded to 16: 109)."""
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])  # [R, I]
    if rows <= PAD_UP_TO:
        padded = max(2, 1 << (rows - 1).bit_length())
        if padded > rows:
            x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])  # [P, I]
    y = torch.mm(weight, x2.t()).t()[:rows]  # [R, O], transposed in memory
    y = y.contiguous()  # [R, O] row-major, as F.linear returns it
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])  # [..., O]
