"""The builder checks as plain functions (``check_builder_contract``, ..., ``check_builder``) and as a
pytest base class (``BuilderConformance``: one test per check, generated from ``BUILDER_ORDER``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, ClassVar

from treespec.target import TargetModel

from .builder_checks import BUILDER_ORDER, BuilderDriver, BuilderMaker
from .checks import Check
from .settings import (
    DEFAULT_PROMPTS,
    BuilderSettings,
    ConformanceError,
    NamedDrafter,
    default_drafters,
    tiny_target,
)

try:  # optional: the pytest base class uses a fixture when pytest is there
    import pytest
except ImportError:  # pragma: no cover - exercised only without pytest
    pytest = None  # type: ignore[assignment]

CheckFunction = Callable[..., None]


def _function(check: Check) -> CheckFunction:
    def run(make_builder: BuilderMaker, target: TargetModel | None = None, **settings: Any) -> None:
        check.run(
            BuilderDriver(make_builder, target if target is not None else tiny_target(), BuilderSettings(**settings))
        )

    run.__name__ = run.__qualname__ = f"check_builder_{check.name}"
    run.__doc__ = f"Builder check {check.number}, {check.name.replace('_', ' ')}. {check.run.__doc__}"
    return run


#: every builder check as ``fn(make_builder, target=None, **settings)``, in the order ``check_builder`` runs them
BUILDER_CHECKS: dict[str, CheckFunction] = {check.name: _function(check) for check in BUILDER_ORDER}
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
    unknown = set(skip) - set(BUILDER_CHECKS)
    if unknown:
        raise ValueError(f"unknown checks in skip: {sorted(unknown)}; the checks are {list(BUILDER_CHECKS)}")
    if target is None:
        target = tiny_target()
    if prompts is not None:
        settings["prompts"] = prompts
    failures: list[str] = []
    for name, check in BUILDER_CHECKS.items():
        if name in skip:
            continue
        try:
            check(make_builder, target, **settings)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    if failures:
        raise ConformanceError(
            f"{len(failures)} of {len(BUILDER_CHECKS) - len(skip)} builder conformance checks failed:\n\n"
            + "\n\n".join(failures)
        )


def _fixture(fn: Callable) -> Callable:
    return pytest.fixture(fn) if pytest is not None else fn


class BuilderConformance:
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

    def make_builder(self) -> Any:
        """A new builder. Required."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_builder(self)")

    def make_target(self) -> TargetModel:
        """The target of every check (default: ``tiny_target()``)."""
        return tiny_target()

    def prompts(self) -> Sequence[Sequence[int] | str]:
        """The prompts (default: ``DEFAULT_PROMPTS``, token ids for ``tiny_target()``)."""
        return DEFAULT_PROMPTS

    def drafters(self) -> Sequence[NamedDrafter]:
        """The drafters (default: ``default_drafters()``: self and ngram)."""
        return default_drafters()

    @_fixture
    def target(self) -> TargetModel:
        """The target of every check: ``make_target()``, built once per class. Override this fixture
        to inject one (e.g. from a session fixture)."""
        cls = type(self)
        if "_conformance_target" not in cls.__dict__:
            cls._conformance_target = self.make_target()
        return cls.__dict__["_conformance_target"]

    def settings(self) -> dict[str, Any]:
        """The ``BuilderSettings`` of every check, from the class attributes and methods above."""
        names = {f.name for f in fields(BuilderSettings)} - {"prompts", "drafters"}
        out: dict[str, Any] = {name: getattr(self, name) for name in names}
        out["prompts"], out["drafters"] = self.prompts(), self.drafters()
        return out


def _test_method(check: Check) -> Callable:
    def test(self: BuilderConformance, target: TargetModel) -> None:
        BUILDER_CHECKS[check.name](self.make_builder, target, **self.settings())

    test.__name__ = test.__qualname__ = f"test_{check.name}"
    test.__doc__ = f"Builder check {check.number}: {check.summary} (see ``check_builder_{check.name}``)."
    return test


for _check in BUILDER_ORDER:  # one test per check, defined in run order (pytest runs them in this order)
    setattr(BuilderConformance, f"test_{_check.name}", _test_method(_check))
del _check
