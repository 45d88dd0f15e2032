"""One decoding step, in one place: draft → verify → commit, for one row or many.

Everything that steps (the decode loop ``treespec.engine`` for one prompt or a batch, ``treespec
tree show``, the cost measurement, the conformance kits in ``treespec.testing``) calls these functions;
nothing else re-implements them. Read them top to bottom:

    prefill_rows(target, drafters, prompts)   the target caches each prompt[:-1]; each drafter sees its prompt
    step_rows(target, rows, builders, roots, ...)   one step of B rows (B = 1: one sequence):
      draft     every row's builder grows its tree with its drafter (``lockstep.draft_rows``: with a
                batching drafter, one draft forward per tree level for all rows)
      verify    ONE target forward over every row's tree (tree attention mask, positions = row length
                + depth), then each row's acceptance rule picks its accepted path and bonus token
      commit    the target keeps each row's accepted KV rows; each drafter is told its row's accepted
                tokens + bonus (with the target's hidden states if it asked for them)
    step(target, drafter, builder, root, ...)  the same for one sequence on a ``TargetModel``

Who owns what: the target owns its KV cache (``treespec.target``; ``treespec.batch_target`` for rows,
which keeps one row on the single sequence's own fast path), the drafter owns all of its own state
(``treespec.interfaces.Drafter``), the builder owns only the tree's shape. The acceptance rule is a
parameter (``greedy`` or ``sampling_rule(...)``; the conformance kit passes rules of its own), and the
time of each phase goes to one small ``Clock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from treespec import lockstep
from treespec.batch_target import BatchTarget
from treespec.inference import inference
from treespec.interfaces import Commit, Drafter, DraftRows, PrefillContext, TreeBuilder
from treespec.lockstep import draft
from treespec.tree import DraftTree, TreeTensors
from treespec.verify import Acceptance, greedy_rows, greedy_verify, sampling_verify

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
def prefill_rows(target: BatchTarget, drafters: list[Drafter], prompts: list[list[int]], *, join: bool = False) -> None:
    """Start sequences: the target caches each ``prompt[:-1]`` (the last token is the row's first root)
    and each row's drafter gets its whole prompt, with the target's hidden states of ``prompt[:-1]`` if
    it asks. ``join``: the rows join those already in flight (``BatchTarget.add``)."""
    start = target.add if join else target.prefill
    hidden = start(prompts, want_hidden=hidden_request(drafters[0]))  # per row [L-1, H] or None
    for drafter, prompt, h in zip(drafters, prompts, hidden):
        drafter.prefill(PrefillContext(input_ids=torch.tensor(prompt, dtype=torch.long), hidden=h))


def prefill(target: TargetModel, drafter: Drafter, prompt: list[int]) -> None:
    """``prefill_rows`` for the one sequence ``target`` holds."""
    prefill_rows(BatchTarget(target, single=True), [drafter], [prompt])


def verify_rows(
    target: BatchTarget,
    trees: list[DraftTree],
    accepts: list[AcceptRule],
    want_hidden: bool | tuple[int, ...],
    clock: Clock,
) -> list[Verdict]:
    """ONE target forward over every row's tree, then each row's rule decides (greedy rows of a batch
    in one pass: ``verify.greedy_rows``)."""
    clock.lap("bookkeeping")  # whatever came before, up to here
    tts = [tree.tensors(n, dtype=target.dtype) for tree, n in zip(trees, target.row_lens())]
    clock.lap("bookkeeping")
    logits, hidden = target.forward_trees(tts, want_hidden)  # [B, N_max, V]; per row [N_b, ·] or None
    clock.lap("verify")
    if len(trees) > 1 and all(a is greedy for a in accepts):
        accs = greedy_rows(tts, logits)
    else:  # each row's own rule (and generator)
        accs = [a(tree, tt, logits[i, : len(tree)]) for i, (a, tree, tt) in enumerate(zip(accepts, trees, tts))]
    clock.lap("bookkeeping")
    return [Verdict(tree=t, acceptance=a, hidden=h) for t, a, h in zip(trees, accs, hidden)]


def commit_rows(target: BatchTarget, drafters: list[Drafter], verdicts: list[Verdict]) -> list[list[int]]:
    """The target keeps every row's accepted path, each drafter its own; returns each row's accepted
    tokens + bonus (the last one is the row's next root)."""
    target.commit([v.acceptance.nodes for v in verdicts])
    out = []
    for drafter, v in zip(drafters, verdicts):
        acc = v.acceptance
        tokens = acc.tokens + [acc.bonus]
        hidden = v.hidden[acc.nodes.to(v.hidden.device)] if v.hidden is not None else None  # [m+1, H]
        drafter.commit(Commit(tokens=tokens, hidden=hidden))
        out.append(tokens)
    return out


@inference  # once per step: the target's and drafters' own decorated methods do not enter it again
def step_rows(
    target: BatchTarget,
    rows: DraftRows,
    builders: list[TreeBuilder],
    roots: list[int],
    max_depths: list[int],
    accepts: list[AcceptRule],
    *,
    keep: bool = True,
) -> list[Step]:
    """One decoding step of every row from its last committed token ``roots[i]``; no node of row i
    deeper than ``max_depths[i]``. ``keep=False`` stops after verification (nothing committed)."""
    clock = Clock()
    trees = lockstep.draft_rows(rows, builders, roots, max_depths)
    clock.lap("draft")
    verdicts = verify_rows(target, trees, accepts, hidden_request(rows.drafters[0]), clock)
    for builder, v in zip(builders, verdicts):
        builder.verified(v.tree, v.acceptance.nodes)
    tokens = commit_rows(target, rows.drafters, verdicts) if keep else [[] for _ in verdicts]
    clock.lap("bookkeeping")
    return [Step(verdict=v, tokens=t, seconds=clock.seconds) for v, t in zip(verdicts, tokens)]


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
    """One step of the sequence ``target`` holds, from its last committed token ``root``."""
    one = BatchTarget(target, single=True)
    return step_rows(one, DraftRows([drafter]), [builder], [root], [max_depth], [accept], keep=keep)[0]


__all__ = [
    "AcceptRule",
    "Clock",
    "Step",
    "Verdict",
    "commit_rows",
    "draft",
    "greedy",
    "hidden_request",
    "prefill",
    "prefill_rows",
    "sampling_rule",
    "step",
    "step_rows",
    "verify_rows",
]
