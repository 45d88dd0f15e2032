"""The five checks of the builder contract, numbered in the order ``check_builder`` runs them.

Every check decodes with a real ``treespec.Decoder`` on the target, with each of the settings'
drafters (one builder instance per drafter, kept across prompts as the Decoder keeps it). The
structural checks hand the Decoder the builder behind a ``watch.WatchedBuilder`` (``watch.watched``), which checks the
rules of its check at every ``build``; the lossless check hands over the builder itself. Each check's
docstring is the reference for what it enforces and why (``docs/plugins.md`` §10 shows the same as
a table). ``BUILDER_ORDER`` lists them in run order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from treespec.interfaces import Drafter, TreeBuilder
from treespec.target import TargetModel

from .checks import Check
from .reference import first_difference, greedy_reference
from .rows import describe_plugin
from .settings import BuilderSettings, ConformanceError, NamedDrafter, encode_prompt
from .trees import max_nodes_problem
from .watch import Watch, watched

#: makes a new builder, e.g. ``lambda: MyBuilder(MyBuilder.Config())``
BuilderMaker = Callable[[], TreeBuilder]


class BuilderDriver:
    """Decodes with builders made by one factory on one target with one ``BuilderSettings``; every
    failure is a ``ConformanceError`` naming the builder, the run and what was expected."""

    def __init__(self, make_builder: BuilderMaker, target: TargetModel, settings: BuilderSettings):
        self.make_builder, self.target, self.settings = make_builder, target, settings
        self.prompts = [encode_prompt(target, p, i) for i, p in enumerate(settings.prompts)]
        if not self.prompts or not settings.drafters:
            raise ValueError("the builder checks need at least one prompt and one drafter")
        self.label = "builder"

    def fail(self, msg: str) -> ConformanceError:
        return ConformanceError(f"{self.label}: {msg}")

    def new_builder(self, where: str) -> TreeBuilder:
        try:
            builder = self.make_builder()
        except Exception as exc:
            raise self.fail(f"{where}: make_builder() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(builder, TreeBuilder):
            raise ConformanceError(f"make_builder() returned {builder!r}, not a treespec.TreeBuilder")
        self.label = describe_plugin("builder", builder)
        return builder

    def decoder(self, builder: TreeBuilder, drafter: NamedDrafter, where: str) -> Any:
        """A Decoder of the target with a new drafter of ``drafter`` and ``builder`` (attached to both)."""
        from treespec.decoder import Decoder

        name, make = drafter
        try:
            made: Drafter = make(self.target)
        except Exception as exc:
            raise self.fail(f"{where}: the drafter {name!r} could not be made: {type(exc).__name__}: {exc}") from exc
        try:
            return Decoder(self.target, drafter=made, builder=builder)
        except Exception as exc:
            raise self.fail(f"{where}: Decoder(target, drafter {name!r}, this builder) refused: {exc}") from exc

    def length(self, prompts: Sequence[list[int]]) -> int:
        """New tokens for a run of ``prompts``: max_new_tokens, or less where the context ends."""
        limit = self.target.max_positions
        n = self.settings.max_new_tokens
        return n if limit is None else min(n, *(limit - len(p) for p in prompts))

    def generate(self, decoder: Any, prompt: Any, n: int, where: str, watch: Watch | None = None, **kw: Any) -> Any:
        """``decoder.generate``; a broken rule the watch saw, or any failure, becomes a ConformanceError."""
        try:
            out = decoder.generate(prompt, max_new_tokens=n, **kw)
        except ConformanceError:
            raise
        except Exception as exc:
            if watch is not None and watch.failure is not None:
                raise watch.failure from None
            raise self.fail(f"{where} failed: {exc}") from exc
        if watch is not None and watch.failure is not None:
            raise watch.failure
        return out

    def same_as_greedy(self, got: list[int], prompt: list[int], n: int, where: str) -> None:
        want = greedy_reference(self.target, prompt, n)
        if got != want:
            j = first_difference(got, want)
            raise self.fail(
                f"{where} differs from the target's own greedy generate() at new token {j}: got {got[j : j + 5]}, "
                f"expected {want[j : j + 5]} (lengths {len(got)} vs {len(want)}). Decoding must be lossless whatever "
                "the tree: does the builder touch the target, its cache, or the drafter's state?"
            )

    def watched(self, check: str, rules: set[str]) -> Watch:
        """Every prompt with every drafter, the builder watched for ``rules``; returns the watch."""
        watch = Watch(self.label, frozenset(rules), self.target.vocab_size)
        for name, make in self.settings.drafters:
            builder = self.new_builder(check)
            watch.label = self.label
            dec = self.decoder(watched(builder, watch), (name, make), f"{check}, drafter {name!r}")
            for i, prompt in enumerate(self.prompts):
                n = self.length([prompt])
                watch.where = f"{check}: drafter {name!r}, generate(prompt #{i}, max_new_tokens={n})"
                if n > 0:
                    self.generate(dec, prompt, n, watch.where, watch)
        return watch


def contract(driver: BuilderDriver) -> None:
    """Every tree is a valid draft tree of its step, grown by the drafter protocol. Decoding every
    prompt with every drafter, each tree ``build`` returns must be a ``DraftTree`` whose node 0 holds
    the step's root token and that passes ``DraftTree.validate`` (an arborescence rooted at node 0,
    parents before children, depth = parent's + 1, p̂ = p̂(parent)·q), with drafted tokens inside the
    vocabulary, no padding node (q == 0) and no two siblings with one token. Inside ``build`` the
    builder calls ``expand`` on ONE append-only tree per step (or calls ``begin_step(root)`` before
    starting over), with at least one distinct node id of that tree and ``k ≥ 1``, and never calls
    ``prefill``, ``commit`` or ``close``. With ``expect_drafting`` some tree must hold a drafted node.
    Why: the Decoder verifies the tree as it is, without checking it (a malformed tree is a wrong
    attention mask, or an error deep in the target's forward); drafters keep per-step state by node
    id; the Decoder alone starts sequences and ends steps."""
    watch = driver.watched("contract", {"tree", "protocol"})
    if driver.settings.expect_drafting and watch.drafted == 0:
        raise driver.fail(
            f"contract: none of the {watch.builds} trees had a drafted node (expect_drafting = True): "
            "a builder that never drafts passes every other check"
        )


def budget(driver: BuilderDriver) -> None:
    """The node budget: ``max_nodes`` is declared (an int ≥ 1), and no tree of any run has more
    drafted nodes (root excluded). Why: the Decoder refuses, before anything runs, a builder whose
    trees the target could not verify in one forward (its context, or the memory of the tree's
    mask and logits), and it can do that only for a builder that says how large its trees get."""
    problem = max_nodes_problem(driver.new_builder("budget").max_nodes)
    if problem is not None:
        raise driver.fail(f"budget: {problem}")
    driver.watched("budget", {"budget"})


def max_depth(driver: BuilderDriver) -> None:
    """The depth cap: no node deeper than the ``max_depth`` the Decoder passes, which is
    ``min(new tokens left, context left) - 1``. Each cap of ``depth_caps`` is reached by decoding
    ``cap + 1`` new tokens (the first step gets ``max_depth = cap``; 0 means the root alone), on every
    prompt with every drafter. Why: a step emits the accepted path plus one token, so a deeper tree
    could overshoot ``max_new_tokens`` or the context (``treespec.step.draft`` refuses it)."""
    watch = Watch(driver.label, frozenset({"depth"}), driver.target.vocab_size)
    for name, make in driver.settings.drafters:
        builder = driver.new_builder("max_depth")
        watch.label = driver.label
        dec = driver.decoder(watched(builder, watch), (name, make), f"max_depth, drafter {name!r}")
        for cap in driver.settings.depth_caps:
            for i, prompt in enumerate(driver.prompts):
                n = min(cap + 1, driver.length([prompt]))
                watch.where = f"max_depth: drafter {name!r}, generate(prompt #{i}, max_new_tokens={n})"
                if n > 0:
                    driver.generate(dec, prompt, n, watch.where, watch)
    missing = set(driver.settings.depth_caps) - watch.caps
    if missing:
        raise driver.fail(
            f"max_depth: build was never called with max_depth in {sorted(missing)} (the prompts leave "
            "no room?); the check could not test those caps"
        )


def batch(driver: BuilderDriver) -> None:
    """Batches: every prompt as one batch (``Decoder.generate([p1, p2, ...])``), then, for three or
    more prompts, two rows at a time (``batch_size=2``: a finished row's builder serves the next
    prompt). Each row's builder is a ``copy.copy`` of the instance, as the Decoder makes them, and
    its ``expand`` calls meet the other rows' in rounds (``treespec.lockstep``). Every row's trees must
    keep checks 1-3, and every row must equal the target's own greedy decoding of its prompt. Why: a
    copy that shares mutable state with the others, or a ``build`` that is not a plain function of
    its drafter's answers (threads, global state), breaks only here."""
    watch = Watch(driver.label, frozenset({"tree", "protocol", "budget", "depth"}), driver.target.vocab_size)
    prompts = driver.prompts
    n = driver.length(prompts)
    if n <= 0:
        return
    for name, make in driver.settings.drafters:
        builder = driver.new_builder("batch")
        watch.label = driver.label
        dec = driver.decoder(watched(builder, watch), (name, make), f"batch, drafter {name!r}")
        runs = [{}] + ([{"batch_size": 2}] if len(prompts) > 2 else [])
        for kw in runs:
            shown = ", batch_size=2" if kw else ""
            watch.where = f"batch: drafter {name!r}, generate({len(prompts)} prompts{shown}, max_new_tokens={n})"
            outs = driver.generate(dec, [list(p) for p in prompts], n, watch.where, watch, **kw)
            for i, (prompt, out) in enumerate(zip(prompts, outs)):
                driver.same_as_greedy(out.token_ids, prompt, n, f"{watch.where}, row {i}")


def lossless(driver: BuilderDriver) -> None:
    """Lossless end to end: ``treespec.Decoder(target, drafter=..., builder=<instance>)`` on every
    prompt (one builder instance per drafter, kept across prompts, not watched) equals the target's
    own ``model.generate(do_sample=False)`` token for token; with ``expect_acceptance`` some draft
    token must be accepted. Why: whatever tree a builder returns, decoding must not change; a builder
    that touches the target, its cache or the drafter's state breaks this."""
    accepted = 0
    for name, make in driver.settings.drafters:
        dec = driver.decoder(driver.new_builder("lossless"), (name, make), f"lossless, drafter {name!r}")
        for i, prompt in enumerate(driver.prompts):
            n = driver.length([prompt])
            where = f"lossless: drafter {name!r}, generate(prompt #{i}, max_new_tokens={n})"
            if n <= 0:
                continue
            out = driver.generate(dec, prompt, n, where)
            driver.same_as_greedy(out.token_ids, prompt, n, where)
            accepted += sum(s.accepted for s in out.stats.steps)
    if driver.settings.expect_acceptance and accepted == 0:
        raise driver.fail("lossless: no draft token was accepted in any run (expect_acceptance = True)")


#: every check, in the order ``check_builder`` runs them (the order gives the numbers)
BUILDER_ORDER: list[Check] = [
    Check(i, fn.__name__, fn) for i, fn in enumerate([contract, budget, max_depth, batch, lossless], 1)
]
