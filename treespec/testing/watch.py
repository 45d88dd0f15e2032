"""The builder kit's watch: the builder under test, as ``treespec.Decoder`` sees it, checked at every
``build`` (the builder kit's ``driver.Probe``).

``WatchedBuilder`` wraps the builder and hands it to a real ``Decoder``, so every check runs the
Decoder's own code: its hooks (``attach``, ``start``, ``verified``, ``plan_note``, ``observe``), its
depth caps, and for batches its rows' builders (``copy.copy`` of the instance, as the Decoder makes
them; a copy of the watch wraps a copy of the builder). Each ``build`` gets a ``WatchedDrafter`` in
front of the step's drafter, which checks every call the builder makes on it, and the returned tree
is checked before the target verifies it. What is checked is a set of rules (``RULES``), so each
check of ``builder_checks`` fails only for what it is about; the first broken rule is kept in the
``Watch`` (a builder that swallows the exception is still caught) and ends the run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from treespec.interfaces import (
    Commit,
    Drafter,
    PlanningBuilder,
    PlanNote,
    PrefillContext,
    Proposals,
    TreeBuilder,
)
from treespec.tree import DraftTree

from .settings import ConformanceError
from .trees import (
    budget_problem,
    depth_problem,
    describe_tree,
    expand_problem,
    grew_only,
    tree_problem,
)

#: tree: a valid draft tree of the step; protocol: the drafter calls of ``build``; budget: at most
#: ``max_nodes`` drafted nodes; depth: no node deeper than ``max_depth``
RULES = ("tree", "protocol", "budget", "depth")


@dataclass
class Watch:
    """What the watched builders of one check saw (shared by the copies made for batch rows)."""

    label: str  # "builder ClassName(options)"
    rules: frozenset[str]
    vocab: int
    where: str = ""  # the run being watched
    builds: int = 0
    drafted: int = 0  # builds that returned a tree with at least one drafted node
    caps: set[int] = field(default_factory=set)  # the max_depth values build was called with
    failure: ConformanceError | None = None

    def fail(self, msg: str) -> ConformanceError:
        """Keep the first broken rule and return it, to raise."""
        if self.failure is None:
            self.failure = ConformanceError(f"{self.label}: {self.where}: {msg}")
        return self.failure

    def check(self, tree: Any, root: int, max_depth: int, max_nodes: int | None, call: str) -> None:
        """The rules on the tree ``build`` returned."""
        problem = tree_problem(tree, root, self.vocab) if "tree" in self.rules else None
        if problem is None and isinstance(tree, DraftTree):
            if "budget" in self.rules:
                problem = budget_problem(tree, max_nodes)
            if problem is None and "depth" in self.rules:
                problem = depth_problem(tree, max_depth)
        if problem is not None:
            shown = f"\n    {describe_tree(tree)}" if isinstance(tree, DraftTree) else ""
            raise self.fail(f"{call} returned a tree that breaks the contract: {problem}{shown}")


class WatchedDrafter(Drafter):
    """The step's drafter as the builder's ``build`` sees it: every call is checked, then forwarded."""

    def __init__(self, drafter: Any, watch: Watch, root: int, call: str):
        super().__init__(getattr(drafter, "config", None), getattr(drafter, "target", None))  # type: ignore[arg-type]
        self.drafter, self.watch, self.root, self.call = drafter, watch, root, call
        self.needs_target_hidden = drafter.needs_target_hidden  # type: ignore[misc]
        self.target_hidden_layers = drafter.target_hidden_layers  # type: ignore[misc]
        self.provides_probabilities = drafter.provides_probabilities  # type: ignore[misc]
        self.tree: DraftTree | None = None  # this step's tree (None: no expand since begin_step)
        self.seen: tuple[np.ndarray, np.ndarray] | None = None  # its tokens and parents at the last expand
        self.done = False  # build returned

    def __getattr__(self, name: str) -> Any:  # anything else a builder reads of its drafter
        if name == "drafter":  # not set yet
            raise AttributeError(name)
        return getattr(self.drafter, name)

    def _protocol(self, msg: str) -> None:
        if "protocol" in self.watch.rules:
            raise self.watch.fail(f"{self.call}: {msg}")

    def begin_step(self, root_token: int) -> None:
        """A builder starting its tree over within the step: allowed, with the step's root."""
        if root_token != self.root:
            self._protocol(f"drafter.begin_step({root_token}) inside build, but this step's root is {self.root}")
        self.tree, self.seen = None, None
        self.drafter.begin_step(root_token)

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        call = f"expand(nodes={nodes.tolist() if isinstance(nodes, torch.Tensor) else nodes!r}, k={k!r})"
        if self.done:
            self._protocol(f"{call} after build returned: a builder uses its drafter only inside build")
        problem = expand_problem(tree, nodes, k)
        if problem is None and self.tree is None and int(tree.tokens[0]) != self.root:
            problem = f"the tree's root is {int(tree.tokens[0])}, not this step's root {self.root}"
        elif problem is None and self.tree is not None and tree is not self.tree:
            problem = (
                "a different tree than this step's earlier expand calls: grow ONE append-only tree per step, "
                "or call drafter.begin_step(root) before starting a new one"
            )
        elif problem is None and self.seen is not None:
            problem = grew_only(self.seen, tree)
        if problem is not None:
            self._protocol(f"{call}: {problem}")
        if isinstance(tree, DraftTree):
            self.tree, self.seen = tree, (tree.tokens.numpy().copy(), tree.parents.numpy().copy())
        return self.drafter.expand(tree, nodes, k)

    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor | None:
        return self.drafter.distribution(tree, nodes)

    def prefill(self, context: PrefillContext) -> None:
        self._protocol("build called drafter.prefill(): only the Decoder starts a sequence")
        self.drafter.prefill(context)

    def commit(self, commit: Commit) -> None:
        self._protocol("build called drafter.commit(): only the Decoder ends a step, after verification")
        self.drafter.commit(commit)

    def close(self) -> None:
        self._protocol("build called drafter.close(): the drafter outlives the step")
        self.drafter.close()


