"""Options of the built-in plugins. Kept free of torch so that `treespec plugins` stays light."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from treespec.config import PluginConfig
from treespec.errors import ConfigError

LEAN_HELP = (
    "run Llama/Mistral/Qwen2 drafts through treespec.lean (same weights, without the framework's per-call "
    "overhead); false, or another architecture: the model's own forward"
)


def sample_field() -> Any:
    """The ``sample`` option of the builders that can draw children at random (chain, static, sequoia,
    opt-tree and eagle2 with fixed budgets)."""
    return Field(
        False,
        description="with temperature > 0: draw children at random from the draft's distribution "
        "(without replacement, at the draft temperature) instead of its top-k, verified by the matching exact rule "
        "(auto: block on chains, traversal on trees); "
        "needs a drafter with full distributions (model, self, eagle)",
    )


class OptTreeConfig(PluginConfig):
    nodes: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="node budget n: drafted nodes per tree (root excluded), or auto: each step's budget "
        "and depth maximise expected tokens per second under the measured cost model (docs/cost-aware.md)",
    )
    threshold: float = Field(
        0.5,
        ge=0.0,
        description="δ (fixed nodes): keep adding layers while E(A) grows by more than "
        "this (sample=true, when sampling: while a later layer could still add more than δ, "
        "n × the newest layer's best p̂; docs/sampling.md)",
    )
    max_depth: int | None = Field(
        None,
        gt=0,
        description="deepest layer of the tree (default: 10 with a fixed "
        "budget, as in the paper; 32 with auto, whose layers stop when they no longer pay)",
    )
    cap: int = Field(64, gt=0, description="auto: the most drafted nodes one tree may have")
    calibrate: bool | None = Field(
        None,
        description="rank by calibrated p̂ (an online map from draft confidence to observed acceptance); "
        "default: on with nodes=auto, off with a fixed budget",
    )
    profile: str | None = Field(
        None,
        description="auto: a cost profile JSON (`treespec profile`) to start from; default: the saved "
        "profile of this target, drafter, device, dtype and thread count if there is one; none: start empty",
    )
    refine: bool = Field(
        True,
        description="auto: refine the cost model from every step's timings (off + a "
        "profile: the same decisions on every run)",
    )
    sample: bool = sample_field()

    @model_validator(mode="after")
    def _sample_needs_a_fixed_budget(self) -> OptTreeConfig:
        if self.sample and self.nodes == "auto":
            raise ConfigError(
                "opt-tree: sample=true needs a fixed budget (the nodes=auto planner ranks children only): "
                "use nodes=N, e.g. -B nodes=25,sample=true"
            )
        return self

    @model_validator(mode="after")
    def _profile_is_a_profile(self) -> OptTreeConfig:
        """A profile FILE is read now, before any model loads: one line if it is not a cost profile."""
        if self.profile is None or self.profile == "none":
            return self
        if self.nodes != "auto":
            raise ConfigError(
                f"opt-tree: profile= plans nodes=auto only, and nodes={self.nodes} is a fixed budget: "
                "drop profile, or use nodes=auto"
            )
        from treespec.cost import user_profile

        user_profile(self.profile)
        return self


class ChainConfig(PluginConfig):
    k: int = Field(4, gt=0, description="drafted tokens per step")
    sample: bool = sample_field()


def draft_temperature_field() -> Any:
    """A draft model's calibration temperature (``treespec.train.calibration``)."""
    return Field(
        1.0,
        gt=0,
        description="the draft's q = softmax(logits / T), which shapes trees (never what is accepted); "
        "fit T for a target with `treespec calibrate`",
    )


class ModelDrafterConfig(PluginConfig):
    model: str = Field(description="alias (llama-68m, ...), hub id or local directory of the draft model")
    layers: int | None = Field(None, gt=0, description="keep only the model's first k decoder layers")
    attn_implementation: str | None = Field(None, description="eager | sdpa | ... (default: the model's)")
    trust_remote_code: bool = Field(False, description="allow the model's own code from the hub")
    lean: bool = Field(True, description=LEAN_HELP)
    temperature: float = draft_temperature_field()


