"""The eight checks of the drafter contract, numbered in the order ``check_drafter`` runs them.

Each check is a function of a ``Driver``; its docstring is the reference for what it enforces and
why (``docs/plugins.md`` §8 shows the same as a table). ``CHECKS`` lists them in run order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treespec.interfaces import Drafter, Proposals
from treespec.tree import DraftTree

from .driver import Driver, Other, accept_path
from .reference import first_difference, greedy_reference
from .rows import describe_node, describe_row, row, unproposed_token
from .settings import ConformanceError


def _ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def contract(driver: Driver) -> None:
    """The shape of every answer. On a hand-built tree (the root; its best proposals and a child
    it did not propose; grandchildren), ``expand`` is asked for one node, for several nodes in one
    call (newest first) and for nodes at depths 2, 0, 1, 2 in one call (not BFS order).

    Every answer must be ``Proposals`` of CPU tensors, ``tokens`` long and ``q`` floating, both
    ``[M, k]`` for M requested nodes, with per row: ``0 <= q <= 1``; best first (q non-increasing);
    padding (``q == 0``) only at the end; distinct non-padding tokens; tokens in ``[0, vocab)``.
    ``expand`` must not modify the tree, and a node asked for again in the same step (alone or among
    others) must get the same answer. Why: builders rely on all of it without checking — ``opt-tree``
    ranks flattened ``[M, k]`` candidates, ``chain`` takes column 0 as the best child, every builder
    stops at the first ``q == 0``, and a duplicate token becomes a duplicate branch that wastes budget.
    """
    k, prompt, vocab = min(driver.settings.k, driver.vocab), driver.prompts[0], driver.vocab
    drafter = driver.new("contract")
    where = "contract (hand-built tree on prompt #0)"
    _, tree = driver.hand_built(drafter, prompt, where)

    def ask(nodes: list[int]) -> Proposals:
        before = [t.clone() for t in (tree.tokens, tree.parents, tree.depths, tree.q, tree.phat)]
        props = driver.expand(drafter, tree, torch.tensor(nodes), k, where)
        after = (tree.tokens, tree.parents, tree.depths, tree.q, tree.phat)
        if any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(before, after)):
            raise driver.fail(f"{where}: expand(nodes={nodes}, k={k}) modified the tree; a drafter must only read it")
        return props

    at_root = ask([0])  # M = 1: the root
    top = at_root.tokens[0][at_root.q[0] > 0][:2].tolist()
    other = unproposed_token(at_root, 0, vocab, salt=1)
    children = tree.add_children(
        torch.zeros(len(top) + 1, dtype=torch.long), _ids(top + [other]), torch.tensor([0.5] * (len(top) + 1))
    )  # proposed children + one it did not propose
    at_children = ask(children.flip(0).tolist())  # several nodes in one call, newest first: row r is children[-1 - r]
    grandchildren = _grandchildren(tree, children, at_children, bool(top), vocab)
    mixed = list(
        dict.fromkeys([int(grandchildren[-1]), 0, int(children[-1]), int(grandchildren[0])])
    )  # depths 2, 0, 1, 2
    at_mixed = ask(mixed)
    root = torch.tensor([0])
    driver.same(
        ask([0]),
        at_root,
        tree,
        root,
        k,
        f"{where}, root asked for again",
        "its own first answer for the root in this step",
    )
    driver.same(
        row(at_mixed, 1),
        at_root,
        tree,
        root,
        k,
        f"{where}, root asked among other nodes (row 1 of expand(nodes={mixed}))",
        "its answer for the root alone",
    )
    drafter.close()


def _grandchildren(
    tree: DraftTree, children: torch.Tensor, at_children: Proposals, proposed: bool, vocab: int
) -> torch.Tensor:
    """Below the best proposed child (if any) its own best proposal (or any token if it has none); below
    the unproposed child another unproposed token. ``at_children`` row r answers ``children[-1 - r]``."""
    parents, tokens = [], []
    if proposed:
        last = len(children) - 1
        best = at_children.tokens[last][at_children.q[last] > 0][:1].tolist()
        parents.append(int(children[0]))
        tokens.append(best[0] if best else unproposed_token(at_children, last, vocab, salt=2))
    parents.append(int(children[-1]))
    tokens.append(unproposed_token(at_children, 0, vocab, salt=3))
    return tree.add_children(_ids(parents), _ids(tokens), torch.full((len(tokens),), 0.25))


def budget(driver: Driver) -> None:
    """Budget respect: asking for k children returns exactly k columns (``k = 1`` works, also for
    several nodes at once), and never more than k (for k above the vocabulary size, at least
    ``vocab`` columns); fewer children asked give the best ones of a larger request (the first
    column of ``k = 5`` is the answer to ``k = 1``, ties aside). Why: ``chain`` asks for ``k = 1``
    and trusts it to be the drafter's best guess; ``opt-tree`` asks for its whole node budget."""
    prompt, vocab = driver.prompts[0], driver.vocab
    drafter = driver.new("budget")
    where = "budget (prompt #0)"
    _, tree = driver.hand_built(drafter, prompt, where)
    root = torch.tensor([0])
    five, big = min(5, vocab), vocab + 3
    one_answer = driver.expand(drafter, tree, root, 1, where)
    five_answer = driver.expand(drafter, tree, root, five, where)
    big_answer = driver.expand(drafter, tree, root, big, where)
    head = Proposals(tokens=five_answer.tokens[:, :1], q=five_answer.q[:, :1])
    driver.same(
        one_answer, head, tree, root, 1, f"{where}, k=1 vs k={five}", f"the first column of its answer for k={five}"
    )
    driver.same(
        five_answer,
        Proposals(tokens=big_answer.tokens[:, :five], q=big_answer.q[:, :five]),
        tree,
        root,
        five,
        f"{where}, k={five} vs k={big}",
        f"the first {five} columns of its answer for k={big}",
    )
    top = five_answer.tokens[0][five_answer.q[0] > 0][:2].tolist() + [unproposed_token(five_answer, 0, vocab, salt=3)]
    children = tree.add_children(torch.zeros(len(top), dtype=torch.long), _ids(top), torch.full((len(top),), 0.5))
    driver.expand(drafter, tree, children, 1, f"{where}, several nodes with k=1")
    drafter.close()


