"""``treespec train pair``'s settings: the two models' sizes, the training numbers, and what they cost
(parameters by arithmetic, a floor of training memory), checked before any work (``pair.py`` trains)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from treespec.errors import ConfigError
from treespec.inputs import seed_value
from treespec.train.pair_data import EOT_ID, PAD_ID

WHICH = ("target", "draft")


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def check(self, which: str) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{which}-{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(
                f"{which}: hidden {self.hidden} must divide by heads {self.heads}, and heads by kv-heads {self.kv_heads}; "
                f"change --{which}-heads or --{which}-kv-heads"
            )


@dataclass(frozen=True)
class PairSettings:
    out: str
    seed: int = 0
    held_out: float = 0.05  # fraction of files (by path hash): 19 files, 3.4% of the bytes on CPython 3.11
    max_files: int | None = None  # only the first N corpus files (tests, quick trials)
    vocab_size: int = 4096
    context: int = 1024  # training window = max_position_embeddings
    target: ModelSize = ModelSize(hidden=256, layers=8, heads=8, kv_heads=4, intermediate=704)
    draft: ModelSize = ModelSize(hidden=96, layers=2, heads=3, kv_heads=3, intermediate=256)
    steps: int = 1200  # target optimiser steps: ≈ 45 min on 2 threads (docs/default-pair.md, "Time")
    draft_steps: int = 2000  # ≈ 10 min on 2 threads
    batch_size: int = 4  # windows per step
    lr: float = 2e-3  # peak
    min_lr: float = 0.1  # final learning rate, relative to the peak
    warmup: float = 0.05  # fraction of the steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # how to run and watch, not what is trained: left out of the checkpoint's settings check (key)
    eval_every: int = 100
    eval_windows: int = 32
    checkpoint_every: int = 50
    threads: int = 2
    minutes: float | None = None  # stop (checkpointed, resumable) after this much training in one call
    device: str | None = None  # where both models train (None: the CPU); checkpoints are device-free

    def size(self, which: str) -> ModelSize:
        return self.target if which == "target" else self.draft

    def steps_of(self, which: str) -> int:
        return self.steps if which == "target" else self.draft_steps

    def key(self, which: str) -> dict[str, Any]:
        """Everything that shapes this model's weights; a checkpoint written with another key is refused."""
        d = asdict(self)
        for name in (
            "out",
            "threads",
            "minutes",
            "device",
            "eval_every",
            "eval_windows",
            "checkpoint_every",
            "target",
            "draft",
            "steps",
            "draft_steps",
        ):
            d.pop(name)
        return d | {"which": which, "size": asdict(self.size(which)), "steps": self.steps_of(which)}


def llama_config(s: PairSettings, which: str) -> Any:
    from transformers import LlamaConfig

    m = s.size(which)
    return LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=m.hidden,
        intermediate_size=m.intermediate,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.hidden // m.heads,
        max_position_embeddings=s.context,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
        architectures=["LlamaForCausalLM"],
    )


def parameter_count(config: Any) -> int:
    """Parameters of a config's model (tied embeddings counted once), without allocating weights."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------- batches and losses
def check_settings(s: PairSettings) -> None:
    """The numbers no model size check covers: a learning rate, a time limit, a file count and a
    vocabulary that make sense (NaN trained garbage or failed mid-run; a negative --max-files dropped
    the last files without a word; --vocab-size 1 failed building the model)."""
    seed_value(s.seed, "--seed")
    if not (math.isfinite(s.lr) and s.lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {s.lr}")
    if s.minutes is not None and not (math.isfinite(s.minutes) and s.minutes > 0):
        raise ConfigError(f"--minutes must be a finite number > 0, got {s.minutes}")
    if s.max_files is not None and s.max_files <= 0:
        raise ConfigError(f"--max-files must be > 0, got {s.max_files}")
    if not 259 <= s.vocab_size <= 65535:
        raise ConfigError(
            f"--vocab-size must be between 259 and 65535 (256 bytes, 2 special tokens, uint16 streams), "
            f"got {s.vocab_size}"
        )


def llama_parameters(s: PairSettings, which: str) -> int:
    """``parameter_count(llama_config(s, which))`` by arithmetic, without building the model: tied
    embeddings, per layer q/k/v/o, the gated MLP and two norms, and the final norm."""
    m = s.size(which)
    kv = m.kv_heads * (m.hidden // m.heads)
    per_layer = 2 * m.hidden * m.hidden + 2 * m.hidden * kv + 3 * m.hidden * m.intermediate + 2 * m.hidden
    return s.vocab_size * m.hidden + m.layers * per_layer + m.hidden


def training_bytes(s: PairSettings, which: str, params: int) -> int:
    """A rough floor of the memory training one model takes: float32 weights, gradients and AdamW's two
    moments (16 bytes a parameter), and one batch's activations (per token: about 16 hidden vectors a
    layer, the logits and their gradient)."""
    m = s.size(which)
    tokens = s.batch_size * s.context
    return 16 * params + 4 * tokens * (16 * m.hidden * m.layers + 2 * s.vocab_size)
