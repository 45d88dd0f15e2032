"""The conformance driver: steps a drafter exactly as ``treespec.Decoder`` does — through
``treespec.step`` — and watches every call.

A ``Probe`` stands in for the drafter under test. Builders and ``treespec.step`` talk to the probe;
it forwards every call (``prefill``, ``begin_step``, ``expand``, ``commit``) to the drafter, checks
each ``expand`` answer against the contract (``rows``), sends the same ``expand`` to other drafters
(a twin driven identically, or a fresh drafter prefilled with the committed sequence) and compares
their answers. How a driven step ends is an acceptance rule (``treespec.step.AcceptRule``) per plan
policy: ``target`` is the real greedy rule, the others force an outcome the target rarely produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treespec import step as steps
from treespec.batch_target import BatchTarget
from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals, TreeBuilder
from treespec.target import TargetModel
from treespec.tree import DraftTree, TreeTensors
from treespec.verify import Acceptance

from .rows import describe_drafter, describe_node, describe_row, row_mismatch, row_problem, shape_problem
from .settings import BuilderFactory, ConformanceError, DrafterFactory, Settings, encode_prompt


@dataclass
class Other:
    """A drafter whose answers must equal the one under test's. ``driven``: it also gets every
    ``prefill`` and ``commit`` (a twin); otherwise only ``begin_step`` and ``expand`` (a reference)."""

    drafter: Drafter
    desc: str
    exact: bool = False
    driven: bool = False


# ------------------------------------------------------------------------ how a driven step ends
def _best_other_than_children(tree: DraftTree, logits: torch.Tensor) -> int:
    """The target's best token after the root that is no child of the root (a rejection's bonus)."""
    children = set(tree.tokens[tree.parents == 0].tolist())
    return next(t for t in logits[0].argsort(descending=True).tolist() if t not in children)


def reject(tree: DraftTree, tt: TreeTensors, logits: torch.Tensor) -> Acceptance:
    """Nothing accepted; the bonus is the target's best token that no draft proposed."""
    return Acceptance(nodes=torch.zeros(1, dtype=torch.long), tokens=[], bonus=_best_other_than_children(tree, logits))


def deepest(tree: DraftTree, tt: TreeTensors, logits: torch.Tensor) -> Acceptance:
    """The path to the deepest node (then the most likely, then the oldest) accepted, and the
    target's own token after it."""
    depth = tree.depths.max()
    candidates = (tree.depths == depth).nonzero().flatten()
    node = int(candidates[int(tree.phat[candidates].argmax())])
    path = torch.tensor(tree.path(node), dtype=torch.long)  # [depth + 1] root first
    return Acceptance(nodes=path, tokens=tree.tokens[path[1:]].tolist(), bonus=int(logits[node].argmax()))


def accept_path(path: Sequence[int]) -> steps.AcceptRule:
    """A rule that accepts the given path (root first), whatever the target says about it."""

    def accept(tree: DraftTree, tt: TreeTensors, logits: torch.Tensor) -> Acceptance:
        nodes = torch.tensor(list(path), dtype=torch.long)
        return Acceptance(nodes=nodes, tokens=tree.tokens[nodes[1:]].tolist(), bonus=int(logits[path[-1]].argmax()))

    return accept


#: plan policy → acceptance rule ("root" grows no tree, so nothing can be accepted)
RULES: dict[str, steps.AcceptRule] = {"target": steps.greedy, "reject": reject, "deepest": deepest, "root": reject}


# ------------------------------------------------------------------------ the probe
class Probe(Drafter):
    """The drafter under test, as builders and ``treespec.step`` see it (see the module docstring)."""

    def __init__(
        self, driver: Driver, drafter: Drafter, where: str, others: Sequence[Other] = (), record: list | None = None
    ):
        self.driver, self.drafter, self.where, self.record = driver, drafter, where, record
        self.others = list(others)
        self.config, self.target = drafter.config, drafter.target
        self.needs_target_hidden = drafter.needs_target_hidden  # type: ignore[misc]
        self.target_hidden_layers = drafter.target_hidden_layers  # type: ignore[misc]
        self.provides_probabilities = drafter.provides_probabilities  # type: ignore[misc]

    def _each(self, method: str, arg: Any, driven_only: bool) -> None:
        self.driver.call(self.drafter, method, arg, self.where)
        for other in self.others:
            if other.driven or not driven_only:
                self.driver.call(other.drafter, method, arg, f"{self.where} [{other.desc}]")

    def prefill(self, context: PrefillContext) -> None:
        self._each("prefill", context, driven_only=True)

    def begin_step(self, root_token: int) -> None:
        self._each("begin_step", root_token, driven_only=False)

    def commit(self, commit: Commit) -> None:
        self._each("commit", commit, driven_only=True)

    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> Any:
        """Forwarded to the drafter under test (builders that draw children at random ask for it)."""
        return self.drafter.distribution(tree, nodes)

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        got = self.driver.expand(self.drafter, tree, nodes, k, self.where, strict=False)
        for other in self.others:
            want = self.driver.expand(other.drafter, tree, nodes, k, f"{self.where} [{other.desc}]", strict=False)
            self.driver.same(got, want, tree, nodes, k, self.where, other.desc, other.exact)
        if self.record is not None:
            self.record.append((tree, nodes.clone(), k, got))
        return got