def _short_run(
    driver: Driver, drafter: Drafter, where: str, *, twin: Other | None = None, record: list | None = None
) -> None:
    """``driver.drive`` from prompt #0 with the first builder for the plan's first three steps: the run
    the determinism, prefill-starts-over and flags checks watch."""
    settings = driver.settings
    driver.drive(drafter, driver.prompts[0], settings.builders[0], settings.plan[:3], where, twin=twin, record=record)


def determinism(driver: Driver) -> None:
    """Determinism: two fresh drafters driven by the same calls (prefill, the trees the first
    builder grows, the same commits for three steps) give bit-identical proposals. Why: the other
    checks compare a drafter with a fresh one, and a benchmark must be reproducible."""
    first, second = driver.new("determinism"), driver.new("determinism")
    twin = Other(second, "a second fresh drafter given the same calls", exact=True, driven=True)
    _short_run(driver, first, "determinism (prompt #0)", twin=twin)
    first.close()
    second.close()


def prefill_starts_over(driver: Driver) -> None:
    """``prefill`` resets every per-sequence state: a drafter that already decoded another sequence,
    prefilled again, answers like a fresh one (up to tolerance). Why: a ``Decoder`` keeps one drafter
    instance for all its ``generate`` calls. (A drafter that deliberately learns across sequences
    should skip this check.)"""
    prompts, settings = driver.prompts, driver.settings
    used = driver.new("prefill starts over")
    other = prompts[1] if len(prompts) > 1 else prompts[0][:-1] or prompts[0]
    driver.drive(used, other, settings.builders[0], settings.plan[:2], "prefill starts over (first sequence)")
    fresh = driver.new("prefill starts over")
    twin = Other(fresh, "a fresh drafter (this one had decoded another sequence before its prefill)", driven=True)
    _short_run(driver, used, "prefill starts over (second sequence, prompt #0)", twin=twin)
    used.close()
    fresh.close()


def commit_consistency(driver: Driver) -> None:
    """After ``commit``, the drafter is in the state a fresh drafter prefilled with the whole
    committed sequence would be in. The important one.

    Each builder (``opt-tree``, ``chain``) decodes real steps from the first prompts: grow a tree,
    verify it with ONE target forward, commit the accepted path + bonus token (with the target's
    hidden states of the root and accepted nodes when ``needs_target_hidden``), all through
    ``treespec.step`` as the decode loop (``treespec.engine``) does. How each step ends follows ``plan``: ``target``
    (greedy verification), ``reject`` (nothing accepted; the bonus is the target's best token that
    is no child of the root), ``deepest`` (the path to the deepest node accepted), ``root``
    (``max_depth = 0``: no ``expand`` at all in that step). From the first commit on, every
    ``expand`` of the next step is also sent to a FRESH drafter prefilled with the committed
    sequence (with the target's hidden states of ``committed[:-1]``), and the answers must agree: q
    within ``rtol``/``atol``, tokens equal except among tied q. Why: a drafter that keeps state of
    rejected nodes (KV rows, features, counts) or loses state of accepted ones drafts from a wrong
    context — decoding stays lossless, but acceptance silently collapses, which no other test notices.
    """
    settings = driver.settings
    for builder in settings.builders:
        for i, prompt in enumerate(driver.prompts[: max(1, settings.consistency_prompts)]):
            drafter = driver.new("commit consistency")
            driver.drive(drafter, prompt, builder, settings.plan, f"commit consistency (prompt #{i})", reference=True)
            drafter.close()


