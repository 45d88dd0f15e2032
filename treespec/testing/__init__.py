"""A conformance suite for drafters: does a ``treespec.Drafter`` keep the contract the decoder relies on?

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

Every check drives the drafter the way ``treespec.Decoder`` does: ``prefill`` once, then per step
any number of ``expand`` calls on one growing ``DraftTree`` (nodes requested by the built-in
builders ``opt-tree`` and ``chain``, or by the check itself), then one ``commit`` with the accepted
tokens plus the target's bonus token and, for drafters with ``needs_target_hidden``, the target's
hidden states exactly as ``Decoder._run`` passes them. Failures are ``AssertionError``s naming the
drafter (class and options), the check, the step, the node (id, depth, path tokens) and what was
expected and got.

This module imports torch and transformers; ``import treespec`` does not import it. pytest is
optional: without it, ``DrafterConformance`` is a plain class and ``check_drafter`` still works.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Sequence

import torch

from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals, TreeBuilder
from treespec.target import TargetModel
from treespec.tree import DraftTree
from treespec.verify import greedy_verify

try:  # optional: the pytest base class uses a fixture when pytest is there
    import pytest
except ImportError:  # pragma: no cover - exercised only without pytest
    pytest = None  # type: ignore[assignment]

__all__ = [
    "CHECKS",
    "DEFAULT_PLAN",
    "DEFAULT_PROMPTS",
    "ConformanceError",
    "DrafterConformance",
    "DrafterFactory",
    "Settings",
    "check_budget",
    "check_commit_consistency",
    "check_contract",
    "check_determinism",
    "check_drafter",
    "check_flags",
    "check_lossless",
    "check_prefill_starts_over",
    "check_unproposed_nodes",
    "default_builders",
    "tiny_target",
]

#: builds a new drafter for a target, e.g. ``lambda target: MyDrafter(MyDrafter.Config(), target)``
DrafterFactory = Callable[[TargetModel], Drafter]
#: a name and a factory of a fresh builder instance
BuilderFactory = tuple[str, Callable[[], TreeBuilder]]

#: token-id prompts for ``tiny_target()`` (ids < 64): repetitions give retrieval drafters something
#: to find; the one-token prompt has an empty prefix (``PrefillContext.hidden`` is then [0, H])
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 5, 17, 33, 5, 17, 40, 8, 5, 17, 33, 21, 9, 5, 17),
    (1,),
    (1, 9, 9, 9, 12, 60, 9, 9, 12, 60, 9),
    (1, 42, 7, 23, 42, 7, 23, 42),
)

#: how each step of a commit-consistency run ends (see ``check_commit_consistency``)
DEFAULT_PLAN: tuple[str, ...] = ("target", "reject", "deepest", "root", "deepest", "target", "reject")
POLICIES = ("target", "reject", "deepest", "root")


class ConformanceError(AssertionError):
    """A drafter broke the contract; the message says which check, drafter, step and node."""


def tiny_target(vocab_size: int = 96, layers: int = 2, seed: int = 0) -> TargetModel:
    """A seeded random-weight Llama in float64 with no tokenizer and no EOS: the default target.

    ``layers=2`` leaves room for drafters that use a prefix of the target's layers (``self``).
    The weights are drawn with a large init scale so that its next-token distributions are peaked
    enough for drafts to be accepted now and then. The global torch RNG is left untouched.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=None,  # never stop early: every run covers max_new_tokens
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return TargetModel(model.to(torch.float64), tokenizer=None, name=f"tiny-random-llama(seed={seed})")


def default_builders() -> list[BuilderFactory]:
    """The builders the checks grow trees with: ``opt-tree`` (many children of a whole layer per
    ``expand``, deep trees: δ = 0) and ``chain`` (one child of one node per ``expand``)."""
    from treespec.plugins.chain import ChainBuilder
    from treespec.plugins.configs import ChainConfig, OptTreeConfig
    from treespec.plugins.opt_tree import OptTreeBuilder

    return [
        ("opt-tree", lambda: OptTreeBuilder(OptTreeConfig(nodes=16, threshold=0.0, max_depth=5))),
        ("chain", lambda: ChainBuilder(ChainConfig(k=4))),
    ]


@dataclass
class Settings:
    """Knobs of the checks (``DrafterConformance`` maps its class attributes onto these)."""

    #: token-id lists, or strings when the target has a tokenizer; the first is used most
    prompts: Sequence[Sequence[int] | str] = DEFAULT_PROMPTS
    #: new tokens per prompt in the lossless check
    max_new_tokens: int = 24
    #: the builders of the commit-consistency and lossless checks (the first one for the others)
    builders: Sequence[BuilderFactory] = field(default_factory=default_builders)
    #: how each step of a commit-consistency run ends: "target" (greedy verification), "reject"
    #: (nothing accepted), "deepest" (the path to the deepest node accepted), "root" (no expand at all)
    plan: Sequence[str] = DEFAULT_PLAN
    #: prompts (the first n) of the commit-consistency check
    consistency_prompts: int = 2
    #: children asked per node on hand-built trees
    k: int = 4
    #: tolerance on q when comparing with a fresh drafter (tokens may differ only where q tie)
    rtol: float = 1e-5
    atol: float = 1e-7
    #: also require a node's proposals to equal a fresh drafter's for committed + the node's path
    #: (true of model and n-gram drafters; not of EAGLE heads, whose tree nodes use draft features)
    path_exact: bool = False
    #: require the lossless runs to accept at least one draft token (use it with a real target)
    expect_acceptance: bool = False


