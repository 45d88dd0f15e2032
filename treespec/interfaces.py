"""The two plugin interfaces: ``Drafter`` proposes tokens, ``TreeBuilder`` decides the tree's shape.

Builders never see the target; drafters never see the target's cache. See ``docs/design.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from treespec.config import PluginConfig

if TYPE_CHECKING:
    import torch

    from treespec.sampling import DraftSampling
    from treespec.stats import StepStats
    from treespec.target import TargetModel
    from treespec.tree import DraftTree


@dataclass(frozen=True)
class Proposals:
    """Up to k children for each of M expanded nodes.

    ``tokens[i, j]`` is the j-th proposed child of the i-th requested node and ``q[i, j]`` its draft
    probability given that node's path, best first. Entries with ``q == 0`` are padding.
    """

    tokens: torch.Tensor  # [M, k] long
    q: torch.Tensor  # [M, k] float

    @classmethod
    def ranked(cls, found: Sequence[Sequence[tuple[int, float]]], k: int) -> Proposals:
        """From each node's ``(token, q)`` candidates, best first: the first k of each, the rest padding
        (token 0, q = 0)."""
        import torch  # here: importing the interfaces (``treespec plugins``, ``--help``) needs no torch

        tokens = [[0] * k for _ in found]
        q = [[0.0] * k for _ in found]
        for i, cands in enumerate(found):
            for j, (tok, p) in enumerate(cands[:k]):
                tokens[i][j], q[i][j] = tok, p
        m = len(found)
        return cls(
            tokens=torch.tensor(tokens, dtype=torch.long).reshape(m, k),  # [M, k]
            q=torch.tensor(q, dtype=torch.float32).reshape(m, k),  # [M, k]
        )


@dataclass(frozen=True)
class PrefillContext:
    """What a drafter learns about a new prompt before the first step."""

    input_ids: torch.Tensor  # [L] long: the whole prompt; its last token is the first root
    hidden: torch.Tensor | None = None  # [L-1, H] the target's hidden states of prompt[:-1],
    #                                       given only to drafters with needs_target_hidden
    #                                       ([L-1, k·H] for k target_hidden_layers)


@dataclass(frozen=True)
class Commit:
    """The outcome of one step, told to the drafter.

    ``tokens`` are the accepted draft tokens followed by the target's bonus token; they extend the
    committed sequence, and the bonus token is the next step's root. ``hidden`` (only for drafters
    with ``needs_target_hidden``) holds the target's hidden states of the old root and the accepted
    nodes: ``[len(tokens), H]`` (``k·H`` for k ``target_hidden_layers``), row i being the state at the token *before* ``tokens[i]``.
    """

    tokens: list[int]
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class PlanNote:
    """What a planning builder expected of the tree it just built, reported with the step's statistics
    so that plans can be checked against what happened (``TreeBuilder.plan_note``)."""

    predicted_seconds: float  # the step's predicted wall time (drafting, verification, bookkeeping)
    expected: float  # E(A) of the verified tree by the builder's own (e.g. calibrated) p̂
    own_seconds: float  # the builder's own decision time in the step, drafting excluded


class Drafter(ABC):
    """Proposes candidate next tokens for nodes of a draft tree.

    Lifecycle per generation (driven by ``treespec.step``)::

        prefill(context)                      once: a new sequence
        begin_step(root)                      each step: its tree starts at the last committed token
          expand(tree, nodes, k)  ...          any number of calls on that ONE growing tree
        commit(commit)                        the step is over: accepted tokens + bonus

    Node ids are stable within a step: every ``expand`` between ``begin_step`` and ``commit`` is
    about the same tree, which only grows. A drafter creates its state in ``__init__`` or
    ``prefill``, resets per-step state in ``begin_step`` (never by comparing tree objects), owns all
    of it (draft KV cache, features, index) and is consistent again after ``commit``.
    """

    Config: ClassVar[type[PluginConfig]] = PluginConfig
    #: the Decoder asks the target for hidden states (PrefillContext.hidden, Commit.hidden) only if set
    needs_target_hidden: ClassVar[bool] = False
    #: which hidden states, when ``needs_target_hidden``: None = the last layer's (after the final
    #: norm; EAGLE-1/2), else indices into Hugging Face's ``hidden_states`` (0 = the embeddings, i = the
    #: input of decoder layer i), concatenated on the feature axis (EAGLE-3: three layers, [N, 3H])
    target_hidden_layers: ClassVar[tuple[int, ...] | None] = None
    #: False when q are scores (e.g. normalised match counts) rather than the draft's probabilities
    provides_probabilities: ClassVar[bool] = True

    def __init__(self, config: PluginConfig, target: TargetModel):
        self.config = config
        self.target = target

    @classmethod
    def from_options(cls, options: dict[str, Any], target: TargetModel, owner: str) -> Drafter:
        """Build from raw ``name=value`` options (the registry calls this): validate them against
        ``Config`` (errors name ``owner``, e.g. ``"drafter 'ngram'"``), then ``cls(config, target)``.
        Override only when some options are not your Config's (``compose`` routes ``PART.option``
        to its parts)."""
        from treespec.config import build_config

        return cls(build_config(cls.Config, options, owner), target)

    def cost_options(self) -> dict[str, Any]:
        """The options a cost profile of this drafter is keyed by (``treespec profile``, ``nodes=auto``'s
        quick measurement): every option set. Override to add what the options leave implicit but the
        cost depends on (EAGLE: the draft vocabulary its head names by default)."""
        return {k: v for k, v in dict(getattr(self, "config", {}) or {}).items() if v is not None}

    def fork(self) -> Drafter:
        """A drafter for another sequence decoded alongside this one (a batch row), sharing this one's
        weights but none of its per-sequence state. The default is a shallow copy, which is right when
        ``prefill`` (re)creates every piece of per-sequence state, as the lifecycle above asks;
        override it if ``prefill`` mutates in place something made in ``__init__``."""
        import copy

        return copy.copy(self)

    def rows(self, n: int) -> DraftRows:
        """Drafters for ``n`` sequences decoded together (a batch), sharing this one's weights. The
        default: ``n`` forks that expand one after another. Drafters that can expand every row's
        frontier in ONE draft forward return a ``DraftRows`` with ``batched = True`` (EAGLE's)."""
        return DraftRows([self.fork() for _ in range(n)], base=self)

    @abstractmethod
    def prefill(self, context: PrefillContext) -> None:
        """Start a new sequence. Called once per ``generate``, before the first step."""

    def begin_step(self, root_token: int) -> None:
        """A step starts: its tree's root is ``root_token``, the last committed token (after
        ``prefill`` it is the prompt's last token; after ``commit``, the bonus token). Every
        ``expand`` until the next ``commit`` is about this one tree. Drop per-step state here (e.g.
        draft KV rows of an earlier tree). A builder that starts its tree over within a step calls
        it again. The default does nothing: drafters without per-step state need not override it."""

    @abstractmethod
    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        """Propose up to ``k`` children for each node id in ``nodes`` ([M] long) of ``tree``.

        Returns ``Proposals`` with tensors of shape [M, k]. Distinct tokens per node, best first.
        """

    @abstractmethod
    def commit(self, commit: Commit) -> None:
        """The step is over: ``commit.tokens`` were appended to the sequence. Drop draft state of
        rejected nodes, keep the rest."""

    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor | None:
        """The draft's full next-token distribution [M, V'] (temperature 1) after each of ``nodes``,
        which this step's ``expand`` calls have already been asked about; V' may be smaller than the
        target's vocabulary (missing tokens have probability 0). None (the default): this drafter has
        no such distribution, so builders cannot draw children from it (docs/sampling.md)."""
        return None

    def close(self) -> None:
        """Release resources (optional)."""


@dataclass(frozen=True)
class Expansion:
    """One row's ``Drafter.expand`` call, as a lockstep round of a batch collects it."""

    tree: DraftTree
    nodes: torch.Tensor  # [M] long
    k: int


class DraftRows:
    """The drafters of a batch's rows (``Drafter.rows``): ``drafters[i]`` is row i's, a full
    ``Drafter`` that each row's builder uses as usual.

    When ``batched`` is True, ``treespec.lockstep`` runs the rows' builders side by side: every
    ``expand`` call the rows make in one round is passed to ``expand_together`` at once, which answers
    all of them with one draft forward per tree level. The default answers them one row at a time.
    """

    #: True: ``expand_together`` does one forward for all rows (the lockstep driver is worth it)
    batched: ClassVar[bool] = False

    def __init__(self, drafters: list[Drafter], base: Drafter | None = None):
        self.drafters = drafters
        self.base = base if base is not None else drafters[0]  # what new rows are forks of

    def expand_together(self, requests: dict[int, Expansion]) -> dict[int, Proposals]:
        """``{row: Expansion}`` → ``{row: Proposals}``: the same answers as ``drafters[row].expand``."""
        return {i: self.drafters[i].expand(r.tree, r.nodes, r.k) for i, r in requests.items()}

    def keep(self, rows: list[int]) -> None:
        """Only the rows ``rows`` (indices into ``drafters``) go on: finished rows leave the batch."""
        self.drafters = [self.drafters[i] for i in rows]

    def add(self, n: int) -> list[Drafter]:
        """``n`` new rows join at the end (new sequences taking finished rows' places); returns their
        drafters, which the Decoder then prefills. The default: forks of ``base``."""
        new = [self.base.fork() for _ in range(n)]
        self.drafters += new
        return new


class TreeBuilder(ABC):
    """Decides which nodes to expand and which to keep, using a drafter's proposals.

    The contract is ``build``; everything else has a default. Optional: ``verified`` (learn from what
    the target accepted), ``start`` (keep the draft-side sampling settings, for builders that draw
    children at random), and the facts ``max_nodes`` / ``max_drafted`` / ``samples_children`` the
    Decoder checks before anything runs. Builders that plan from measured costs extend
    ``PlanningBuilder`` instead (docs/plugins.md)."""

    Config: ClassVar[type[PluginConfig]] = PluginConfig
    #: the draft-side sampling settings kept by ``start`` (None: rank children by the draft's top-k)
    sampling: DraftSampling | None = None

    def __init__(self, config: PluginConfig):
        self.config = config

    @abstractmethod
    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        """Grow this step's tree from ``root_token``. No node may be deeper than ``max_depth``
        (the Decoder's cap from ``max_new_tokens`` and the context; 0 means root only)."""

    def verified(self, tree: DraftTree, path: torch.Tensor) -> None:
        """Called by ``treespec.step`` right after the target verified the tree ``build`` returned:
        ``path`` [m+1] holds the accepted node ids, root first. Builders that learn how often the
        target accepts (calibrated p̂) override it; the default ignores it."""

    def start(self, sampling: DraftSampling | None) -> None:
        """Called by the Decoder at the start of every ``generate``: None for greedy decoding, else the
        draft-side settings (draft temperature, the run's ``torch.Generator``). Builders that can draw
        children at random keep it (and then record the draws in the tree, docs/sampling.md); the
        others, which rank children by the draft's top-k, ignore it."""
        self.sampling = sampling if self.samples_children else None

    @property
    def samples_children(self) -> bool:
        """True when ``build`` draws children at random from the draft's distribution once ``start``
        gave it a ``DraftSampling``; such builders need ``Drafter.distribution``. By default: the
        builder's ``sample`` option (chain, static, sequoia), False for builders without one."""
        return bool(getattr(self.config, "sample", False))

    @property
    def max_nodes(self) -> int | None:
        """The most drafted nodes (root excluded) one tree of this builder's settings can have, or
        None if it cannot say. The Decoder refuses a builder whose trees the target could not verify
        in one forward (``TargetModel.max_tree_nodes``) before anything runs."""
        return None

    @property
    def max_drafted(self) -> int | None:
        """The most nodes one step may draft before choosing the ``max_nodes`` it verifies (EAGLE-2
        drafts k + (D - 1)·k² and keeps its best), or None when that is ``max_nodes``. The Decoder
        refuses settings whose draft tree would not fit this machine's memory, before anything runs."""
        return None


class PlanningBuilder(TreeBuilder):
    """A builder that plans every tree from what steps cost on this machine (``opt-tree nodes=auto``).

    On top of ``build``, the Decoder gives it its target and drafter once (``attach``: e.g. to look up
    or measure a cost profile), the builders of a batch's other rows (``join_batch``), and every
    step's statistics (``observe``); it tells the Decoder what it expected of its last tree
    (``plan_note``, copied into the step's ``StepStats``)."""

    #: how many sequences are decoded together with this builder's: 1 alone, B for a row of a batch
    #: (set by the Decoder before ``attach``: a node is priced as its share of a B-row step)
    batch_size: int = 1

    def attach(self, target: TargetModel, drafter: Drafter) -> None:
        """Called once by the ``Decoder`` that will run this builder, with its target and drafter."""

    def join_batch(self, peers: list[TreeBuilder]) -> None:
        """Called once by the Decoder, after ``attach``, with the builders of all rows of a batch (this
        one included; ``batch_size`` of them). Rows that should agree on something link up here (the
        auto planner's shared budget)."""

    def observe(self, stats: StepStats) -> None:
        """Feedback after each step: its statistics (sizes, accepted tokens, phase and wall seconds)."""

    def plan_note(self) -> PlanNote | None:
        """What the builder expected of the tree its last ``build`` returned, or None."""
        return None


@dataclass(frozen=True)
class PluginSpec:
    """One builder or drafter, as a plugin hook returns it.

    ``load`` is the implementation class, or a ``"module:Class"`` string imported on first use so
    that listing plugins stays light. ``config`` is the class's pydantic Config.
    """

    name: str
    summary: str
    config: type[PluginConfig]
    load: type | str
    aliases: tuple[str, ...] = field(default=())

    def resolve(self) -> type:
        if isinstance(self.load, str):
            import importlib

            module, _, attr = self.load.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.load