def unproposed_nodes(driver: Driver) -> None:
    """Nodes the drafter did not propose: the check adds a child with a token the drafter did not
    propose, and a grandchild below it, asks for their proposals (valid as in check 1), then commits
    that path as accepted; afterwards the drafter must agree with a fresh drafter prefilled with the
    committed sequence. With ``path_exact`` the proposals at those nodes (and at a proposed child)
    must also equal a fresh drafter's for prompt + the node's path. Why: builders may add tokens
    from elsewhere (static shapes, other drafters in a composition, a datastore), and the target may
    accept them: a drafter must not assume every node or accepted token came from it."""
    prompt, k, vocab = driver.prompts[0], min(driver.settings.k, driver.vocab), driver.vocab
    where = "unproposed nodes (prompt #0)"
    drafter = driver.new(where)
    probe, tree = driver.hand_built(drafter, prompt, where)
    at_root = driver.expand(drafter, tree, torch.tensor([0]), k, where)
    token_u = unproposed_token(at_root, 0, vocab, salt=5)
    (node_u,) = tree.add_children(torch.tensor([0]), _ids([token_u]), torch.tensor([0.5])).tolist()
    at_u = driver.expand(
        drafter, tree, torch.tensor([node_u]), k, f"{where}, child {token_u} that the drafter did not propose"
    )
    token_u2 = unproposed_token(at_u, 0, vocab, salt=6)
    (node_u2,) = tree.add_children(torch.tensor([node_u]), _ids([token_u2]), torch.tensor([0.5])).tolist()
    nodes = [node_u2]
    top = at_root.tokens[0][at_root.q[0] > 0][:1].tolist()
    if top:  # and a proposed child, in the same call
        nodes += tree.add_children(torch.tensor([0]), _ids(top), at_root.q[0, :1]).tolist()
    at_nodes = driver.expand(drafter, tree, torch.tensor(nodes), k, f"{where}, grandchild {token_u2} (also unproposed)")
    if driver.settings.path_exact:
        for node, props, i in [(node_u, at_u, 0)] + [(n, at_nodes, i) for i, n in enumerate(nodes)]:
            _same_as_fresh_at_path(driver, tree, node, row(props, i), k, prompt, where)
        driver.target.prefill(torch.tensor(prompt[:-1]))  # the fresh prefills replaced the target's cache
    # the target accepts the unproposed path root → u → u2; the bonus is its own token after it
    probe.where = f"{where}, a path the drafter did not propose"
    committed = prompt + driver.finish(probe, tree, accept_path([0, node_u, node_u2]))
    fresh = driver.fresh(committed, where)
    driver.target.prefill(torch.tensor(committed[:-1]))  # the fresh prefill replaced the target's cache
    name, make_builder = driver.settings.builders[0]
    probe.where = f"{where}, builder {name}, after accepting {committed[len(prompt) : -1]} (never proposed) + bonus {committed[-1]}"
    probe.others = [Other(fresh, f"a fresh drafter prefilled with the {len(committed)} committed tokens")]
    driver.draft(make_builder(), name, probe, committed[-1], driver.room(committed))
    fresh.close()
    drafter.close()


def _same_as_fresh_at_path(
    driver: Driver, tree: DraftTree, node: int, got: Proposals, k: int, prompt: list[int], where: str
) -> None:
    """``got`` (the answer at ``node``) equals a fresh drafter's for prompt + the node's path."""
    path = tree.path_tokens(node)
    fresh = driver.new(where)
    _, alone = driver.hand_built(fresh, prompt + path[1:], f"{where} [fresh drafter]")
    want = driver.expand(fresh, alone, torch.tensor([0]), k, f"{where} [fresh drafter]")
    driver.same(
        got,
        want,
        tree,
        torch.tensor([node]),
        k,
        f"{where} (path_exact)",
        "a fresh drafter prefilled with prompt + this node's path, asked for its root",
    )
    fresh.close()