# ---------------------------------------------------------------------------------------------------
# formatting


def _label(drafter: Drafter) -> str:
    opts: dict[str, Any] = {}
    config = getattr(drafter, "config", None)
    try:
        opts = config.model_dump(exclude_defaults=True)  # type: ignore[union-attr]
    except Exception:
        pass
    return f"drafter {type(drafter).__name__}({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


def _node(tree: DraftTree, node: int) -> str:
    return f"node {node} (depth {int(tree.depths[node])}, path tokens {tree.path_tokens(node)})"


def _row(tokens: list[int], q: list[float]) -> str:
    return f"tokens {tokens} q [{', '.join(f'{x:.6g}' for x in q)}]"


def _ids(tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.long)


def _real(q: list[float]) -> int:
    """Columns before the first padding entry (q == 0)."""
    return next((j for j, x in enumerate(q) if x == 0), len(q))


def _row_mismatch(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]],
                  rtol: float, atol: float, exact: bool) -> str | None:
    """Why two proposal rows differ, or None. Tolerant mode: q within rtol/atol; tokens equal as
    sets within each run of tied q (a tie that reaches the last column may be cut differently)."""
    gt, gq = got
    wt, wq = want
    if len(gq) != len(wq):
        return f"{len(gq)} columns instead of {len(wq)}"
    if exact:
        if gq != wq:
            j = next(j for j, (a, b) in enumerate(zip(gq, wq)) if a != b)
            return f"q differ at column {j} ({gq[j]!r} vs {wq[j]!r}); identical calls must give identical proposals"
        n = _real(wq)
        if gt[:n] != wt[:n]:
            j = next(j for j, (a, b) in enumerate(zip(gt[:n], wt[:n])) if a != b)
            return f"tokens differ at column {j}"
        return None
    for j, (a, b) in enumerate(zip(gq, wq)):
        if not math.isclose(a, b, rel_tol=rtol, abs_tol=atol):
            return f"q differ at column {j}: {a:.10g} vs {b:.10g} (rtol={rtol:g}, atol={atol:g})"
    n = max(_real(gq), _real(wq))
    j = 0
    while j < n:
        e = j + 1
        while e < n and math.isclose(wq[e], wq[e - 1], rel_tol=rtol, abs_tol=atol):
            e += 1
        if set(gt[j:e]) != set(wt[j:e]) and e < len(wq):
            return f"tokens differ in columns {j}..{e - 1}, where q are not tied"
        j = e
    return None


# ---------------------------------------------------------------------------------------------------
# the driver


class _Probe(Drafter):
    """Stands in for the drafter under test while a builder grows a tree: forwards every ``expand``
    to it, checks the proposals' structure, compares them with other drafters' answers to the same
    call, and records them."""

    def __init__(self, checker: "_Checker", drafter: Drafter, others: list[tuple[Drafter, str, bool]],
                 where: str, record: list | None = None):
        self.checker, self.drafter, self.others, self.where, self.record = checker, drafter, others, where, record
        self.config, self.target = drafter.config, drafter.target
        self.needs_target_hidden = drafter.needs_target_hidden  # type: ignore[misc]
        self.provides_probabilities = drafter.provides_probabilities  # type: ignore[misc]

    def prefill(self, context: PrefillContext) -> None:  # pragma: no cover - builders never call it
        raise RuntimeError("a builder called prefill()")

    def commit(self, commit: Commit) -> None:  # pragma: no cover - builders never call it
        raise RuntimeError("a builder called commit()")

    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> Any:
        """Forwarded to the drafter under test (builders that draw children at random ask for it)."""
        fn = getattr(self.drafter, "distribution", None)
        return fn(tree, nodes) if fn is not None else None

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        got = self.checker.expand(self.drafter, tree, nodes, k, self.where, strict=False)
        for other, desc, exact in self.others:
            want = self.checker.expand(other, tree, nodes, k, f"{self.where} [{desc}]", strict=False)
            self.checker.same(got, want, tree, nodes, k, self.where, desc, exact)
        if self.record is not None:
            self.record.append((tree, nodes.clone(), k, got))
        return got