class WatchedBuilder(TreeBuilder):
    """The builder under test with every ``TreeBuilder`` attribute forwarded to it, and ``build``
    watched (``watched`` makes one; a ``PlanningBuilder`` gets a ``WatchedPlanningBuilder``, so the
    Decoder sees the same kind of builder as without the watch). ``copy.copy`` of it wraps a copy of
    the builder (what the Decoder makes for batch rows)."""

    def __init__(self, inner: TreeBuilder, watch: Watch):  # no super().__init__: the config is the inner's
        self.inner, self.watch = inner, watch

    def __copy__(self) -> WatchedBuilder:
        return watched(copy.copy(self.inner), self.watch)

    @property
    def config(self) -> Any:  # type: ignore[override]
        return self.inner.config

    @property
    def sampling(self) -> Any:  # type: ignore[override]
        return self.inner.sampling

    @sampling.setter
    def sampling(self, value: Any) -> None:
        self.inner.sampling = value

    @property
    def samples_children(self) -> bool:
        return self.inner.samples_children

    @property
    def max_nodes(self) -> int | None:
        return self.inner.max_nodes

    @property
    def max_drafted(self) -> int | None:
        return self.inner.max_drafted

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        watch = self.watch
        if watch.failure is not None:
            raise watch.failure
        call = f"build #{watch.builds} (root {root_token}, max_depth {max_depth})"
        watch.builds += 1
        watch.caps.add(max_depth)
        spy = WatchedDrafter(drafter, watch, root_token, call)
        tree = self.inner.build(spy, root_token, max_depth)
        spy.done = True
        if watch.failure is not None:  # a broken rule the builder caught and went on
            raise watch.failure
        watch.check(tree, root_token, max_depth, self.inner.max_nodes, call)
        watch.drafted += int(isinstance(tree, DraftTree) and tree.size > 0)
        return tree

    def verified(self, tree: DraftTree, path: torch.Tensor) -> None:
        self.inner.verified(tree, path)

    def start(self, sampling: Any) -> None:
        self.inner.start(sampling)


class WatchedPlanningBuilder(WatchedBuilder, PlanningBuilder):
    """A watched ``PlanningBuilder``: its planning hooks forwarded too."""

    inner: PlanningBuilder

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return self.inner.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.inner.batch_size = value

    def observe(self, stats: Any) -> None:
        self.inner.observe(stats)

    def plan_note(self) -> PlanNote | None:
        return self.inner.plan_note()

    def attach(self, target: Any, drafter: Drafter) -> None:
        self.inner.attach(target, drafter)

    def join_batch(self, peers: list[TreeBuilder]) -> None:
        self.inner.join_batch([p.inner if isinstance(p, WatchedBuilder) else p for p in peers])


def watched(inner: TreeBuilder, watch: Watch) -> WatchedBuilder:
    """``inner`` behind a watch of its own kind (planning or not)."""
    kind = WatchedPlanningBuilder if isinstance(inner, PlanningBuilder) else WatchedBuilder
    return kind(inner, watch)
