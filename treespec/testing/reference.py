"""The target's own greedy decoding: what every lossless test compares with.

``greedy_reference(target, prompt, n)`` is ``model.generate(do_sample=False, max_new_tokens=n)``,
cached per model, prompt, length and EOS setting. ``GreedyReference`` binds it to one target and
explains a mismatch (where two outputs first differ, and the target's logit gap there: about 1e-6
means rounding between two near-tied tokens, more means a bug).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treespec.target import TargetModel

_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, list[int]]] = weakref.WeakKeyDictionary()


def greedy_reference(target: TargetModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The new tokens of the target's own ``generate(do_sample=False)`` after ``prompt``."""
    gen = getattr(target.model, "generation_config", None)
    key = (tuple(prompt), max_new_tokens, repr(getattr(gen, "eos_token_id", None)))
    cache = _CACHE.setdefault(target.model, {})
    if key not in cache:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=target.device)  # [1, L]
        with torch.inference_mode():
            out = target.model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)  # [1, L + n]
        cache[key] = out[0, ids.shape[1] :].tolist()
    return cache[key]


def first_difference(got: Sequence[int], want: Sequence[int]) -> int:
    """The index of the first token where ``got`` and ``want`` differ (or the shorter length)."""
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


class GreedyReference:
    """``greedy_reference`` bound to one target: ``ref(prompt_ids, n)``, ``ref.explain(...)``."""

    def __init__(self, target: TargetModel):
        self.target = target

    def __call__(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        return greedy_reference(self.target, prompt_ids, max_new_tokens)

    def difference(self, prompt_ids: Sequence[int], got: Sequence[int], want: Sequence[int]) -> Difference:
        """Where two outputs first differ, and the target's two best tokens there (a full forward)."""
        i = first_difference(got, want)
        ids = torch.tensor([list(prompt_ids) + list(want[:i])], device=self.target.device)  # [1, L + i]
        with torch.inference_mode():
            logits = self.target.model(ids).logits[0, -1]  # [V]
        top2 = logits.topk(2)
        return Difference(i, list(got[i : i + 3]), list(want[i : i + 3]), top2.indices.tolist(), top2.values.tolist())

    def explain(self, prompt_ids: Sequence[int], got: Sequence[int], want: Sequence[int]) -> str:
        """Where two outputs first differ, with the target's logit gap there."""
        d = self.difference(prompt_ids, got, want)
        return (
            f"first difference at new token {d.index}: got {d.got} want {d.want} "
            f"(lengths {len(got)} vs {len(want)}); target logit gap there {d.gap:.3g}"
        )


@dataclass(frozen=True)
class Difference:
    """The first new token where two outputs differ: the next tokens of each, and the target's two best
    tokens and logits there. A tie is a gap of a few steps of the dtype's rounding at ``logits[0]``."""

    index: int
    got: list[int]
    want: list[int]
    top2: list[int]
    logits: list[float]

    @property
    def gap(self) -> float:
        return self.logits[0] - self.logits[1]

    def is_near_tie(self, dtype: torch.dtype, steps: int = 4) -> bool:
        """Both outputs took one of the two best tokens, whose logits are within ``steps`` rounding steps
        of ``dtype`` at their magnitude: a flip rounding explains, where a bug flips larger gaps."""
        step = torch.finfo(dtype).eps * abs(self.logits[0])
        firsts = {self.got[0], self.want[0]} if self.got and self.want else set()
        return firsts == set(self.top2) and self.gap <= steps * step
