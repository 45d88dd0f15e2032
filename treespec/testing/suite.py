"""The checks as plain functions (``check_contract``, ..., ``check_drafter``) and as a pytest base
class (``DrafterConformance``: one test per check, generated from ``checks.ORDER``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from treespec.target import TargetModel

from .checks import ORDER
from .driver import Driver
from .kit import CheckFunction, ConformanceBase, add_test_methods, check_functions, run_checks
from .settings import (
    DEFAULT_PLAN,
    BuilderFactory,
    DrafterFactory,
    Settings,
    default_builders,
)

#: every check as ``fn(make_drafter, target=None, **settings)``, in the order ``check_drafter`` runs them
CHECKS: dict[str, CheckFunction] = check_functions(ORDER, Driver, Settings, "")
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
    run_checks(CHECKS, "drafter", make_drafter, target, prompts, skip, settings)


class DrafterConformance(ConformanceBase):
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

    SETTINGS = Settings
    LISTED = "builders"
    MAKER = "make_drafter"

    def make_drafter(self, target: TargetModel) -> Any:
        """A new drafter for ``target``. Required."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_drafter(self, target)")

    def builders(self) -> Sequence[BuilderFactory]:
        """The builders (default: ``default_builders()``: opt-tree and chain)."""
        return default_builders()


add_test_methods(DrafterConformance, ORDER, CHECKS, "")
