"""The target's own greedy decoding: what every lossless test compares with.

``greedy_reference(target, prompt, n)`` is ``model.generate(do_sample=False, max_new_tokens=n)``,
cached per model, prompt, length and EOS setting. ``GreedyReference`` binds it to one target and
explains a mismatch (where two outputs first differ, and the target's logit gap there: about 1e-6
means rounding between two near-tied tokens, more means a bug).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
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

    def explain(self, prompt_ids: Sequence[int], got: Sequence[int], want: Sequence[int]) -> str:
        """Where two outputs first differ, with the target's logit gap there."""
        i = first_difference(got, want)
        ids = torch.tensor([list(prompt_ids) + list(want[:i])], device=self.target.device)  # [1, L + i]
        with torch.inference_mode():
            logits = self.target.model(ids).logits[0, -1]  # [V]
        top2 = logits.topk(2).values
        return (
            f"first difference at new token {i}: got {list(got[i : i + 3])} want {list(want[i : i + 3])} "
            f"(lengths {len(got)} vs {len(want)}); target logit gap there {float(top2[0] - top2[1]):.3g}"
        )
