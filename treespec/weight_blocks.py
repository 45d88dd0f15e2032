"""A weight's quantised blocks, as the compiled product reads them: the record and its registry.

``Blocks`` holds one weight [N, K] as a GGUF stores it (Q4_1: 32 weights share a float16 scale d and
minimum m, w = d·q + m with q of 4 bits; Q8_0: w = d·q, q a signed byte). ``attach`` ties blocks to a
weight only if they dequantise to its exact bits, and ``find`` returns them only while the weight is
unchanged (the same tensor, version and storage), so the compiled product
(``treespec.native_matmul``, which looks a weight's blocks up here at every call) gives the bits it
gives on the floats. ``spot_check`` catches what torch does not count (an edit through ``.data``).
Where blocks come from, a GGUF file treespec converted: ``treespec.gguf_blocks``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

Q4_1, Q8_0 = 3, 8  # ggml's type numbers, as the kernel takes them
KINDS = {Q4_1: ("Q4_1", 20), Q8_0: ("Q8_0", 34)}  # bytes per block of 32 weights: float16 d (and m), then q
BLOCK = 32

#: id(weight) -> (a weak reference to it, its version and storage when attached, its blocks)
_ATTACHED: dict[int, tuple[weakref.ref, int, int, Blocks]] = {}


@dataclass(frozen=True)
class Blocks:
    """One weight [N, K] as GGUF blocks: ``q`` [N, K/2] (Q4_1: byte i of a block holds weight i in its low
    nibble and 16 + i in its high one) or [N, K] (Q8_0: signed bytes), ``d`` [N, K/32] and ``m``
    [N, K/32] (Q4_1; empty for Q8_0) as float32."""

    kind: int
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantised(self) -> torch.Tensor:
        """The float32 weights [N, K] these blocks stand for (d·q + m, as gguf dequantises)."""
        n, b = self.d.shape
        if self.kind == Q4_1:
            q = self.q.view(n, b, 16)  # [N, B, 16]
            q = torch.cat([q & 15, q >> 4], dim=-1).float()  # [N, B, 32]: weights 0..15, then 16..31
            return (self.d[..., None] * q + self.m[..., None]).view(n, b * BLOCK)
        return (self.d[..., None] * self.q.view(torch.int8).view(n, b, BLOCK).float()).view(n, b * BLOCK)

    def rows(self, index: torch.Tensor) -> Blocks:
        """The blocks of the weight's rows ``index`` (a reduced draft vocabulary's rows of an output layer)."""
        index = index.to("cpu")
        return Blocks(self.kind, self.q[index], self.d[index], self.m[index] if self.m.numel() else self.m)

    def row_matches(self, weight: torch.Tensor, row: int) -> bool:
        """Whether row ``row`` of these blocks dequantises to the bits of ``weight``'s row."""
        one = self.rows(torch.tensor([row])).dequantised()  # [1, K]
        return torch.equal(one.view(torch.int32), weight[row : row + 1].detach().view(torch.int32))


# ---------------------------------------------------------------------- the weights' blocks
def find(weight: torch.Tensor) -> Blocks | None:
    """The blocks attached to ``weight`` while it is unchanged, else None (called once per product)."""
    found = _ATTACHED.get(id(weight))
    if found is None:
        return None
    ref, version, storage, blocks = found
    if ref() is not weight or weight._version != version or weight.data_ptr() != storage:
        return None
    return blocks


def attach(weight: torch.Tensor, blocks: Blocks) -> bool:
    """Attach ``blocks`` to ``weight`` if they dequantise to its exact bits; whether they were."""
    if not usable(weight) or tuple(blocks.d.shape) != (weight.shape[0], weight.shape[1] // BLOCK):
        return False
    with torch.inference_mode():
        if not torch.equal(blocks.dequantised().view(torch.int32), weight.detach().view(torch.int32)):
            return False
    key = id(weight)
    _ATTACHED[key] = (
        weakref.ref(weight, lambda _, key=key: _ATTACHED.pop(key, None)),
        weight._version,
        weight.data_ptr(),
        blocks,
    )
    return True


def detach(weight: torch.Tensor) -> None:
    _ATTACHED.pop(id(weight), None)


def float_matrix(weight: torch.Tensor) -> bool:
    """A contiguous float32 CPU matrix: what the compiled product (``treespec.native_matmul``) reads."""
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
    )


def usable(weight: torch.Tensor) -> bool:
    """A weight blocks can stand for: what the compiled product reads, with rows of whole blocks."""
    return float_matrix(weight) and weight.shape[1] % BLOCK == 0


def spot_check(weights: list[torch.Tensor], row: int) -> int:
    """Compare row ``row`` (modulo each weight's rows) of every weight that has blocks with its blocks,
    detaching those that differ (an edit through ``.data``); how many were detached."""
    dropped = 0
    with torch.inference_mode():
        for weight in weights:
            blocks = find(weight)
            if blocks is not None and not blocks.row_matches(weight, row % weight.shape[0]):
                detach(weight)
                dropped += 1
    return dropped
