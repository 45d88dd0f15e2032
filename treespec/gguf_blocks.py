"""A GGUF's quantised blocks kept beside the float32 weights they dequantise to, for the compiled product.

Why. A decode step's products read every weight once (``treespec.native_matmul``), so their cost is
the bytes read. SmolLM2's GGUF stores its layers as Q4_1 (5 bits a weight: 32 weights share a float16
scale d and minimum m, w = d·q + m with q of 4 bits) and its output layer as Q8_0 (8.5 bits: w = d·q,
q a signed byte); transformers dequantises them to float32, 32 bits a weight, and treespec's converted
folder keeps those floats (``treespec.gguf``). The compiled product can read the blocks instead and
produce the bits it produces on the floats: d·q is exact in float32 (11 + 4 or 8 significant bits), so
d·q + m rounds once however it is computed and each weight has the float's bits, and every block's
weights are multiplied and summed in the float kernel's order (``csrc/few_rows.c``, the block section).
SmolLM2's 211 matrices by 1, 2, 4, 8 and 16 rows on this repository's Xeon (2 threads): 21.2, 22.3,
23.4, 27.8, 39.2 ms from the floats, 7.1, 7.9, 8.5, 13.6, 24.8 ms from the blocks, every output equal
(1,899 products compared bit for bit).

How. ``prepare(model)`` runs when a target is wrapped (``treespec.target``). For a model loaded from a
folder treespec converted from a GGUF file (its ``treespec-gguf.json`` names the file), it reads
``treespec-blocks/blocks.safetensors`` in that folder (a subfolder: vLLM, for one, loads every
top-level ``*.safetensors`` of a model folder as weights), or builds it once from the GGUF file: each of the model's
linear weights is matched row by row with the file's Q4_1 and Q8_0 tensors, by the bits of the rows
gguf dequantises (no tensor names: llama.cpp's names and its q/k row order are whatever the file has),
and the matching rows' blocks are kept (SmolLM2: 111 MB beside the 538 MB of floats, 4.3 s once).
A weight gets its blocks only if they dequantise to its exact bits (checked then, 0.3–0.6 s for
SmolLM2); afterwards the product uses them only while the weight is the same tensor at the same
version and storage (an in-place change through torch drops them), and ``spot_check`` compares one row
of every weight with its blocks at each new sequence (an edit through ``.data``, which torch does not
count, drops them too). Without the compiled product, a GGUF, the ``gguf`` package, or with
``TREESPEC_GGUF_BLOCKS=off``: nothing is attached and the floats are read as before.
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Q4_1, Q8_0 = 3, 8  # ggml's type numbers, as the kernel takes them
KINDS = {Q4_1: ("Q4_1", 20), Q8_0: ("Q8_0", 34)}  # bytes per block of 32 weights: float16 d (and m), then q
BLOCK = 32
#: in the converted folder, one level down: tools that read a model folder load every top-level
#: ``*.safetensors`` as weights (vLLM does), so the folder keeps exactly one, ``model.safetensors``
FILE = Path("treespec-blocks") / "blocks.safetensors"
FORMAT = 1  # of FILE: a file of another format is built again

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


def enabled() -> bool:
    """``TREESPEC_GGUF_BLOCKS``: on (the default) or off."""
    return os.environ.get("TREESPEC_GGUF_BLOCKS", "on").strip().lower() not in ("off", "0", "false", "no")


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


def usable(weight: torch.Tensor) -> bool:
    """What the compiled product reads (``native_matmul.usable``), with rows of whole blocks."""
    from treespec import native_matmul  # imported lazily: native_matmul looks blocks up here

    return native_matmul.usable(weight) and weight.shape[1] % BLOCK == 0


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


# ---------------------------------------------------------------------- a model's blocks
def linear_weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's plain linear layers' weights that blocks can stand for, by parameter name."""
    return {
        f"{name}.weight" if name else "weight": module.weight
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and usable(module.weight)
    }


