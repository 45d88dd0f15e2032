"""A conformance suite for drafters: does a ``treespec.Drafter`` keep the contract the decoder relies on?

For plugin authors. With pytest, subclass ``DrafterConformance`` (one test per check)::

    from treespec.testing import DrafterConformance

    class TestMyDrafter(DrafterConformance):
        def make_drafter(self, target):
            return MyDrafter(MyDrafter.Config(), target)

Without pytest classes, ``check_drafter(lambda target: MyDrafter(MyDrafter.Config(), target))`` runs
every check and raises one ``AssertionError`` that lists every failed check; each check also exists
as a plain function (``check_contract``, ``check_commit_consistency``, ...; see ``CHECKS``).

By default the checks run against ``tiny_target()``: a seeded random-weight two-layer Llama in
float64 with a 96-token vocabulary and no tokenizer, prompted with token ids (``DEFAULT_PROMPTS``).
It needs no files and no network, so the suite runs anywhere, and it exercises every code path of
the contract; but a random model's distributions are flat and it accepts few drafts, so also run
the suite on the real target your drafter is meant for (override ``make_target`` or the ``target``
fixture, and ``prompts``), in float64 (float32 rounding makes fresh and incremental drafts differ
by more than the default tolerance).

Every check drives the drafter the way ``treespec.Decoder`` does, through the same step functions
(``treespec.step``): ``prefill`` once, then per step ``begin_step(root)``, any number of ``expand``
calls on one growing ``DraftTree`` (nodes requested by the built-in builders ``opt-tree`` and
``chain``, or by the check itself), then one ``commit`` with the accepted tokens plus the target's
bonus token and, for drafters with ``needs_target_hidden``, the target's hidden states. Failures are
``AssertionError``s naming the drafter (class and options), the check, the step, the node (id,
depth, path tokens) and what was expected and got.

The files, one concept each: ``settings`` (default target, prompts, builders, knobs), ``rows`` (the
rules of one ``expand`` answer, comparisons), ``driver`` (steps a drafter through ``treespec.step``
and watches every call), ``checks`` (the eight checks, numbered in run order), ``suite``
(``check_*`` functions, ``check_drafter``, ``DrafterConformance``) and ``reference`` (the target's own
greedy decoding, shared with treespec's tests).

This package imports torch and transformers; ``import treespec`` does not import it. pytest is
optional: without it, ``DrafterConformance`` is a plain class and ``check_drafter`` still works.
"""

from .reference import GreedyReference, greedy_reference
from .settings import (
    DEFAULT_PLAN,
    DEFAULT_PROMPTS,
    BuilderFactory,
    ConformanceError,
    DrafterFactory,
    Settings,
    default_builders,
    tiny_target,
)
from .suite import (
    CHECKS,
    DrafterConformance,
    check_budget,
    check_commit_consistency,
    check_contract,
    check_determinism,
    check_drafter,
    check_flags,
    check_lossless,
    check_prefill_starts_over,
    check_unproposed_nodes,
)

__all__ = [
    "CHECKS",
    "DEFAULT_PLAN",
    "DEFAULT_PROMPTS",
    "BuilderFactory",
    "ConformanceError",
    "DrafterConformance",
    "DrafterFactory",
    "GreedyReference",
    "Settings",
    "check_budget",
    "check_commit_consistency",
    "check_contract",
    "check_determinism",
    "check_drafter",
    "check_flags",
    "check_lossless",
    "check_prefill_starts_over",
    "check_unproposed_nodes",
    "default_builders",
    "greedy_reference",
    "tiny_target",
]
