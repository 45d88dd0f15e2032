"""The checks as plain functions (``check_contract``, ..., ``check_drafter``) and as a pytest base
class (``DrafterConformance``: one test per check, generated from ``checks.ORDER``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, ClassVar

from treespec.target import TargetModel

from .checks import ORDER, Check
from .driver import Driver
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

try:  # optional: the pytest base class uses a fixture when pytest is there
    import pytest
except ImportError:  # pragma: no cover - exercised only without pytest
    pytest = None  # type: ignore[assignment]

CheckFunction = Callable[..., None]


def _function(check: Check) -> CheckFunction:
    def run(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
        check.run(Driver(make_drafter, target if target is not None else tiny_target(), Settings(**settings)))

    run.__name__ = run.__qualname__ = f"check_{check.name}"
    run.__doc__ = f"Check {check.number}, {check.name.replace('_', ' ')}. {check.run.__doc__}"
    return run


#: every check as ``fn(make_drafter, target=None, **settings)``, in the order ``check_drafter`` runs them
CHECKS: dict[str, CheckFunction] = {check.name: _function(check) for check in ORDER}
check_contract = CHECKS["contract"]
check_budget = CHECKS["budget"]
check_determinism = CHECKS["determinism"]
check_prefill_starts_over = CHECKS["prefill_starts_over"]
check_commit_consistency = CHECKS["commit_consistency"]
check_unproposed_nodes = CHECKS["unproposed_nodes"]
check_flags = CHECKS["flags"]
check_lossless = CHECKS["lossless"]


def check_drafter(
    make_drafter: DrafterFactory,
    target: TargetModel | None = None,
    prompts: Sequence[Sequence[int] | str] | None = None,
    *,
    skip: Sequence[str] = (),
    **settings: Any,
) -> None:
    """Run every check in ``CHECKS`` (except ``skip``) and raise one ``AssertionError`` listing every
    failed check with its message. ``target`` defaults to ``tiny_target()`` and ``prompts`` to
    ``DEFAULT_PROMPTS``; other keyword arguments are ``Settings`` fields."""
    unknown = set(skip) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks in skip: {sorted(unknown)}; the checks are {list(CHECKS)}")
    if target is None:
        target = tiny_target()
    if prompts is not None:
        settings["prompts"] = prompts
    failures: list[str] = []
    for name, check in CHECKS.items():
        if name in skip:
            continue
        try:
            check(make_drafter, target, **settings)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    if failures:
        raise ConformanceError(
            f"{len(failures)} of {len(CHECKS) - len(skip)} drafter conformance checks failed:\n\n"
            + "\n\n".join(failures)
        )


def _fixture(fn: Callable) -> Callable:
    return pytest.fixture(fn) if pytest is not None else fn


class DrafterConformance:
    """Subclass it in a test module (name it ``Test...``) and implement ``make_drafter``; pytest then
    runs one test per check, ``test_contract`` ... ``test_lossless`` in the order of ``CHECKS`` (see
    each ``check_*`` function for what it enforces and why).

    Override as needed:

    - ``make_drafter(self, target)``: a new drafter for ``target`` (required; called many times);
    - the target: ``make_target(self)`` returning a ``TargetModel`` (built once per class), or the
      ``target`` fixture, e.g. to reuse a session fixture::

          @pytest.fixture
          def target(self, my_target64):
              return my_target64

    - ``prompts(self)``: token-id lists (or strings when the target has a tokenizer);
    - ``builders(self)``: ``[(name, factory of a fresh TreeBuilder), ...]``;
    - class attributes ``max_new_tokens``, ``plan``, ``k``, ``rtol``, ``atol``, ``path_exact``,
      ``expect_acceptance`` (see ``Settings``);
    - a check that does not apply: override its test method, e.g. with ``pytest.skip("why")``.
    """

    max_new_tokens: ClassVar[int] = Settings.max_new_tokens
    plan: ClassVar[Sequence[str]] = DEFAULT_PLAN
    consistency_prompts: ClassVar[int] = Settings.consistency_prompts
    k: ClassVar[int] = Settings.k
    rtol: ClassVar[float] = Settings.rtol
    atol: ClassVar[float] = Settings.atol
    path_exact: ClassVar[bool] = Settings.path_exact
    expect_acceptance: ClassVar[bool] = Settings.expect_acceptance

    def make_drafter(self, target: TargetModel) -> Any:
        """A new drafter for ``target``. Required."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_drafter(self, target)")

    def make_target(self) -> TargetModel:
        """The target of every check (default: ``tiny_target()``)."""
        return tiny_target()

    def prompts(self) -> Sequence[Sequence[int] | str]:
        """The prompts (default: ``DEFAULT_PROMPTS``, token ids for ``tiny_target()``)."""
        return DEFAULT_PROMPTS

    def builders(self) -> Sequence[BuilderFactory]:
        """The builders (default: ``default_builders()``: opt-tree and chain)."""
        return default_builders()

    @_fixture
    def target(self) -> TargetModel:
        """The target of every check: ``make_target()``, built once per class. Override this fixture
        to inject one (e.g. from a session fixture)."""
        cls = type(self)
        if "_conformance_target" not in cls.__dict__:
            cls._conformance_target = self.make_target()
        return cls.__dict__["_conformance_target"]

    def settings(self) -> dict[str, Any]:
        """The ``Settings`` of every check, from the class attributes and methods above."""
        names = {f.name for f in fields(Settings)} - {"prompts", "builders"}
        out: dict[str, Any] = {name: getattr(self, name) for name in names}
        out["prompts"], out["builders"] = self.prompts(), self.builders()
        return out


def _test_method(check: Check) -> Callable:
    def test(self: DrafterConformance, target: TargetModel) -> None:
        CHECKS[check.name](self.make_drafter, target, **self.settings())

    test.__name__ = test.__qualname__ = f"test_{check.name}"
    test.__doc__ = f"Check {check.number}: {check.summary} (see ``check_{check.name}``)."
    return test


for _check in ORDER:  # one test per check, defined in run order (pytest runs them in this order)
    setattr(DrafterConformance, f"test_{_check.name}", _test_method(_check))
del _check
