"""A reduced draft vocabulary for EAGLE-1/2 heads: draft over the N tokens the target says most often.

The head's output layer is the target's, and for a model like SmolLM2-135M it is a fifth of the
target's weights (49,152 × 576): every full-vocabulary draft depth reads all of it. Restricting the
draft's softmax to the most frequent target tokens (FR-Spec, Zhao et al. 2025, arXiv 2502.14856;
EAGLE-3's ``d2t`` does the same with a trained output layer) costs N/V of that, and loses only the
steps whose target token is outside the subset. Losslessness never depends on it: the draft only
proposes, the target verifies.

On disk: ``draft_vocab.safetensors`` beside the head, one int64 tensor ``ids`` [N] of target token ids,
most frequent first (ranked on the target's own generations by ``treespec train eagle --draft-vocab``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from treespec.errors import ConfigError
from treespec.files import save_safetensors_atomic

FILE = "draft_vocab.safetensors"


def rank_tokens(sequences: Iterable[torch.Tensor], vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids in ``sequences`` (ties: lower id first), padded with the lowest
    unseen ids if fewer were seen: [size] int64."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq.tolist())
    ranked = sorted((t for t in counts if 0 <= t < vocab), key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:
        seen = set(ranked)
        ranked += [t for t in range(vocab) if t not in seen][: size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.long)


def save(out: Path, ids: torch.Tensor) -> None:
    """The ranked ids beside a head's weights, written atomically."""
    save_safetensors_atomic({"ids": ids.to(torch.long).contiguous()}, Path(out) / FILE)


def load(folder: Path, vocab: int, name: str) -> torch.Tensor | None:
    """The ranked ids of a head folder, or None when it has none; a damaged file is one line."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        ids = load_file(str(path))["ids"]
    except Exception as exc:  # noqa: BLE001 - truncated, not safetensors, no "ids"
        raise ConfigError(
            f"EAGLE head {name!r}: {path} is not a draft vocabulary ({type(exc).__name__}); "
            "delete it, or retrain with --draft-vocab"
        ) from None
    if (
        ids.dim() != 1
        or ids.dtype != torch.long
        or ids.numel() == 0
        or int(ids.min()) < 0
        or int(ids.max()) >= vocab
        or ids.unique().numel() != ids.numel()
    ):
        raise ConfigError(
            f"EAGLE head {name!r}: {path} must hold distinct token ids below {vocab}; "
            "delete it, or retrain with --draft-vocab"
        )
    return ids
