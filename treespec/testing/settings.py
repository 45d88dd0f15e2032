"""What the conformance checks run on: the default target, prompts, builders, drafters and knobs
(``Settings`` for the drafter kit, ``BuilderSettings`` for the builder kit)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from treespec.errors import ConfigError
from treespec.inputs import token_ids
from treespec.interfaces import Drafter, TreeBuilder
from treespec.target import TargetModel

#: builds a new drafter for a target, e.g. ``lambda target: MyDrafter(MyDrafter.Config(), target)``
DrafterFactory = Callable[[TargetModel], Drafter]
#: a name and a factory of a fresh builder instance
BuilderFactory = tuple[str, Callable[[], TreeBuilder]]
#: a name and a factory of a new drafter for a target (what the builder kit drafts with)
NamedDrafter = tuple[str, DrafterFactory]

#: token-id prompts for ``tiny_target()`` (ids < 64): repetitions give retrieval drafters something
#: to find; the one-token prompt has an empty prefix (``PrefillContext.hidden`` is then [0, H])
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 5, 17, 33, 5, 17, 40, 8, 5, 17, 33, 21, 9, 5, 17),
    (1,),
    (1, 9, 9, 9, 12, 60, 9, 9, 12, 60, 9),
    (1, 42, 7, 23, 42, 7, 23, 42),
)

#: how the steps of a driven run end (see ``Settings.plan``)
POLICIES = ("target", "reject", "deepest", "root")
DEFAULT_PLAN: tuple[str, ...] = ("target", "reject", "deepest", "root", "deepest", "target", "reject")


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
    """The builders the checks grow trees with, found through the plugin registry like any other:
    ``opt-tree`` (many children of a whole layer per ``expand``, deep trees: δ = 0) and ``chain``
    (one child of one node per ``expand``)."""
    from treespec.factory import make_builder

    return [
        ("opt-tree", lambda: make_builder("opt-tree", {"nodes": 16, "threshold": 0.0, "max_depth": 5})),
        ("chain", lambda: make_builder("chain", {"k": 4})),
    ]


def default_drafters() -> list[NamedDrafter]:
    """The drafters the builder checks draft with, found through the plugin registry: ``self`` (the
    target's first layer: probabilities from a KV-cache model, rows drafted together in a batch) and
    ``ngram`` (prompt lookup: scores, and nodes with nothing to propose)."""
    from treespec.factory import make_drafter

    return [
        ("self", lambda target: make_drafter("self", {"layers": 1}, target)),
        ("ngram", lambda target: make_drafter("ngram", {}, target)),
    ]


def encode_prompt(target: TargetModel, prompt: Sequence[int] | str, i: int) -> list[int]:
    """Prompt #i as token ids: text through the target's tokenizer, ids checked against its vocabulary
    (``treespec.inputs.token_ids``, as the Decoder encodes prompts)."""
    try:
        ids = token_ids(prompt, target.tokenizer, target.vocab_size)
    except ConfigError as exc:
        raise ValueError(f"prompt #{i}: {exc}") from None
    if not ids:
        raise ValueError(f"prompt #{i} is empty: give 1+ token ids")
    return ids


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

    def __post_init__(self) -> None:
        for policy in self.plan:
            if policy not in POLICIES:
                raise ValueError(f"unknown plan step {policy!r}; choose from {POLICIES}")


@dataclass
class BuilderSettings:
    """Knobs of the builder checks (``BuilderConformance`` maps its class attributes onto these)."""

    #: token-id lists, or strings when the target has a tokenizer
    prompts: Sequence[Sequence[int] | str] = DEFAULT_PROMPTS
    #: new tokens per prompt in every decoding run
    max_new_tokens: int = 24
    #: the drafters every check drafts with (one decoding run per drafter)
    drafters: Sequence[NamedDrafter] = field(default_factory=default_drafters)
    #: depth caps of the max_depth check (each a run with max_new_tokens = cap + 1)
    depth_caps: Sequence[int] = (0, 1, 2)
    #: require some tree with a drafted node (a builder that never drafts passes the rest trivially)
    expect_drafting: bool = True
    #: require the lossless runs to accept at least one draft token (use it with a real target)
    expect_acceptance: bool = False

    def __post_init__(self) -> None:
        if any(cap < 0 for cap in self.depth_caps):
            raise ValueError(f"depth_caps must be >= 0: {list(self.depth_caps)}")
