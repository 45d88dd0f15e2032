"""Conformance suites for plugins: does a ``treespec.Drafter`` or a ``treespec.TreeBuilder`` keep the
contract the decoder relies on?

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

**Builders** have a kit of their own, the same way: subclass ``BuilderConformance`` and implement
``make_builder(self)`` (or call ``check_builder(lambda: MyBuilder(MyBuilder.Config()))``). Its five
checks (``BUILDER_CHECKS``) decode with a real ``treespec.Decoder`` on the default target with the
``self`` and ``ngram`` drafters: every tree valid and grown by the drafter protocol (``contract``),
within ``max_nodes`` (``budget``) and ``max_depth`` (``max_depth``), the same in batches
(``batch``), and every output equal to the target's own greedy decoding (``lossless``). Files:
``trees`` (the rules of a tree and of an ``expand`` call), ``watch`` (the builder as the Decoder sees
it, checked at every ``build``), ``builder_checks`` and ``builder_suite``; ``settings`` holds
``BuilderSettings``. What both kits share (a check as a plain function, the runner that collects
failures, the pytest base class's target fixture and generated test methods) is ``kit``.

This package imports torch and transformers; ``import treespec`` does not import it. pytest is
optional: without it, ``DrafterConformance`` is a plain class and ``check_drafter`` still works.
"""

from .builder_suite import (
    BUILDER_CHECKS,
    BuilderConformance,
    check_builder,
    check_builder_batch,
    check_builder_budget,
    check_builder_contract,
    check_builder_lossless,
    check_builder_max_depth,
)
from .reference import GreedyReference, greedy_reference
from .settings import (
    DEFAULT_PLAN,
    DEFAULT_PROMPTS,
    BuilderFactory,
    BuilderSettings,
    ConformanceError,
    DrafterFactory,
    NamedDrafter,
    Settings,
    default_builders,
    default_drafters,
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
    "BUILDER_CHECKS",
    "CHECKS",
    "DEFAULT_PLAN",
    "DEFAULT_PROMPTS",
    "BuilderConformance",
    "BuilderFactory",
    "BuilderSettings",
    "ConformanceError",
    "DrafterConformance",
    "DrafterFactory",
    "GreedyReference",
    "NamedDrafter",
    "Settings",
    "check_budget",
    "check_builder",
    "check_builder_batch",
    "check_builder_budget",
    "check_builder_contract",
    "check_builder_lossless",
    "check_builder_max_depth",
    "check_commit_consistency",
    "check_contract",
    "check_determinism",
    "check_drafter",
    "check_flags",
    "check_lossless",
    "check_prefill_starts_over",
    "check_unproposed_nodes",
    "default_builders",
    "default_drafters",
    "greedy_reference",
    "tiny_target",
]