class StaticConfig(PluginConfig):
    shape: str = Field(
        "eagle-mc_sim_7b_63",
        description="a preset (`treespec tree presets`: eagle-mc_sim_7b_63 (25 nodes), eagle-25, "
        "medusa-mc_sim_7b_63 (63 nodes), chain-K, kary-K-D), a JSON list of paths of child ranks, or a JSON file",
    )
    sample: bool = sample_field()


class SequoiaConfig(PluginConfig):
    model_config = ConfigDict(allow_inf_nan=True)  # a NaN in acceptance: sequoia's own check names p_i
    nodes: int = Field(50, gt=0, description="node budget n: drafted nodes per tree (root excluded)")
    max_depth: int = Field(10, gt=0, description="deepest layer of the tree")
    acceptance: str | list[float] = Field(
        description="per-rank acceptance vector: a JSON file made by `treespec sequoia-measure` (or a list in Python)"
    )
    sample: bool = sample_field()


class Eagle2Config(PluginConfig):
    top_k: int = Field(10, gt=0, description="frontier nodes expanded per step, and children proposed per node")
    depth: int = Field(6, gt=0, description="expansion steps (the tree's maximum depth)")
    total_tokens: int = Field(60, gt=0, description="drafted nodes kept after reranking by p̂ (root excluded)")
    calibrate: bool = Field(
        False,
        description="rank by calibrated p̂ (an online map from draft confidence to "
        "observed acceptance, docs/cost-aware.md) instead of the draft's raw p̂",
    )
    sample: bool = sample_field()


class NgramConfig(PluginConfig):
    max_ngram: int = Field(3, gt=0, description="longest n-gram looked up (the longest one that matches wins)")
    min_ngram: int = Field(1, gt=0, description="shortest n-gram looked up (at most max_ngram)")
    max_matches: int = Field(8, gt=0, description="at most this many candidate continuations per node")
    prior: float = Field(
        4.0,
        ge=0,
        description="pseudo-matches of a continuation not seen yet, after a match of 1 token (of n tokens: "
        "prior/n²): q = count / (matches + prior/n²); 0 gives the raw share count / matches",
    )


class DatastoreConfig(PluginConfig):
    corpus: str = Field(
        description="a corpus file (.txt: documents separated by blank lines; .jsonl/.jsonl.gz: a 'text' field "
        "or a 'turns' list), indexed and cached on first use, or an index .npz from `treespec datastore build`"
    )
    max_suffix: int = Field(16, gt=0, description="longest context suffix looked up (the longest one that occurs wins)")
    min_suffix: int = Field(2, gt=0, description="shortest context suffix looked up (at most max_suffix)")
    max_matches: int = Field(
        512, gt=0, description="occurrences read per lookup to count followers (evenly spread over all of them)"
    )
    cache_dir: str | None = Field(
        None,
        description="folder of cached indexes [default: $XDG_CACHE_HOME/treespec/datastore or ~/.cache/treespec/datastore]",
    )


class SelfDrafterConfig(PluginConfig):
    layers: int = Field(
        2, gt=0, description="draft with the target's own first k decoder layers (fewer than the target has)"
    )
    lean: bool = Field(True, description=LEAN_HELP)
    temperature: float = draft_temperature_field()


def _split_list(value: Any, seps: str) -> Any:
    """``"a,b"`` (or with another separator in ``seps``, or ``"[a, b]"``) → ``["a", "b"]``: list options from the CLI."""
    if not isinstance(value, str):
        return value
    text = value.strip().strip("[]")
    for sep in seps[1:]:
        text = text.replace(sep, seps[0])
    return [v.strip().strip("'\"") for v in text.split(seps[0]) if v.strip()]