def flags(driver: Driver) -> None:
    """Honest capability flags: both are bools. With ``needs_target_hidden = False`` the Decoder
    passes ``PrefillContext.hidden = None`` and ``Commit.hidden = None`` (it does not ask the target
    for them), and the drafter must work so for a few steps. With ``provides_probabilities = True``
    the q of every answer must sum to at most 1 (+1e-5): they are (part of) a distribution, which
    sampling verifiers rely on."""
    drafter = driver.new("flags")
    for flag in ("needs_target_hidden", "provides_probabilities"):
        value = getattr(drafter, flag)
        if not isinstance(value, bool):
            raise driver.fail(f"flags: {flag} = {value!r}; it must be a bool class attribute")
    record: list = []
    try:
        _short_run(driver, drafter, "flags (prompt #0)", record=record)
    except ConformanceError as exc:
        if drafter.needs_target_hidden:
            raise
        raise ConformanceError(
            f"{exc}\n  (it declares needs_target_hidden = False, so it is given PrefillContext.hidden = "
            f"None and Commit.hidden = None, and must work without them)"
        ) from exc
    if drafter.provides_probabilities:
        for tree, nodes, k, props in record:
            sums = props.q.double().sum(dim=1)  # [M]
            for i, node in enumerate(nodes.tolist()):
                if float(sums[i]) > 1 + 1e-5:
                    raise driver.fail(
                        f"flags: provides_probabilities = True, but the q of expand(nodes={nodes.tolist()}, k={k}), "
                        f"row {i} = {describe_node(tree, node)} sum to {float(sums[i]):.6g} > 1: "
                        f"{describe_row(props.tokens[i].tolist(), props.q[i].tolist())}; "
                        f"set provides_probabilities = False if q are scores"
                    )
    drafter.close()


def lossless(driver: Driver) -> None:
    """Lossless end to end: ``treespec.Decoder(target, drafter=<instance>, builder=...)`` with
    ``opt-tree`` and ``chain`` on every prompt (one drafter instance per builder, reused across
    prompts) equals the target's own ``model.generate(do_sample=False)`` token for token. With
    ``expect_acceptance`` at least one draft token must be accepted overall (a drafter that never
    drafts is lossless too). Why: whatever a drafter proposes, decoding must not change; a drafter
    that touches the target, its cache or the tree breaks this."""
    from treespec.decoder import Decoder
    from treespec.errors import DecodingError

    accepted, target, limit = 0, driver.target, driver.target.max_positions
    for name, make_builder in driver.settings.builders:
        drafter = driver.new("lossless")
        decoder = Decoder(target, drafter=drafter, builder=make_builder())
        for i, prompt in enumerate(driver.prompts):
            n = (
                driver.settings.max_new_tokens
                if limit is None
                else min(driver.settings.max_new_tokens, limit - len(prompt))
            )
            if n <= 0:
                continue
            where = f"lossless: Decoder(builder {name}).generate(prompt #{i}, max_new_tokens={n})"
            try:
                got = decoder.generate(prompt, max_new_tokens=n)
            except DecodingError as exc:
                raise driver.fail(f"{where} failed: {exc}") from exc
            want = greedy_reference(target, prompt, n)
            if got.token_ids != want:
                j = first_difference(got.token_ids, want)
                raise driver.fail(
                    f"{where} differs from the target's own greedy generate() at new token {j}: "
                    f"got {got.token_ids[j : j + 5]}, expected {want[j : j + 5]} (lengths {len(got.token_ids)} vs {len(want)}). "
                    "Decoding must be lossless whatever the drafter proposes: does it modify the tree, the target "
                    "or its cache?"
                )
            accepted += sum(s.accepted for s in got.stats.steps)
        drafter.close()
    if driver.settings.expect_acceptance and accepted == 0:
        raise driver.fail("lossless: no draft token was accepted in any run (expect_acceptance = True)")


@dataclass(frozen=True)
class Check:
    number: int
    name: str
    run: Callable[[Any], None]  # a function of a Driver (drafter checks) or a BuilderDriver (builder checks)

    @property
    def summary(self) -> str:
        """The first sentence of the check's docstring, on one line."""
        return " ".join((self.run.__doc__ or "").split()).split(". ")[0].split(":")[0]


#: every check, in the order ``check_drafter`` runs them (the order gives the numbers)
ORDER: list[Check] = [
    Check(i, fn.__name__, fn)
    for i, fn in enumerate(
        [contract, budget, determinism, prefill_starts_over, commit_consistency, unproposed_nodes, flags, lossless], 1
    )
]
