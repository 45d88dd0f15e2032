"""Sampling settings, the target's processed distribution, and children drawn from the draft.

* ``SamplingParams``: temperature, top-k, top-p, applied exactly as Hugging Face's
  ``generate(do_sample=True)`` applies them: logits cast to float32, then transformers' own
  ``TemperatureLogitsWarper`` → ``TopKLogitsWarper`` → ``TopPLogitsWarper`` (the order of
  ``GenerationMixin._get_logits_processor``, ``min_tokens_to_keep=1``), then a softmax.
* ``DraftSampling``: what a builder that draws children at random needs (the draft's temperature and
  the run's ``torch.Generator``); the Decoder hands it over through ``TreeBuilder.start``.
* ``draw_children``: k children drawn *without replacement* from a draft distribution, by
  Gumbel-top-k (exactly sequential sampling without replacement), in draw order.
* ``sample_rows``: one token per row of a probability tensor (inverse CDF in float64).

See docs/sampling.md for the verification rules and their exactness argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from treespec.errors import ConfigError
from treespec.inputs import real_number, seed_value

if TYPE_CHECKING:
    from treespec.interfaces import Drafter, Proposals
    from treespec.tree import DraftTree

#: verification rules of the sampling verifier (docs/sampling.md)
RULES = ("auto", "specinfer", "deterministic", "target-only", "block", "traversal")


class IgnoredOptionWarning(UserWarning):
    """A sampling option was given that greedy decoding does not use."""


def check_sampling(
    temperature: float | None,
    top_p: float | None = None,
    top_k: int | None = None,
    draft_temperature: float | None = None,
    rule: str = "auto",
    samples_children: bool = False,
) -> tuple[SamplingParams | None, list[str]]:
    """The one place sampling settings are validated (API, ``run``, ``bench``). Returns the target's
    ``SamplingParams`` (None: greedy) and a note per option that greedy decoding ignores; a value
    that is invalid whatever the temperature is a ``ConfigError``."""
    if not isinstance(rule, str) or rule not in RULES:
        raise ConfigError(f"unknown verification rule {rule!r}; rules: {', '.join(RULES)}")
    temperature, draft_temperature = (
        real_number("temperature", temperature),
        real_number("draft_temperature", draft_temperature),
    )
    top_p = real_number("top_p", top_p)
    if temperature is not None and not temperature >= 0:  # also catches NaN
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if draft_temperature is not None and not (0 < draft_temperature < float("inf")):
        raise ConfigError(f"draft_temperature must be > 0, got {draft_temperature}")
    if not temperature:
        SamplingParams(temperature=1.0, top_k=0 if top_k is None else top_k, top_p=1.0 if top_p is None else top_p)
        ignored = [
            f"top_p={top_p}" if top_p not in (None, 1, 1.0) else "",
            f"top_k={top_k}" if top_k not in (None, 0) else "",
            f"draft_temperature={draft_temperature}" if draft_temperature is not None else "",
            f"rule={rule}" if rule != "auto" else "",
            "the builder's sample=true" if samples_children else "",
        ]
        notes = [
            f"{what} has no effect with greedy decoding (temperature 0): set a temperature > 0 to sample"
            for what in ignored
            if what
        ]
        return None, notes
    params = SamplingParams(
        temperature=float(temperature),
        top_k=0 if top_k is None else top_k,
        top_p=1.0 if top_p is None else float(top_p),
    )
    return params, []


@dataclass(frozen=True)
class SamplingParams:
    """The target's sampling settings. ``top_k = 0`` and ``top_p = 1`` switch those filters off
    (Hugging Face's ``generate`` defaults to top_k=50 when none is given: pass ``top_k=50`` to match)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0
        ):
            raise ConfigError(
                f"temperature must be a finite number > 0 for sampling (0 = greedy), got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 <= self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in [0, 1] (1 = off), got {self.top_p}")

    @cached_property
    def processors(self) -> list:
        """transformers' own warpers, in ``generate``'s order (temperature, top-k, top-p)."""
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out = []
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k != 0:
            out.append(TopKLogitsWarper(top_k=int(self.top_k), min_tokens_to_keep=1))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=float(self.top_p), min_tokens_to_keep=1))
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution ``generate(do_sample=True)`` samples from: [..., V] logits → [..., V] float32."""
        shape = logits.shape
        scores = logits.reshape(-1, shape[-1]).to(torch.float32)  # [R, V], as generate casts them
        for proc in self.processors:
            scores = proc(None, scores)  # the warpers ignore input_ids
        return torch.softmax(scores, dim=-1).reshape(shape)


@dataclass(frozen=True)
class DraftSampling:
    """Draft-side settings of one sampled ``generate`` call, for builders that draw children."""

    temperature: float  # the draft distribution is sharpened/flattened to q^(1/T) before drawing
    generator: torch.Generator


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``; without a seed, from torch's global RNG (so
    ``torch.manual_seed`` makes a run reproducible, as with Hugging Face's ``generate``)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    seed = seed_value(seed)
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


def uniform(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """U[0, 1) of ``shape`` drawn on the generator's device, moved to ``device``."""
    return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def sample_rows(probs: torch.Tensor, generator: torch.Generator, n: int | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ([..., V], rows need not be normalised; each must have mass > 0),
    or ``n`` independent tokens per row ([..., n]).

    Inverse CDF in float64: the first index whose cumulative mass exceeds u · total, so a token of
    probability 0 is never returned.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [..., V]
    u = uniform(tuple(probs.shape[:-1]) + (n or 1,), generator, probs.device)  # [..., n]
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)  # [..., n], u · total < total
    idx = idx.clamp_(max=probs.shape[-1] - 1)
    return idx if n is not None else idx.squeeze(-1)


