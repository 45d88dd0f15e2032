"""One decoding step, in one place: draft → verify → commit.

Everything that steps (``Decoder.generate``, ``Decoder.draft_and_verify`` behind ``treespec tree
show``, the drafter conformance kit in ``treespec.testing``) calls these functions; nothing else
re-implements them. Read them top to bottom:

    prefill(target, drafter, prompt)            the target caches prompt[:-1]; the drafter sees the prompt
    step(target, drafter, builder, root, ...)   one step:
      draft()    drafter.begin_step(root); tree = builder.build(drafter, root, max_depth)
      verify()   ONE target forward over the tree (tree attention mask, positions = past + depth),
                 then the acceptance rule picks the accepted path and the bonus token
      commit()   the target keeps the KV rows of the accepted path; the drafter is told the accepted
                 tokens + bonus (with the target's hidden states if it asked for them)

Who owns what: the target owns its KV cache (``treespec.target``), the drafter owns all of its own
state (``treespec.interfaces.Drafter``), the builder owns only the tree's shape. The acceptance rule
is a parameter (``greedy`` or ``sampling_rule(...)``; the conformance kit passes rules of its own), and
the time of each phase goes to one small ``Clock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from treespec.errors import TreespecError
from treespec.inference import inference
from treespec.interfaces import Commit, Drafter, PrefillContext, TreeBuilder
from treespec.tree import DraftTree, TreeTensors
from treespec.verify import Acceptance, greedy_verify, sampling_verify

if TYPE_CHECKING:
    from treespec.sampling import SamplingParams
    from treespec.target import TargetModel

#: picks the accepted path and the bonus token from the tree and the target's logits [N, V]
AcceptRule = Callable[[DraftTree, TreeTensors, torch.Tensor], Acceptance]


def greedy(tree: DraftTree, tt: TreeTensors, logits: torch.Tensor) -> Acceptance:
    """The longest path the target's argmax agrees with, plus its argmax after it (lossless greedy)."""
    return greedy_verify(tt, logits)


def sampling_rule(params: SamplingParams, generator: torch.Generator, rule: str = "auto") -> AcceptRule:
    """Exact speculative sampling with ``params`` and verification ``rule`` (docs/sampling.md)."""

    def accept(tree: DraftTree, tt: TreeTensors, logits: torch.Tensor) -> Acceptance:
        return sampling_verify(tt, logits, params, generator, rule)

    return accept


class Clock:
    """Seconds spent per phase of a step: ``clock.lap("verify")`` books the time since the previous lap
    (or since the clock started) to that phase. Laps, not context managers: a step has half a dozen
    phases, and on a plain step each ``with`` block would cost more than the bookkeeping it times."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


@dataclass(frozen=True)
class Verdict:
    """What the target said about one tree."""

    tree: DraftTree
    acceptance: Acceptance  # the accepted path (root first) and the bonus token
    hidden: torch.Tensor | None  # [N, H] the target's last hidden states, if the drafter needs them


@dataclass(frozen=True)
class Step:
    """One finished step: the tree, the verdict, the tokens it committed and where the time went."""

    verdict: Verdict
    tokens: list[int]  # accepted draft tokens + the bonus token (empty if not committed)
    seconds: dict[str, float]

    @property
    def tree(self) -> DraftTree:
        return self.verdict.tree

    @property
    def acceptance(self) -> Acceptance:
        return self.verdict.acceptance


def hidden_request(drafter: Drafter) -> bool | tuple[int, ...]:
    """What to ask the target for: False (no hidden states), True (the last layer's) or the indices of
    the layers whose hidden states the drafter wants concatenated (``Drafter.target_hidden_layers``)."""
    if not drafter.needs_target_hidden:
        return False
    return tuple(drafter.target_hidden_layers) if drafter.target_hidden_layers else True


@inference
def prefill(target: TargetModel, drafter: Drafter, prompt: list[int]) -> None:
    """Start a sequence: the target caches ``prompt[:-1]`` (the last token is the first root) and the
    drafter gets the whole prompt, with the target's hidden states of ``prompt[:-1]`` if it asks."""
    ids = torch.tensor(prompt, dtype=torch.long)  # [L]
    hidden = target.prefill(ids[:-1], want_hidden=hidden_request(drafter))  # [L-1, H] or None
    drafter.prefill(PrefillContext(input_ids=ids, hidden=hidden))


def draft(drafter: Drafter, builder: TreeBuilder, root: int, max_depth: int) -> DraftTree:
    """Tell the drafter a step starts at ``root``, then let the builder grow the tree with it."""
    drafter.begin_step(root)
    tree = builder.build(drafter, root, max_depth=max_depth)
    if tree.depth > max_depth:
        raise TreespecError(
            f"builder {type(builder).__name__} returned a tree of depth {tree.depth} > max_depth {max_depth}"
        )
    return tree


def verify(
    target: TargetModel, tree: DraftTree, accept: AcceptRule, want_hidden: bool | tuple[int, ...], clock: Clock
) -> Verdict:
    """ONE target forward over every node of ``tree``, then ``accept`` decides."""
    clock.lap("bookkeeping")  # whatever came before, up to here
    tt = tree.tensors(target.past_len, dtype=target.dtype)
    clock.lap("bookkeeping")
    logits, hidden = target.forward_tree(tt, want_hidden=want_hidden)  # [N, V], [N, H] or None
    clock.lap("verify")
    verdict = Verdict(tree=tree, acceptance=accept(tree, tt, logits), hidden=hidden)
    clock.lap("bookkeeping")
    return verdict


def commit(target: TargetModel, drafter: Drafter, verdict: Verdict) -> list[int]:
    """Target and drafter keep the accepted path; returns accepted tokens + bonus (the next root)."""
    acc = verdict.acceptance
    target.commit(acc.nodes)
    tokens = acc.tokens + [acc.bonus]
    hidden = verdict.hidden[acc.nodes.to(verdict.hidden.device)] if verdict.hidden is not None else None  # [m+1, H]
    drafter.commit(Commit(tokens=tokens, hidden=hidden))
    return tokens


@inference  # once per step: the target's and drafter's own decorated methods do not enter it again
def step(
    target: TargetModel,
    drafter: Drafter,
    builder: TreeBuilder,
    root: int,
    max_depth: int,
    accept: AcceptRule = greedy,
    *,
    keep: bool = True,
) -> Step:
    """One decoding step from the last committed token ``root``; no node deeper than ``max_depth``.
    ``keep=False`` stops after verification (nothing committed: for inspection)."""
    clock = Clock()
    tree = draft(drafter, builder, root, max_depth)
    clock.lap("draft")
    verdict = verify(target, tree, accept, hidden_request(drafter), clock)
    builder.verified(tree, verdict.acceptance.nodes)
    tokens = commit(target, drafter, verdict) if keep else []
    clock.lap("bookkeeping")
    return Step(verdict=verdict, tokens=tokens, seconds=clock.seconds)
