"""The builder checks as plain functions (``check_builder_contract``, ..., ``check_builder``) and as a
pytest base class (``BuilderConformance``: one test per check, generated from ``BUILDER_ORDER``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from treespec.target import TargetModel

from .builder_checks import BUILDER_ORDER, BuilderDriver, BuilderMaker
from .kit import CheckFunction, ConformanceBase, add_test_methods, check_functions, run_checks
from .settings import (
    BuilderSettings,
    NamedDrafter,
    default_drafters,
)

#: every builder check as ``fn(make_builder, target=None, **settings)``, in the order ``check_builder`` runs them
BUILDER_CHECKS: dict[str, CheckFunction] = check_functions(BUILDER_ORDER, BuilderDriver, BuilderSettings, "builder")
check_builder_contract = BUILDER_CHECKS["contract"]
check_builder_budget = BUILDER_CHECKS["budget"]
check_builder_max_depth = BUILDER_CHECKS["max_depth"]
check_builder_batch = BUILDER_CHECKS["batch"]
check_builder_lossless = BUILDER_CHECKS["lossless"]


def check_builder(
    make_builder: BuilderMaker,
    target: TargetModel | None = None,
    prompts: Sequence[Sequence[int] | str] | None = None,
    *,
    skip: Sequence[str] = (),
    **settings: Any,
) -> None:
    """Run every check in ``BUILDER_CHECKS`` (except ``skip``) and raise one ``AssertionError`` listing
    every failed check with its message. ``target`` defaults to ``tiny_target()`` and ``prompts`` to
    ``DEFAULT_PROMPTS``; other keyword arguments are ``BuilderSettings`` fields."""
    run_checks(BUILDER_CHECKS, "builder", make_builder, target, prompts, skip, settings)


class BuilderConformance(ConformanceBase):
    """Subclass it in a test module (name it ``Test...``) and implement ``make_builder``; pytest then
    runs one test per check, ``test_contract`` ... ``test_lossless`` in the order of ``BUILDER_CHECKS``
    (see each ``check_builder_*`` function for what it enforces and why).

    Override as needed:

    - ``make_builder(self)``: a new builder (required; called once per decoding run);
    - the target: ``make_target(self)`` returning a ``TargetModel`` (built once per class), or the
      ``target`` fixture, e.g. to reuse a session fixture;
    - ``prompts(self)``: token-id lists (or strings when the target has a tokenizer);
    - ``drafters(self)``: ``[(name, factory of a new Drafter for a target), ...]``;
    - class attributes ``max_new_tokens``, ``depth_caps``, ``expect_drafting``, ``expect_acceptance``
      (see ``BuilderSettings``);
    - a check that does not apply: override its test method, e.g. with ``pytest.skip("why")``.
    """

    max_new_tokens: ClassVar[int] = BuilderSettings.max_new_tokens
    depth_caps: ClassVar[Sequence[int]] = BuilderSettings.depth_caps
    expect_drafting: ClassVar[bool] = BuilderSettings.expect_drafting
    expect_acceptance: ClassVar[bool] = BuilderSettings.expect_acceptance

    SETTINGS = BuilderSettings
    LISTED = "drafters"
    MAKER = "make_builder"

    def make_builder(self) -> Any:
        """A new builder. Required."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_builder(self)")

    def drafters(self) -> Sequence[NamedDrafter]:
        """The drafters (default: ``default_drafters()``: self and ngram)."""
        return default_drafters()


add_test_methods(BuilderConformance, BUILDER_ORDER, BUILDER_CHECKS, "builder")