def with_temperature(dist: torch.Tensor, temperature: float) -> torch.Tensor:
    """q^(1/T), renormalised: the distribution of logits/T given the probabilities of the logits."""
    if temperature == 1.0:
        return dist
    out = torch.softmax(torch.log(dist.to(torch.float32)) / temperature, dim=-1)
    return torch.nan_to_num(out, nan=0.0)  # an all-zero row (a drafter with nothing to offer) stays zero


def draw_children(dist: torch.Tensor, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw k distinct tokens per row of ``dist`` ([M, V]) without replacement, in draw order.

    Gumbel-top-k: the k largest of log q + Gumbel noise are distributed exactly as k sequential draws
    without replacement (draw x1 ~ q, then x2 ~ q with x1 removed and renormalised, ...). Returns
    tokens [M, k] and their probabilities q [M, k] under ``dist``; if a row has fewer than k tokens
    with q > 0, its last columns have q = 0 (padding, always a suffix).
    """
    m, v = dist.shape
    k = min(k, v)
    u = uniform((m, v), generator, dist.device).clamp_(min=1e-300, max=1.0 - 2.0**-53)
    keys = torch.log(dist.to(torch.float64)) - torch.log(-torch.log(u))  # [M, V]; q = 0 → -inf
    tokens = keys.topk(k, dim=-1).indices  # [M, k] in draw order
    return tokens, dist.gather(-1, tokens)


def recorded_draft(
    draw_dist: torch.Tensor, rows: int | torch.Tensor, vocab: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] (``rows`` an int) or [B, P, V] (``rows`` [P]) float64: the distributions children were
    drawn from (``draw_dist`` [B, R, V']), padded with q = 0 or cut to the target's vocabulary ``vocab``
    (a draft with a smaller vocabulary cannot draw the tokens it lacks)."""
    q = draw_dist[:, rows].to(device=device, dtype=torch.float64)  # [B, (P,) V']
    if q.shape[-1] < vocab:
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
    return q[..., :vocab]


def drawn_from(
    q0: torch.Tensor | None, x: torch.Tensor, vocab: int, removed: torch.Tensor | None = None
) -> torch.Tensor:
    """[..., V] float64: the distribution the child with token x [...] was drawn from: the recorded
    draft ``q0`` [..., V] with the earlier siblings' tokens (``removed`` [..., V] bool) taken out and
    renormalised; the point mass at x for a ranked child (``q0`` None), or for a token that
    distribution could not have drawn (a deterministic proposal, q = 1)."""
    dev = q0.device if q0 is not None else x.device
    x = x.to(dev)
    point = torch.zeros(*x.shape, vocab, dtype=torch.float64, device=dev).scatter_(-1, x[..., None], 1.0)  # [..., V]
    if q0 is None:
        return point
    q = q0 if removed is None else q0.masked_fill(removed, 0.0)  # [..., V]
    q = q / q.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    return torch.where(q.gather(-1, x[..., None]) > 0, q, point)


def propose(
    drafter: Drafter, tree: DraftTree, nodes: torch.Tensor, k: int, sampling: DraftSampling | None
) -> Proposals:
    """What a builder that can sample asks for: the drafter's ranked top-k (``sampling`` None), or
    children drawn from the draft (``sampled_expand``)."""
    if sampling is None:
        return drafter.expand(tree, nodes, k)
    return sampled_expand(drafter, tree, nodes, k, sampling)


def sampled_expand(
    drafter: Drafter, tree: DraftTree, nodes: torch.Tensor, k: int, sampling: DraftSampling
) -> Proposals:
    """``drafter.expand`` for builders that sample: up to k children per node drawn without
    replacement from the draft's distribution at ``sampling.temperature``, in draw order.

    Records the distribution drawn from in ``tree`` (``DraftTree.record_draws``), so the caller must
    add each node's children as a prefix of the draw order (q = 0 padding dropped, always a suffix)
    and give those nodes no other children.
    """
    from treespec.interfaces import Proposals

    drafter.expand(tree, nodes, k)  # feeds the nodes; the ranked proposals are not used
    dist = drafter.distribution(tree, nodes)
    if dist is None:
        raise ConfigError(
            f"drafter {type(drafter).__name__} has no full distribution to sample children from "
            "(the model, self, eagle and eagle3 drafters have one): use the builder without sample=true"
        )
    dist = with_temperature(dist, sampling.temperature)  # [M, V]
    tokens, q = draw_children(dist, k, sampling.generator)
    tree.record_draws(nodes, dist)
    return Proposals(tokens=tokens.cpu(), q=q.float().cpu())
