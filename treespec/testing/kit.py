"""What the drafter and the builder conformance kits share: a check as a plain function, one runner
that collects every failure, and the pytest base class (its target fixture, its settings and one
generated test method per check). ``suite.py`` and ``builder_suite.py`` bind them to their checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, ClassVar

from treespec.target import TargetModel

from .checks import Check
from .settings import DEFAULT_PROMPTS, ConformanceError, tiny_target

try:  # optional: the pytest base class uses a fixture when pytest is there
    import pytest
except ImportError:  # pragma: no cover - exercised only without pytest
    pytest = None  # type: ignore[assignment]

CheckFunction = Callable[..., None]


def check_functions(order: Sequence[Check], driver: Callable, settings: type, kind: str) -> dict[str, CheckFunction]:
    """Every check of ``order`` as ``fn(make, target=None, **settings)``, keyed by name, in run order.
    ``driver(make, target, settings(**kw))`` is what a check runs on; ``kind`` ("" or "builder") names
    the functions ``check_[kind_]<name>``."""

    def function(check: Check) -> CheckFunction:
        def run(make: Callable, target: TargetModel | None = None, **kw: Any) -> None:
            check.run(driver(make, target if target is not None else tiny_target(), settings(**kw)))

        run.__name__ = run.__qualname__ = "_".join(filter(None, ("check", kind, check.name)))
        title = f"{kind.capitalize()} check" if kind else "Check"
        run.__doc__ = f"{title} {check.number}, {check.name.replace('_', ' ')}. {check.run.__doc__}"
        return run

    return {check.name: function(check) for check in order}


def run_checks(
    checks: dict[str, CheckFunction],
    kind: str,
    make: Callable,
    target: TargetModel | None,
    prompts: Sequence[Sequence[int] | str] | None,
    skip: Sequence[str],
    settings: dict[str, Any],
) -> None:
    """Run every check (except ``skip``) and raise one ``ConformanceError`` listing every failed check
    with its message (see ``check_drafter`` / ``check_builder``)."""
    unknown = set(skip) - set(checks)
    if unknown:
        raise ValueError(f"unknown checks in skip: {sorted(unknown)}; the checks are {list(checks)}")
    if target is None:
        target = tiny_target()
    if prompts is not None:
        settings["prompts"] = prompts
    failures: list[str] = []
    for name, check in checks.items():
        if name in skip:
            continue
        try:
            check(make, target, **settings)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    if failures:
        raise ConformanceError(
            f"{len(failures)} of {len(checks) - len(skip)} {kind} conformance checks failed:\n\n"
            + "\n\n".join(failures)
        )


def _fixture(fn: Callable) -> Callable:
    return pytest.fixture(fn) if pytest is not None else fn


class ConformanceBase:
    """The pytest base class's shared half: ``make_target``, ``prompts``, the ``target`` fixture and
    ``settings``. A kit's class names its settings dataclass (``SETTINGS``), the one list that is a
    method rather than a class attribute (``LISTED``: "builders" or "drafters") and the method that
    makes the object under test (``MAKER``: "make_drafter" or "make_builder")."""

    SETTINGS: ClassVar[type]
    LISTED: ClassVar[str]
    MAKER: ClassVar[str]

    def make_target(self) -> TargetModel:
        """The target of every check (default: ``tiny_target()``)."""
        return tiny_target()

    def prompts(self) -> Sequence[Sequence[int] | str]:
        """The prompts (default: ``DEFAULT_PROMPTS``, token ids for ``tiny_target()``)."""
        return DEFAULT_PROMPTS

    @_fixture
    def target(self) -> TargetModel:
        """The target of every check: ``make_target()``, built once per class. Override this fixture
        to inject one (e.g. from a session fixture)."""
        cls = type(self)
        if "_conformance_target" not in cls.__dict__:
            cls._conformance_target = self.make_target()
        return cls.__dict__["_conformance_target"]

    def settings(self) -> dict[str, Any]:
        """The settings of every check, from the class attributes and methods of the subclass."""
        names = {f.name for f in fields(self.SETTINGS)} - {"prompts", self.LISTED}
        out: dict[str, Any] = {name: getattr(self, name) for name in names}
        out["prompts"], out[self.LISTED] = self.prompts(), getattr(self, self.LISTED)()
        return out


def add_test_methods(cls: type, order: Sequence[Check], checks: dict[str, CheckFunction], kind: str) -> None:
    """One ``test_<name>`` method per check on ``cls``, defined in run order (pytest runs them so)."""

    def method(check: Check) -> Callable:
        def test(self: Any, target: TargetModel) -> None:
            checks[check.name](getattr(self, self.MAKER), target, **self.settings())

        test.__name__ = test.__qualname__ = f"test_{check.name}"
        title = f"{kind.capitalize()} check" if kind else "Check"
        prefix = "_".join(filter(None, ("check", kind)))
        test.__doc__ = f"{title} {check.number}: {check.summary} (see ``{prefix}_{check.name}``)."
        return test

    for check in order:
        setattr(cls, f"test_{check.name}", method(check))