class ComposeConfig(PluginConfig):
    parts: list[str] = Field(
        default_factory=list,
        description="the drafters to compose, e.g. model,ngram (same as --drafter model+ngram); "
        "a part's own options: PART.option=value, or 1.option=value for the first part",
    )
    merge: Literal["max", "mix"] = Field(
        "max",
        description="q of a token proposed by several parts: max = the most confident part's q; "
        "mix = Σ w_i q_i, weights renormalised over the parts that proposed anything at that node",
    )
    weights: list[float] | None = Field(
        None, description="merge=mix only: one weight per part, e.g. 0.7,0.3 (or 0.7:0.3; default equal)"
    )
    calibrate: bool | None = Field(
        None,
        description="merge=max: map each part's q to how often the target accepted that part's proposals, "
        "learnt online per part, depth and q, before the max [default: on for merge=max; merge=mix keeps "
        "the parts' own q, a distribution sampling rules may need]",
    )

    @field_validator("parts", mode="before")
    @classmethod
    def _split_parts(cls, value: Any) -> Any:
        return _split_list(value, ",+")

    @field_validator("weights", mode="before")
    @classmethod
    def _split_weights(cls, value: Any) -> Any:
        return _split_list(value, ",:")

    @field_validator("weights")
    @classmethod
    def _positive(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and any(w <= 0 for w in value):
            raise ValueError("every weight must be > 0")
        return value


def eagle_temperature_field() -> Any:
    """An EAGLE head's calibration temperature (``eagle_train.fit_temperature``), by default the one
    stored with the head."""
    return Field(
        None,
        gt=0,
        description="the head's q = softmax(logits / T), which shapes trees (never what is accepted) "
        "[default: the calibration temperature stored with the head by `treespec train eagle`, else 1]",
    )


class EagleConfig(PluginConfig):
    head: str | None = Field(
        None,
        description="the EAGLE-1/2 head: a local directory (config.json + model.safetensors or pytorch_model.bin), "
        "or a hub id such as yuhuili/EAGLE-llama2-chat-7B; train one with `treespec train eagle` "
        "[default: treespec-py-eagle for treespec's own target treespec-py, else required]",
    )
    attn_implementation: str | None = Field(None, description="eager | sdpa (default: sdpa; for lean=false)")
    lean: bool = Field(True, description="run the head through treespec.lean (same math, without per-module overhead)")
    temperature: float | None = eagle_temperature_field()
    vocab: int | None = Field(
        None,
        ge=0,
        description="draft over the head's N most frequent tokens only (its draft_vocab.safetensors, from "
        "`treespec train eagle --draft-vocab`): a cheaper output layer [default: the cut its config.json names "
        "(treespec.vocab, e.g. smollm2-eagle's 4096), else its whole draft vocabulary if it has one, else every token; "
        "0: every token]",
    )


class Eagle3Config(PluginConfig):
    head: str | None = Field(
        None,
        description="the EAGLE-3 head: a local directory (config.json + model.safetensors or pytorch_model.bin), "
        "or a hub id such as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; train one with `treespec train eagle --version 3` "
        "[default: the packaged head for treespec-py if one ships, else required]",
    )
    layers: list[int] | None = Field(
        None,
        description="the target's three feature layers as hidden_states indices (i = the input of layer i) "
        "[default: the head config's eagle_aux_hidden_state_layer_ids + 1, else (2, L//2, L-3)]",
    )
    temperature: float | None = eagle_temperature_field()


class BlockConfig(PluginConfig):
    head: str | None = Field(
        None,
        description="the block drafter: a local directory (config.json + model.safetensors) or a hub id; train one "
        "with `treespec train block` [default: the one shipped for the target (treespec-py, smollm2), else required]",
    )
    temperature: float | None = Field(
        None,
        gt=0,
        description="the marginals' q = softmax(logits / T) at every depth, which shapes trees (never what is "
        "accepted) [default: the per-depth calibration temperatures stored by `treespec train block`, else 1]",
    )
