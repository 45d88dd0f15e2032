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
version and storage (an in-place change through torch drops them), and ``weight_blocks.spot_check`` compares one row
of every weight with its blocks at each new sequence (an edit through ``.data``, which torch does not
count, drops them too). Without the compiled product, a GGUF, the ``gguf`` package, or with
``TREESPEC_GGUF_BLOCKS=off``: nothing is attached and the floats are read as before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from treespec import native_matmul
from treespec.weight_blocks import KINDS, Q4_1, Blocks, attach, usable

#: in the converted folder, one level down: tools that read a model folder load every top-level
#: ``*.safetensors`` as weights (vLLM does), so the folder keeps exactly one, ``model.safetensors``
FILE = Path("treespec-blocks") / "blocks.safetensors"
FORMAT = 1  # of FILE: a file of another format is built again


def enabled() -> bool:
    """``TREESPEC_GGUF_BLOCKS``: on (the default) or off."""
    return os.environ.get("TREESPEC_GGUF_BLOCKS", "on").strip().lower() not in ("off", "0", "false", "no")


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