class _Checker:
    """The checks, for one drafter factory, target and settings."""

    def __init__(self, make_drafter: DrafterFactory, target: TargetModel, settings: Settings):
        self.make_drafter, self.target, self.s = make_drafter, target, settings
        self.vocab = target.vocab_size
        self.limit = target.max_positions
        self.label = "drafter"
        self.prompts = [self._encode(p, i) for i, p in enumerate(settings.prompts)]
        if not self.prompts:
            raise ValueError("the conformance checks need at least one prompt")
        for policy in settings.plan:
            if policy not in POLICIES:
                raise ValueError(f"unknown plan step {policy!r}; choose from {POLICIES}")

    # ------------------------------------------------------------------ plumbing
    def _encode(self, prompt: Sequence[int] | str, i: int) -> list[int]:
        if isinstance(prompt, str):
            if self.target.tokenizer is None:
                raise ValueError(f"prompt #{i} is text but the target has no tokenizer: give token ids")
            ids = list(self.target.tokenizer(prompt).input_ids)
        else:
            ids = [int(t) for t in prompt]
        if not ids or any(not 0 <= t < self.vocab for t in ids):
            raise ValueError(f"prompt #{i} must be 1+ token ids in [0, {self.vocab}): {ids}")
        return ids

    def fail(self, msg: str) -> ConformanceError:
        return ConformanceError(f"{self.label}: {msg}")

    def new(self, where: str) -> Drafter:
        try:
            drafter = self.make_drafter(self.target)
        except Exception as exc:
            raise self.fail(f"{where}: make_drafter(target) raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(drafter, Drafter):
            raise ConformanceError(f"make_drafter(target) returned {drafter!r}, not a treespec.Drafter")
        self.label = _label(drafter)
        return drafter

    def call(self, drafter: Drafter, method: str, arg: Any, where: str) -> Any:
        try:
            return getattr(drafter, method)(arg)
        except ConformanceError:
            raise
        except Exception as exc:
            raise self.fail(f"{where}: {method}() raised {type(exc).__name__}: {exc}") from exc

    def prefill(self, drafter: Drafter, committed: list[int], where: str) -> None:
        """Prefill as the Decoder does: the target caches committed[:-1] and, if the drafter asks,
        hands over their hidden states [L-1, H] (else ``hidden=None``)."""
        hidden = self.target.prefill(_ids(committed[:-1]), want_hidden=drafter.needs_target_hidden)
        self.call(drafter, "prefill", PrefillContext(input_ids=_ids(committed), hidden=hidden), where)

    def fresh(self, committed: list[int], where: str) -> Drafter:
        """A new drafter prefilled with the whole committed sequence (the reference)."""
        drafter = self.new(where)
        self.prefill(drafter, committed, f"{where} [prefilling a fresh drafter with {len(committed)} tokens]")
        return drafter

    def expand(self, drafter: Drafter, tree: DraftTree, nodes: torch.Tensor, k: int, where: str,
               strict: bool = True) -> Proposals:
        nodes = nodes.to(torch.long).reshape(-1)
        try:
            props = drafter.expand(tree, nodes.clone(), k)
        except ConformanceError:
            raise
        except Exception as exc:
            raise self.fail(f"{where}: expand(nodes={nodes.tolist()}, k={k}) raised {type(exc).__name__}: {exc}") from exc
        self.validate(props, tree, nodes, k, where, strict)
        return props

    def validate(self, props: Any, tree: DraftTree, nodes: torch.Tensor, k: int, where: str, strict: bool) -> None:
        """The contract on one ``expand`` answer. Structure (types, shape, CPU) always; the row rules
        (q in [0, 1], best first, padding last, distinct tokens in the vocabulary) if ``strict``."""
        call = f"{where}: expand(nodes={nodes.tolist()}, k={k})"
        tokens, q = getattr(props, "tokens", None), getattr(props, "q", None)
        if not isinstance(props, Proposals) or not isinstance(tokens, torch.Tensor) or not isinstance(q, torch.Tensor):
            raise self.fail(f"{call} returned {type(props).__name__}, not Proposals(tokens=Tensor, q=Tensor)")
        if tokens.dtype != torch.long:
            raise self.fail(f"{call}: tokens are {tokens.dtype}, expected torch.long")
        if not q.dtype.is_floating_point:
            raise self.fail(f"{call}: q are {q.dtype}, expected a floating dtype")
        if tokens.device.type != "cpu" or q.device.type != "cpu":
            raise self.fail(f"{call}: tokens on {tokens.device}, q on {q.device}; return CPU tensors (builders index them on the CPU)")
        m, lo = int(nodes.numel()), min(k, self.vocab)
        cols = tokens.shape[1] if tokens.dim() == 2 else -1
        if tokens.dim() != 2 or tuple(q.shape) != tuple(tokens.shape) or tokens.shape[0] != m or not lo <= cols <= k:
            want = f"[{m}, {k}]" if lo == k else f"[{m}, c] with {lo} <= c <= {k}"
            raise self.fail(f"{call}: tokens {list(tokens.shape)} and q {list(q.shape)}, expected both {want}")
        if not strict:
            return
        qd = q.double()
        for i, node in enumerate(nodes.tolist()):
            rt, rq = tokens[i].tolist(), qd[i].tolist()
            at = f"{call}: row {i} = {_node(tree, node)}: {_row(rt, rq)}:"
            bad = [x for x in rq if not (math.isfinite(x) and 0.0 <= x <= 1.0)]
            if bad:
                raise self.fail(f"{at} q = {bad[0]!r} is not in [0, 1]")
            n = _real(rq)
            later = next((j for j in range(n, len(rq)) if rq[j] > 0), None)
            if later is not None:
                raise self.fail(f"{at} padding (q == 0) at column {n} before q > 0 at column {later}; padding goes last")
            up = next((j for j in range(1, n) if rq[j] > rq[j - 1]), None)
            if up is not None:
                raise self.fail(f"{at} not best first: q[{up}] = {rq[up]:.6g} > q[{up - 1}] = {rq[up - 1]:.6g}")
            seen: dict[int, int] = {}
            for j, t in enumerate(rt[:n]):
                if t in seen:
                    raise self.fail(f"{at} token {t} proposed twice (columns {seen[t]} and {j}); a node's children must be distinct")
                seen[t] = j
                if not 0 <= t < self.vocab:
                    raise self.fail(f"{at} token {t} at column {j} is outside the target's vocabulary [0, {self.vocab})")

    def same(self, got: Proposals, want: Proposals, tree: DraftTree, nodes: torch.Tensor, k: int, where: str,
             desc: str, exact: bool = False) -> None:
        """Fail unless ``got`` equals ``want`` (exactly, or up to tolerance and ties)."""
        if tuple(got.tokens.shape) != tuple(want.tokens.shape):
            raise self.fail(f"{where}: expand(nodes={nodes.tolist()}, k={k}) gave shape {list(got.tokens.shape)}, "
                            f"{desc} gave {list(want.tokens.shape)}")
        gq, wq = got.q.double().tolist(), want.q.double().tolist()
        for i, node in enumerate(nodes.tolist()):
            g, w = (got.tokens[i].tolist(), gq[i]), (want.tokens[i].tolist(), wq[i])
            why = _row_mismatch(g, w, self.s.rtol, self.s.atol, exact)
            if why is not None:
                raise self.fail(
                    f"{where}: expand(nodes={nodes.tolist()}, k={k}), row {i} = {_node(tree, node)} differs from {desc}: {why}\n"
                    f"    expected ({desc}): {_row(*w)}\n    got: {_row(*g)}"
                )

    def build(self, builder: TreeBuilder, name: str, probe: _Probe, root: int, max_depth: int, where: str) -> DraftTree:
        try:
            return builder.build(probe, root, max_depth)
        except ConformanceError:
            raise
        except Exception as exc:
            raise self.fail(f"{where}: builder {name} failed on this drafter's proposals: {type(exc).__name__}: {exc}") from exc

    def choose(self, policy: str, tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The accepted path (root first) and the bonus token of a step ending by ``policy``."""
        tt = tree.tensors(0, dtype=self.target.dtype)
        if policy == "target":
            acc = greedy_verify(tt, logits)
            return acc.nodes.cpu(), acc.bonus
        if policy in ("reject", "root"):  # the bonus: the target's best token that is no child of the root
            kids = set(tree.tokens[tree.parents == 0].tolist())
            bonus = next(t for t in logits[0].argsort(descending=True).tolist() if t not in kids)
            return torch.zeros(1, dtype=torch.long), int(bonus)
        # deepest: the deepest node (then the most likely, then the oldest), and the target's token after it
        depth = tree.depths.max()
        cand = (tree.depths == depth).nonzero().flatten()
        node = int(cand[int(tree.phat[cand].argmax())])
        return torch.tensor(tree.path(node), dtype=torch.long), int(logits[node].argmax())

    def drive(self, drafter: Drafter, prompt: list[int], builder_factory: BuilderFactory, plan: Sequence[str],
              where: str, *, reference: bool = False, twin: tuple[Drafter, str, bool] | None = None,
              record: list | None = None) -> list[int]:
        """Decode ``len(plan)`` steps from ``prompt`` like ``Decoder._run``, each step ending as its
        policy says, then grow one more tree. Every ``expand`` goes through a ``_Probe``: compared
        with ``twin`` (driven identically) and, if ``reference``, with a fresh drafter prefilled with
        the committed sequence (from the first commit on). Returns the committed sequence."""
        target, nh = self.target, drafter.needs_target_hidden
        name, make_builder = builder_factory
        builder = make_builder()
        committed = list(prompt)
        self.prefill(drafter, committed, f"{where}, prefill")
        if twin is not None:
            self.prefill(twin[0], committed, f"{where}, prefill [{twin[1]}]")
        done: list[str] = []
        for step, policy in enumerate([*plan, None]):
            before = f"after {', '.join(done)}" if done else "the first step"
            here = f"{where}, builder {name}, step {step} ({before}; {len(committed)} tokens committed)"
            others = [twin] if twin is not None else []
            ref = None
            if reference and step > 0:
                ref = self.fresh(committed, here)
                others.append((ref, f"a fresh drafter prefilled with the {len(committed)} committed tokens", False))
            target.prefill(_ids(committed[:-1]))  # the target's cache holds committed[:-1], as in the Decoder
            room = self.limit - len(committed) - 1 if self.limit is not None else 1 << 30
            if room < 0:  # the target's context is full
                break
            probe = _Probe(self, drafter, others, here, record)
            tree = self.build(builder, name, probe, committed[-1], 0 if policy == "root" else room, here)
            if ref is not None:
                ref.close()
            if policy is None:
                break
            # verify: one target forward over the tree, then commit like Decoder._run
            tt = tree.tensors(target.past_len, dtype=target.dtype)
            logits, hidden = target.forward_tree(tt, want_hidden=nh)  # [N, V], [N, H]
            path, bonus = self.choose(policy, tree, logits)
            target.commit(path)
            new = tree.tokens[path[1:]].tolist() + [bonus]
            commit = Commit(tokens=new, hidden=hidden[path] if hidden is not None else None)
            self.call(drafter, "commit", commit, f"{here}, commit({new})")
            if twin is not None:
                self.call(twin[0], "commit", commit, f"{here}, commit({new}) [{twin[1]}]")
            committed += new
            done.append(f"step {step} {policy!r} accepted {len(new) - 1} + bonus")
        return committed

    @staticmethod
    def unproposed(props: Proposals, row: int, vocab: int, salt: int) -> int:
        """A token the drafter did not propose in ``row`` (avoiding ids 0-2, often special)."""
        proposed = set(props.tokens[row][props.q[row] > 0].tolist())
        start = 3 + (17 * salt + 5) % max(vocab - 3, 1)
        for i in range(vocab):
            t = 3 + (start - 3 + i) % max(vocab - 3, 1)
            if t not in proposed:
                return t
        return 0

    # ------------------------------------------------------------------ the checks
    def contract(self) -> None:
        k, prompt = min(self.s.k, self.vocab), self.prompts[0]
        d = self.new("contract")
        where = "contract (hand-built tree on prompt #0)"
        self.prefill(d, prompt, f"{where}, prefill")
        tree = DraftTree(prompt[-1])

        def ask(nodes: list[int]) -> Proposals:
            before = [t.clone() for t in (tree.tokens, tree.parents, tree.depths, tree.q, tree.phat)]
            props = self.expand(d, tree, torch.tensor(nodes), k, where)
            after = (tree.tokens, tree.parents, tree.depths, tree.q, tree.phat)
            if any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(before, after)):
                raise self.fail(f"{where}: expand(nodes={nodes}, k={k}) modified the tree; a drafter must only read it")
            return props

        p0 = ask([0])  # M = 1: the root
        top = p0.tokens[0][p0.q[0] > 0][:2].tolist()
        u = self.unproposed(p0, 0, self.vocab, salt=1)
        kids = tree.add_children(torch.zeros(len(top) + 1, dtype=torch.long), _ids(top + [u]),
                                 torch.tensor([0.5] * (len(top) + 1)))  # proposed children + one it did not propose
        p1 = ask(kids.flip(0).tolist())  # several nodes in one call, newest first: row r is kids[-1 - r]
        n = len(kids)
        parents, tokens = [], []
        if top:  # below the best proposed child: its own best proposal (or any token if it has none)
            row = n - 1
            best = p1.tokens[row][p1.q[row] > 0][:1].tolist()
            parents.append(int(kids[0]))
            tokens.append(best[0] if best else self.unproposed(p1, row, self.vocab, salt=2))
        parents.append(int(kids[-1]))  # below the unproposed child: another unproposed token
        tokens.append(self.unproposed(p1, 0, self.vocab, salt=3))
        grand = tree.add_children(_ids(parents), _ids(tokens), torch.full((len(tokens),), 0.25))
        nodes = list(dict.fromkeys([int(grand[-1]), 0, int(kids[-1]), int(grand[0])]))  # depths 2, 0, 1, 2: not BFS
        p2 = ask(nodes)
        root = torch.tensor([0])
        self.same(ask([0]), p0, tree, root, k, f"{where}, root asked for again",
                  "its own first answer for the root in this step")
        self.same(Proposals(tokens=p2.tokens[1:2], q=p2.q[1:2]), p0, tree, root, k,
                  f"{where}, root asked among other nodes (row 1 of expand(nodes={nodes}))",
                  "its answer for the root alone")
        d.close()

    def budget(self) -> None:
        prompt = self.prompts[0]
        d = self.new("budget")
        where = "budget (prompt #0)"
        self.prefill(d, prompt, f"{where}, prefill")
        tree = DraftTree(prompt[-1])
        root = torch.tensor([0])
        kk = min(5, self.vocab)
        p1 = self.expand(d, tree, root, 1, where)
        pk = self.expand(d, tree, root, kk, where)
        big = self.vocab + 3
        pb = self.expand(d, tree, root, big, where)
        head = Proposals(tokens=pk.tokens[:, :1], q=pk.q[:, :1])
        self.same(p1, head, tree, root, 1, f"{where}, k=1 vs k={kk}", f"the first column of its answer for k={kk}")
        self.same(pk, Proposals(tokens=pb.tokens[:, :kk], q=pb.q[:, :kk]), tree, root, kk,
                  f"{where}, k={kk} vs k={big}", f"the first {kk} columns of its answer for k={big}")
        top = pk.tokens[0][pk.q[0] > 0][:2].tolist() + [self.unproposed(pk, 0, self.vocab, salt=3)]
        kids = tree.add_children(torch.zeros(len(top), dtype=torch.long), _ids(top), torch.full((len(top),), 0.5))
        self.expand(d, tree, kids, 1, f"{where}, several nodes with k=1")
        d.close()

    def determinism(self) -> None:
        a, b = self.new("determinism"), self.new("determinism")
        self.drive(a, self.prompts[0], self.s.builders[0], self.s.plan[:3], "determinism (prompt #0)",
                   twin=(b, "a second fresh drafter given the same calls", True))
        a.close()
        b.close()

    def prefill_starts_over(self) -> None:
        a = self.new("prefill starts over")
        other = self.prompts[1] if len(self.prompts) > 1 else self.prompts[0][:-1] or self.prompts[0]
        self.drive(a, other, self.s.builders[0], self.s.plan[:2], "prefill starts over (first sequence)")
        b = self.new("prefill starts over")
        self.drive(a, self.prompts[0], self.s.builders[0], self.s.plan[:3],
                   "prefill starts over (second sequence, prompt #0)",
                   twin=(b, "a fresh drafter (this one had decoded another sequence before its prefill)", False))
        a.close()
        b.close()

    def commit_consistency(self) -> None:
        for name_builder in self.s.builders:
            for i, prompt in enumerate(self.prompts[: max(1, self.s.consistency_prompts)]):
                d = self.new("commit consistency")
                self.drive(d, prompt, name_builder, self.s.plan, f"commit consistency (prompt #{i})", reference=True)
                d.close()

    def unproposed_nodes(self) -> None:
        prompt, k = self.prompts[0], min(self.s.k, self.vocab)
        where = "unproposed nodes (prompt #0)"
        d = self.new(where)
        nh = d.needs_target_hidden
        self.prefill(d, prompt, f"{where}, prefill")
        tree = DraftTree(prompt[-1])
        p0 = self.expand(d, tree, torch.tensor([0]), k, where)
        u = self.unproposed(p0, 0, self.vocab, salt=5)
        (node_u,) = tree.add_children(torch.tensor([0]), _ids([u]), torch.tensor([0.5])).tolist()
        pu = self.expand(d, tree, torch.tensor([node_u]), k, f"{where}, child {u} that the drafter did not propose")
        u2 = self.unproposed(pu, 0, self.vocab, salt=6)
        (node_u2,) = tree.add_children(torch.tensor([node_u]), _ids([u2]), torch.tensor([0.5])).tolist()
        nodes = [node_u2]
        top = p0.tokens[0][p0.q[0] > 0][:1].tolist()
        if top:  # and a proposed child, in the same call
            nodes += tree.add_children(torch.tensor([0]), _ids(top), p0.q[0, :1]).tolist()
        p2 = self.expand(d, tree, torch.tensor(nodes), k, f"{where}, grandchild {u2} (also unproposed)")
        if self.s.path_exact:
            rows = [(node_u, pu, 0)] + [(n, p2, i) for i, n in enumerate(nodes)]
            for node, props, i in rows:
                path = tree.path_tokens(node)
                ref = self.fresh(prompt + path[1:], where)
                want = self.expand(ref, DraftTree(path[-1]), torch.tensor([0]), k, f"{where} [fresh drafter]")
                one = Proposals(tokens=props.tokens[i : i + 1], q=props.q[i : i + 1])
                self.same(one, want, tree, torch.tensor([node]), k, f"{where} (path_exact)",
                          f"a fresh drafter prefilled with prompt + this node's path, asked for its root")
                ref.close()
        # the target accepts the unproposed path root → u → u2; the bonus is its own token after it
        self.target.prefill(_ids(prompt[:-1]))
        tt = tree.tensors(self.target.past_len, dtype=self.target.dtype)
        logits, hidden = self.target.forward_tree(tt, want_hidden=nh)
        path = torch.tensor([0, node_u, node_u2])
        new = [u, u2, int(logits[node_u2].argmax())]
        self.target.commit(path)
        self.call(d, "commit", Commit(tokens=new, hidden=hidden[path] if hidden is not None else None),
                  f"{where}, commit({new}) of a path the drafter did not propose")
        committed = prompt + new
        ref = self.fresh(committed, where)
        self.target.prefill(_ids(committed[:-1]))
        name, make_builder = self.s.builders[0]
        here = f"{where}, builder {name}, after accepting {[u, u2]} (never proposed) + bonus {new[-1]}"
        probe = _Probe(self, d, [(ref, f"a fresh drafter prefilled with the {len(committed)} committed tokens", False)], here)
        room = self.limit - len(committed) - 1 if self.limit is not None else 1 << 30
        self.build(make_builder(), name, probe, committed[-1], room, here)
        ref.close()
        d.close()

    def flags(self) -> None:
        d = self.new("flags")
        for flag in ("needs_target_hidden", "provides_probabilities"):
            value = getattr(d, flag)
            if not isinstance(value, bool):
                raise self.fail(f"flags: {flag} = {value!r}; it must be a bool class attribute")
        record: list = []
        try:
            self.drive(d, self.prompts[0], self.s.builders[0], self.s.plan[:3], "flags (prompt #0)", record=record)
        except ConformanceError as exc:
            if d.needs_target_hidden:
                raise
            raise ConformanceError(
                f"{exc}\n  (it declares needs_target_hidden = False, so it is given PrefillContext.hidden = None and "
                f"Commit.hidden = None, and must work without them)"
            ) from exc
        if d.provides_probabilities:
            for tree, nodes, k, props in record:
                sums = props.q.double().sum(dim=1)
                for i, node in enumerate(nodes.tolist()):
                    if float(sums[i]) > 1 + 1e-5:
                        raise self.fail(
                            f"flags: provides_probabilities = True, but the q of expand(nodes={nodes.tolist()}, k={k}), "
                            f"row {i} = {_node(tree, node)} sum to {float(sums[i]):.6g} > 1: "
                            f"{_row(props.tokens[i].tolist(), props.q[i].tolist())}; "
                            f"set provides_probabilities = False if q are scores"
                        )
        d.close()

    def lossless(self) -> None:
        from treespec.decoder import Decoder
        from treespec.errors import DecodingError

        accepted = 0
        for name, make_builder in self.s.builders:
            d = self.new("lossless")
            dec = Decoder(self.target, drafter=d, builder=make_builder())
            for i, prompt in enumerate(self.prompts):
                n = self.s.max_new_tokens
                if self.limit is not None:
                    n = min(n, self.limit - len(prompt))
                if n <= 0:
                    continue
                where = f"lossless: Decoder(builder {name}).generate(prompt #{i}, max_new_tokens={n})"
                try:
                    out = dec.generate(prompt, max_new_tokens=n)
                except DecodingError as exc:
                    raise self.fail(f"{where} failed: {exc}") from exc
                want = _reference(self.target, prompt, n)
                if out.token_ids != want:
                    j = next((j for j, (a, b) in enumerate(zip(out.token_ids, want)) if a != b),
                             min(len(out.token_ids), len(want)))
                    raise self.fail(
                        f"{where} differs from the target's own greedy generate() at new token {j}: "
                        f"got {out.token_ids[j:j + 5]}, expected {want[j:j + 5]} (lengths {len(out.token_ids)} vs {len(want)}). "
                        "Decoding must be lossless whatever the drafter proposes: does it modify the tree, the target "
                        "or its cache?"
                    )
                accepted += sum(s.accepted for s in out.stats.steps)
            d.close()
        if self.s.expect_acceptance and accepted == 0:
            raise self.fail("lossless: no draft token was accepted in any run (expect_acceptance = True)")


_REFERENCES: "weakref.WeakKeyDictionary[Any, dict[tuple, list[int]]]" = weakref.WeakKeyDictionary()


def _reference(target: TargetModel, prompt: list[int], n: int) -> list[int]:
    """The target's own ``generate(do_sample=False)``, cached per model, prompt, length and EOS."""
    gen = getattr(target.model, "generation_config", None)
    key = (tuple(prompt), n, repr(getattr(gen, "eos_token_id", None)))
    cache = _REFERENCES.setdefault(target.model, {})
    if key not in cache:
        ids = _ids(prompt)[None].to(target.device)
        with torch.inference_mode():
            out = target.model.generate(ids, do_sample=False, max_new_tokens=n)
        cache[key] = out[0, ids.shape[1] :].tolist()
    return cache[key]


# ---------------------------------------------------------------------------------------------------
# the checks as functions


def _checker(make_drafter: DrafterFactory, target: TargetModel | None, settings: dict[str, Any]) -> _Checker:
    return _Checker(make_drafter, target if target is not None else tiny_target(), Settings(**settings))


def check_contract(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """Check 1, the shape of every answer. On a hand-built tree (the root; its best proposals and a
    child it did not propose; grandchildren), ``expand`` is asked for one node, for several nodes in
    one call (newest first) and for nodes at depths 2, 0, 1, 2 in one call (not BFS order).

    Every answer must be ``Proposals`` of CPU tensors, ``tokens`` long and ``q`` floating, both
    ``[M, k]`` for M requested nodes, with per row: ``0 <= q <= 1``; best first (q non-increasing);
    padding (``q == 0``) only at the end; distinct non-padding tokens; tokens in ``[0, vocab)``.
    ``expand`` must not modify the tree, and a node asked for again in the same step (alone or among
    others) must get the same answer. Why: builders rely on all of it without checking — ``opt-tree``
    ranks flattened ``[M, k]`` candidates, ``chain`` takes column 0 as the best child, every builder
    stops at the first ``q == 0``, and a duplicate token becomes a duplicate branch that wastes budget.
    """
    _checker(make_drafter, target, settings).contract()


def check_budget(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """Check 7, budget respect: asking for k children returns exactly k columns (``k = 1`` works,
    also for several nodes at once), and never more than k (for k above the vocabulary size, at least
    ``vocab`` columns); fewer children asked give the best ones of a larger request (the first
    column of ``k = 5`` is the answer to ``k = 1``, ties aside). Why: ``chain`` asks for ``k = 1``
    and trusts it to be the drafter's best guess; ``opt-tree`` asks for its whole node budget."""
    _checker(make_drafter, target, settings).budget()


def check_determinism(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """Check 2, determinism: two fresh drafters driven by the same calls (prefill, the trees
    ``opt-tree`` grows, the same commits for three steps) give bit-identical proposals. Why: the
    other checks compare a drafter with a fresh one, and a benchmark must be reproducible."""
    _checker(make_drafter, target, settings).determinism()


def check_prefill_starts_over(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """``prefill`` resets every per-sequence state: a drafter that already decoded another sequence,
    prefilled again, answers like a fresh one (up to tolerance). Why: a ``Decoder`` keeps one drafter
    instance for all its ``generate`` calls. (A drafter that deliberately learns across sequences
    should skip this check.)"""
    _checker(make_drafter, target, settings).prefill_starts_over()


def check_commit_consistency(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """Check 3, the important one: after ``commit``, the drafter is in the state a fresh drafter
    prefilled with the whole committed sequence would be in.

    Each builder (``opt-tree``, ``chain``) decodes real steps from the first prompts: grow a tree,
    verify it with ONE target forward, commit the accepted path + bonus token (with the target's
    hidden states of the root and accepted nodes when ``needs_target_hidden``, exactly as
    ``Decoder._run``). How each step ends follows ``plan``: ``target`` (greedy verification),
    ``reject`` (nothing accepted; the bonus is the target's best token that is no child of the root),
    ``deepest`` (the path to the deepest node accepted), ``root`` (``max_depth = 0``: no ``expand`` at
    all in that step). From the first commit on, every ``expand`` of the next step is also sent to a
    FRESH drafter prefilled with the committed sequence (with the target's hidden states of
    ``committed[:-1]``), and the answers must agree: q within ``rtol``/``atol``, tokens equal except
    among tied q. Why: a drafter that keeps state of rejected nodes (KV rows, features, counts) or
    loses state of accepted ones drafts from a wrong context — decoding stays lossless, but
    acceptance silently collapses, which no other test notices.
    """
    _checker(make_drafter, target, settings).commit_consistency()


def check_unproposed_nodes(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """Check 4, nodes the drafter did not propose: the check adds a child with a token the drafter
    did not propose, and a grandchild below it, asks for their proposals (valid as in check 1), then
    commits that path as accepted; afterwards the drafter must agree with a fresh drafter prefilled
    with the committed sequence. With ``path_exact`` the proposals at those nodes (and at a proposed
    child) must also equal a fresh drafter's for prompt + the node's path. Why: builders may add
    tokens from elsewhere (static shapes, other drafters in a composition, a datastore), and the
    target may accept them: a drafter must not assume every node or accepted token came from it."""
    _checker(make_drafter, target, settings).unproposed_nodes()


def check_flags(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """Check 5, honest capability flags: both are bools. With ``needs_target_hidden = False`` the
    Decoder passes ``PrefillContext.hidden = None`` and ``Commit.hidden = None`` (it does not ask the
    target for them), and the drafter must work so for a few steps. With ``provides_probabilities =
    True`` the q of every answer must sum to at most 1 (+1e-5): they are (part of) a distribution,
    which sampling verifiers will rely on."""
    _checker(make_drafter, target, settings).flags()


def check_lossless(make_drafter: DrafterFactory, target: TargetModel | None = None, **settings: Any) -> None:
    """Check 6, lossless end to end: ``treespec.Decoder(target, drafter=<instance>, builder=...)`` with
    ``opt-tree`` and ``chain`` on every prompt (one drafter instance per builder, reused across
    prompts) equals the target's own ``model.generate(do_sample=False)`` token for token. With
    ``expect_acceptance`` at least one draft token must be accepted overall (a drafter that never
    drafts is lossless too). Why: whatever a drafter proposes, decoding must not change; a drafter
    that touches the target, its cache or the tree breaks this."""
    _checker(make_drafter, target, settings).lossless()


#: every check, in the order ``check_drafter`` runs them
CHECKS: dict[str, Callable[..., None]] = {
    "contract": check_contract,
    "budget": check_budget,
    "determinism": check_determinism,
    "prefill_starts_over": check_prefill_starts_over,
    "commit_consistency": check_commit_consistency,
    "unproposed_nodes": check_unproposed_nodes,
    "flags": check_flags,
    "lossless": check_lossless,
}


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
            f"{len(failures)} of {len(CHECKS) - len(skip)} drafter conformance checks failed:\n\n" + "\n\n".join(failures)
        )


# ---------------------------------------------------------------------------------------------------
# the pytest base class


def _fixture(fn: Callable) -> Callable:
    return pytest.fixture(fn) if pytest is not None else fn


class DrafterConformance:
    """Subclass it in a test module (name it ``Test...``) and implement ``make_drafter``; pytest then
    runs one test per check (see each ``check_*`` function for what it enforces and why).

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

    def make_drafter(self, target: TargetModel) -> Drafter:
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

    def _settings(self) -> dict[str, Any]:
        names = {f.name for f in fields(Settings)} - {"prompts", "builders"}
        out: dict[str, Any] = {name: getattr(self, name) for name in names}
        out["prompts"], out["builders"] = self.prompts(), self.builders()
        return out

    def _run(self, check: str, target: TargetModel) -> None:
        CHECKS[check](self.make_drafter, target, **self._settings())

    def test_contract(self, target: TargetModel) -> None:
        """Check 1: shapes and row rules of every ``expand`` answer (see ``check_contract``)."""
        self._run("contract", target)

    def test_determinism(self, target: TargetModel) -> None:
        """Check 2: two fresh drafters, same calls, identical proposals (see ``check_determinism``)."""
        self._run("determinism", target)

    def test_prefill_starts_over(self, target: TargetModel) -> None:
        """``prefill`` resets per-sequence state (see ``check_prefill_starts_over``)."""
        self._run("prefill_starts_over", target)

    def test_commit_consistency(self, target: TargetModel) -> None:
        """Check 3: after each commit, the drafter equals a fresh one prefilled with the committed
        sequence (see ``check_commit_consistency``)."""
        self._run("commit_consistency", target)

    def test_unproposed_nodes(self, target: TargetModel) -> None:
        """Check 4: nodes (and accepted tokens) the drafter did not propose (see ``check_unproposed_nodes``)."""
        self._run("unproposed_nodes", target)

    def test_flags(self, target: TargetModel) -> None:
        """Check 5: ``needs_target_hidden`` and ``provides_probabilities`` are honest (see ``check_flags``)."""
        self._run("flags", target)

    def test_lossless(self, target: TargetModel) -> None:
        """Check 6: the Decoder's output equals the target's greedy ``generate`` (see ``check_lossless``)."""
        self._run("lossless", target)

    def test_budget(self, target: TargetModel) -> None:
        """Check 7: never more than k columns; k = 1 works and is the best child (see ``check_budget``)."""
        self._run("budget", target)