# ------------------------------------------------------------------------ the driver
class Driver:
    """Drives drafters made by one factory on one target with one ``Settings``; every failure is a
    ``ConformanceError`` naming the drafter, where it happened and what was expected."""

    def __init__(self, make_drafter: DrafterFactory, target: TargetModel, settings: Settings):
        self.make_drafter, self.target, self.settings = make_drafter, target, settings
        self.vocab = target.vocab_size
        self.label = "drafter"
        self.prompts = [encode_prompt(target, p, i) for i, p in enumerate(settings.prompts)]
        if not self.prompts:
            raise ValueError("the conformance checks need at least one prompt")

    def room(self, committed: list[int]) -> int:
        """The deepest tree the target's context still holds after ``committed``."""
        limit = self.target.max_positions
        return limit - len(committed) - 1 if limit is not None else 1 << 30

    def fail(self, msg: str) -> ConformanceError:
        return ConformanceError(f"{self.label}: {msg}")

    def new(self, where: str) -> Drafter:
        try:
            drafter = self.make_drafter(self.target)
        except Exception as exc:
            raise self.fail(f"{where}: make_drafter(target) raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(drafter, Drafter):
            raise ConformanceError(f"make_drafter(target) returned {drafter!r}, not a treespec.Drafter")
        self.label = describe_drafter(drafter)
        return drafter

    def call(self, drafter: Drafter, method: str, arg: Any, where: str) -> Any:
        """``drafter.method(arg)``; whatever it raises becomes a ConformanceError saying where."""
        try:
            return getattr(drafter, method)(arg)
        except ConformanceError:
            raise
        except Exception as exc:
            raise self.fail(f"{where}: {method}() raised {type(exc).__name__}: {exc}") from exc

    def start(self, drafter: Drafter, committed: list[int], where: str, others: Sequence[Other] = ()) -> Probe:
        """Prefill as the Decoder does (``treespec.step.prefill``: the target caches committed[:-1]
        and hands their hidden states [L-1, H] to drafters that ask); returns the drafter's probe."""
        probe = Probe(self, drafter, f"{where}, prefill", others)
        steps.prefill(self.target, probe, committed)
        return probe

    def fresh(self, committed: list[int], where: str) -> Drafter:
        """A new drafter prefilled with the whole committed sequence (the reference)."""
        drafter = self.new(where)
        self.start(drafter, committed, f"{where} [prefilling a fresh drafter with {len(committed)} tokens]")
        return drafter

    def expand(
        self, drafter: Drafter, tree: DraftTree, nodes: torch.Tensor, k: int, where: str, strict: bool = True
    ) -> Proposals:
        """``drafter.expand`` and the contract on its answer: structure always, the row rules
        (``rows.row_problem``) if ``strict``."""
        nodes = nodes.to(torch.long).reshape(-1)  # [M]
        call = f"{where}: expand(nodes={nodes.tolist()}, k={k})"
        try:
            props = drafter.expand(tree, nodes.clone(), k)
        except ConformanceError:
            raise
        except Exception as exc:
            raise self.fail(f"{call} raised {type(exc).__name__}: {exc}") from exc
        why = shape_problem(props, int(nodes.numel()), k, self.vocab)
        if why is not None:
            raise self.fail(f"{call}: {why}")
        if strict:
            q = props.q.double()  # [M, k]
            for i, node in enumerate(nodes.tolist()):
                tokens, q_row = props.tokens[i].tolist(), q[i].tolist()
                why = row_problem(tokens, q_row, self.vocab)
                if why is not None:
                    raise self.fail(
                        f"{call}: row {i} = {describe_node(tree, node)}: {describe_row(tokens, q_row)}: {why}"
                    )
        return props

    def same(
        self,
        got: Proposals,
        want: Proposals,
        tree: DraftTree,
        nodes: torch.Tensor,
        k: int,
        where: str,
        desc: str,
        exact: bool = False,
    ) -> None:
        """Fail unless ``got`` equals ``want`` (exactly, or up to tolerance and ties)."""
        call = f"{where}: expand(nodes={nodes.tolist()}, k={k})"
        if tuple(got.tokens.shape) != tuple(want.tokens.shape):
            raise self.fail(f"{call} gave shape {list(got.tokens.shape)}, {desc} gave {list(want.tokens.shape)}")
        got_q, want_q = got.q.double().tolist(), want.q.double().tolist()
        for i, node in enumerate(nodes.tolist()):
            g, w = (got.tokens[i].tolist(), got_q[i]), (want.tokens[i].tolist(), want_q[i])
            why = row_mismatch(g, w, self.settings.rtol, self.settings.atol, exact)
            if why is not None:
                raise self.fail(
                    f"{call}, row {i} = {describe_node(tree, node)} differs from {desc}: {why}\n"
                    f"    expected ({desc}): {describe_row(*w)}\n    got: {describe_row(*g)}"
                )

    def draft(self, builder: TreeBuilder, name: str, probe: Probe, root: int, max_depth: int) -> DraftTree:
        """``treespec.step.draft`` (begin_step, then the builder grows the tree through the probe)."""
        try:
            return steps.draft(probe, builder, root, max_depth)
        except ConformanceError:
            raise
        except Exception as exc:
            raise self.fail(
                f"{probe.where}: builder {name} failed on this drafter's proposals: {type(exc).__name__}: {exc}"
            ) from exc

    def finish(self, probe: Probe, tree: DraftTree, accept: steps.AcceptRule) -> list[int]:
        """Verify ``tree`` with ONE target forward and commit as ``accept`` says (``treespec.step``);
        returns the committed tokens (accepted + bonus)."""
        one = BatchTarget(self.target, single=True)  # the target's sequence, a batch of one row
        [verdict] = steps.verify_rows(one, [tree], [accept], steps.hidden_request(probe), steps.Clock())
        where = probe.where
        probe.where = f"{where}, commit({verdict.acceptance.tokens + [verdict.acceptance.bonus]})"
        [tokens] = steps.commit_rows(one, [probe], [verdict])
        probe.where = where
        return tokens

    def drive(
        self,
        drafter: Drafter,
        prompt: list[int],
        builder_factory: BuilderFactory,
        plan: Sequence[str],
        where: str,
        *,
        reference: bool = False,
        twin: Other | None = None,
        record: list | None = None,
    ) -> list[int]:
        """Decode ``len(plan)`` steps from ``prompt`` like the decode loop (``treespec.engine``), each step ending as its
        policy says, then grow one more tree. Every ``expand`` is compared with ``twin`` (driven
        identically) and, if ``reference``, from the first commit on, with a fresh drafter
        prefilled with the committed sequence. Returns the committed sequence."""
        name, make_builder = builder_factory
        builder = make_builder()
        committed = list(prompt)
        twins = [twin] if twin is not None else []
        probe = self.start(drafter, committed, where, twins)
        probe.record = record
        done: list[str] = []
        for number, policy in enumerate([*plan, None]):
            before = f"after {', '.join(done)}" if done else "the first step"
            probe.where = f"{where}, builder {name}, step {number} ({before}; {len(committed)} tokens committed)"
            probe.others = list(twins)
            fresh = None
            if reference and number > 0:
                fresh = self.fresh(committed, probe.where)
                probe.others.append(
                    Other(fresh, f"a fresh drafter prefilled with the {len(committed)} committed tokens")
                )
                self.target.prefill(torch.tensor(committed[:-1]))  # the fresh prefill replaced the target's cache
            if self.room(committed) < 0:  # the target's context is full
                break
            tree = self.draft(builder, name, probe, committed[-1], 0 if policy == "root" else self.room(committed))
            if fresh is not None:
                fresh.close()
                probe.others = list(twins)
            if policy is None:
                break
            new = self.finish(probe, tree, RULES[policy])
            committed += new
            done.append(f"step {number} {policy!r} accepted {len(new) - 1} + bonus")
        return committed

    def hand_built(self, drafter: Drafter, prompt: list[int], where: str) -> tuple[Probe, DraftTree]:
        """Prefill ``drafter`` with ``prompt`` and start a step whose tree the check grows by hand."""
        probe = self.start(drafter, prompt, where)
        probe.where = where
        tree = DraftTree(prompt[-1])
        probe.begin_step(prompt[-1])
        return probe, tree
