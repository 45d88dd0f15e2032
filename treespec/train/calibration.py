"""Calibrating a drafter's confidence to greedy acceptance: q = softmax(logits / T).

OPT-Tree and EAGLE-2 rank candidate nodes by p̂ = Π q along the path and OPT-Tree stops adding
layers when E(A) = Σ p̂ grows by less than δ, so q must mean what it says: under greedy verification
a drafted token x is kept iff x is the target's argmax, so the q a builder should see is
P(argmax = x). Drafters are rarely calibrated that way. An EAGLE head regresses features, predicts
their conditional mean and so has shrunk logits (top-1 right 90% of the time at q far below 0.9). A
small draft model trained on the same data spreads its mass over the tokens the data could continue
with, while greedy decoding always takes the mode, which the draft often shares (treespec-py-draft's
mean top-1 q is below its top-1 agreement with the target: docs/drafters.md). Under-stated acceptance
stops OPT-Tree a layer or two early and misranks nodes for EAGLE-2.

One scalar fixes most of it. T minimises the negative log-likelihood of the target's greedy token
under softmax(z / T) on positions the target generated (a proper score, so the fitted q matches the
observed acceptance on average). The NLL is convex in β = 1/T (a log-sum-exp of linear functions of
β minus a linear one), so a golden-section search on log β finds it. T changes trees only: what is
accepted is decided by the target, so decoding stays lossless at any T.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from treespec.train.acceptance import greedy_positions

T_RANGE = (0.02, 20.0)  # the search interval for T (β = 1/T in [0.05, 50])


def nll(z: torch.Tensor, y: torch.Tensor, temperature: float) -> float:
    """Mean −log softmax(z / T)[y] over the rows of ``z`` [n, V] with labels ``y`` [n]."""
    return float(F.cross_entropy(z.float() / temperature, y))


def fit_temperature(z: torch.Tensor, y: torch.Tensor, iterations: int = 40) -> float:
    """The T in ``T_RANGE`` that minimises ``nll(z, y, T)``: golden-section search on log β, β = 1/T.

    ``z``: logits [n, V] at positions the target generated; ``y``: the target's greedy token there [n].
    """
    if z.ndim != 2 or y.ndim != 1 or z.shape[0] != y.shape[0] or z.shape[0] == 0:
        raise ValueError(f"need logits [n, V] and labels [n] with n > 0, got {tuple(z.shape)} and {tuple(y.shape)}")
    z = z.float()

    def loss(log_beta: float) -> float:
        return float(F.cross_entropy(z * math.exp(log_beta), y))

    lo, hi = math.log(1 / T_RANGE[1]), math.log(1 / T_RANGE[0])
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(iterations):
        if fa < fb:  # the minimum lies in [lo, b]
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:  # in [a, hi]
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    return 1.0 / math.exp((lo + hi) / 2)


@dataclass
class Calibration:
    """What ``calibrate_draft`` measured: the fitted T and how well q predicts acceptance before and after."""

    temperature: float
    positions: int  # generated positions the fit used
    prompts: int  # prompts whose continuations were used
    nll_t1: float  # NLL of the target's greedy token under the raw softmax (T = 1)
    nll: float  # ... under softmax(z / T)
    top1: float  # fraction of positions where the draft's argmax is the target's token (T leaves it alone)
    mean_q_top1_t1: float  # the draft's mean top-1 q at T = 1: compare with top1
    mean_q_top1: float  # ... at the fitted T


MAX_LOGITS = 1 << 26  # logits kept for the fit: 256 MB in float32 (16,384 positions of a 4,096 vocabulary)


@torch.inference_mode()
def calibrate_draft(
    target_model: Any,
    draft_model: Any,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    max_positions: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Calibration:
    """Fit the draft model's greedy-acceptance temperature on the target's own greedy continuations
    (``target_model``/``draft_model``: causal LMs, or a ``TargetModel`` / ``model`` drafter).

    The fit reads the draft's logits [n, V] before every token the target generates greedily
    (``treespec.acceptance.greedy_positions``) and stops once ``max_positions`` positions are
    collected (default: 16,384, fewer when V × 16,384 exceeds ``MAX_LOGITS``). Tokens the draft
    cannot produce are left out: they say nothing about T."""
    zs, ys, n, used = [], [], 0, 0
    for i, (z, chosen, vocab) in enumerate(greedy_positions(target_model, draft_model, prompts_ids, max_new_tokens)):
        if max_positions is None:
            max_positions = max(1024, min(16384, MAX_LOGITS // vocab))
        inside = chosen < vocab
        zs.append(z[inside].cpu())  # [G', V]
        ys.append(chosen[inside].cpu())  # [G']
        n += int(inside.sum())
        used += 1
        if progress is not None:
            progress(i + 1, len(prompts_ids))
        if n >= max_positions:
            break
    if n == 0:
        raise ValueError("no generated positions to calibrate on: give non-empty prompts")
    z, y = torch.cat(zs)[:max_positions], torch.cat(ys)[:max_positions]  # [n, V], [n]
    t = fit_temperature(z, y)
    q1 = torch.softmax(z, dim=-1).amax(dim=-1).mean()  # [n] → mean top-1 q at T = 1
    qt = torch.softmax(z / t, dim=-1).amax(dim=-1).mean()
    return Calibration(
        temperature=t,
        positions=int(y.shape[0]),
        prompts=used,
        nll_t1=nll(z, y, 1.0),
        nll=nll(z, y, t),
        top1=float((z.argmax(dim=-1) == y).float().mean()),
        mean_q_top1_t1=float(q1),
        mean_q_top1=float(qt),
    )