def prepare(model: Any, log: Any = None) -> int:
    """Attach the GGUF's blocks to a model loaded from a folder treespec converted (see the module doc);
    how many weights have them. Never raises: without blocks the floats are read as before."""
    from treespec import native_matmul
    from treespec.gguf import MARKER

    loaded_from = str(getattr(model, "name_or_path", "") or "")  # its folder ("": built in memory)
    folder = Path(loaded_from)
    if not loaded_from or not enabled() or not native_matmul.available() or not (folder / MARKER).is_file():
        return 0
    weights = linear_weights(model)
    try:
        meta = json.loads((folder / MARKER).read_text())
        stored = load(folder / FILE, meta["sha256"])
        if stored is None:
            stored = build(Path(meta["source"]), weights, log or _stderr)
            _save(folder / FILE, stored, meta["sha256"])
    except Exception:  # noqa: BLE001 - a moved or unreadable GGUF, no gguf package, a read-only cache
        return 0
    return sum(attach(weights[name], blocks) for name, blocks in stored.items() if name in weights)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build(path: Path, weights: dict[str, torch.Tensor], log: Any = None) -> dict[str, Blocks]:
    """The blocks of each weight whose every row is a row of one of ``path``'s Q4_1 or Q8_0 tensors (matched
    by the bits gguf dequantises that row to)."""
    import gguf
    import numpy as np

    began = time.perf_counter()
    reader = gguf.GGUFReader(str(path))
    raws: list[tuple[int, Any]] = []  # (kind, [N, bytes per row])
    rows: dict[int, tuple[int, int]] = {}  # hash of a dequantised row's bytes -> (tensor, row)
    for tensor in reader.tensors:
        kind = int(tensor.tensor_type)
        if kind not in KINDS:
            continue
        raw = np.asarray(tensor.data)  # [N, bytes per row] uint8
        floats = gguf.quants.dequantize(raw, tensor.tensor_type).astype(np.float32, copy=False)  # [N, K]
        for r in range(floats.shape[0]):
            rows.setdefault(hash(floats[r].tobytes()), (len(raws), r))
        raws.append((kind, raw))
    found: dict[str, Blocks] = {}
    for name, weight in weights.items():
        w = weight.detach().numpy()  # [N, K]
        hits = [rows.get(hash(w[r].tobytes())) for r in range(w.shape[0])]
        if any(h is None for h in hits) or len({raws[i][0] for i, _ in hits}) != 1:
            continue  # not from this file, or rows of two types: the floats stay
        kind = raws[hits[0][0]][0]
        found[name] = from_gguf_rows(kind, np.stack([raws[i][1][r] for i, r in hits]))  # [N, bytes per row]
    if log is not None:
        log(f"kept the GGUF's blocks of {len(found)} of {len(weights)} matrices in {time.perf_counter() - began:.1f} s")
    return found


def from_gguf_rows(kind: int, raw: Any) -> Blocks:
    """Blocks from GGUF rows [N, bytes per row] as stored: per block float16 d (and m), then the q bytes."""
    import numpy as np

    n, size = raw.shape[0], KINDS[kind][1]
    blocks = raw.reshape(n, -1, size)  # [N, B, bytes per block]
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))  # [N, B]
    start = 4 if kind == Q4_1 else 2
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., start:]).reshape(n, -1))  # [N, K/2] or [N, K]
    if kind == Q4_1:
        m = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
    else:
        m = torch.empty(0)
    return Blocks(kind, q, d, m)


def _save(path: Path, blocks: dict[str, Blocks], sha256: str) -> None:
    """Write FILE atomically beside the converted weights (a read-only cache: kept in memory only)."""
    from safetensors.torch import save_file

    tensors, kinds = {}, {}
    for name, b in blocks.items():
        tensors[f"{name}.q"], tensors[f"{name}.d"] = b.q, b.d
        if b.kind == Q4_1:
            tensors[f"{name}.m"] = b.m
        kinds[name] = b.kind
    meta = {"format": str(FORMAT), "sha256": sha256, "kinds": json.dumps(kinds)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def load(path: Path, sha256: str) -> dict[str, Blocks] | None:
    """FILE's blocks if it was built from the GGUF file of this digest in this format, else None."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != str(FORMAT) or meta.get("sha256") != sha256:
            return None
        kinds = json.loads(meta["kinds"])
        return {
            name: Blocks(
                kind,
                f.get_tensor(f"{name}.q"),
                f.get_tensor(f"{name}.d"),
                f.get_tensor(f"{name}.m") if kind == Q4_1 else torch.empty(0),
            )
            for name, kind in kinds.items()
        }
