"""Per-step and per-run statistics (owned by the Decoder)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class StepStats:
    tree_size: int  # drafted nodes verified (root excluded)
    depth: int  # depth of the tree
    accepted: int  # drafted tokens the target accepted (the bonus token excluded)
    emitted: int  # tokens this step added to the output (accepted + bonus, cut at EOS/limits)
    expected_accepted: float  # E(A) = Σ p̂ over the drafted nodes
    t_draft: float  # seconds in builder.build (drafter forwards included)
    t_verify: float  # seconds in the target's tree forward
    t_bookkeeping: float  # seconds in tree tensors, verification, commits, statistics
    t_wall: float = 0.0  # seconds since the previous step ended: the step and the Decoder's own work around it
    predicted_seconds: float | None = None  # what a planning builder predicted t_wall would be (PlanNote)
    planned_expected: float | None = None  # E(A) by the builder's own (calibrated) p̂ (PlanNote)
    plan_seconds: float | None = None  # the builder's own decision time, drafting excluded (PlanNote)


@dataclass
class RunStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    t_prefill: float = 0.0
    t_total: float = 0.0  # wall time of generate(), prefill included
    stop_reason: str = ""  # "eos" | "max_new_tokens" | "context" | "error" | "interrupted"
    steps: list[StepStats] = field(default_factory=list)

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def mean_accepted(self) -> float:
        """τ: mean tokens per target step, the bonus token included (1.0 = no speculation gain)."""
        return self.new_tokens / self.n_steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.t_total if self.t_total > 0 else 0.0

    @property
    def mean_tree_size(self) -> float:
        return sum(s.tree_size for s in self.steps) / self.n_steps if self.steps else 0.0

    def to_dict(self, per_step: bool = False) -> dict:
        out = {
            "steps": self.n_steps,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "mean_accepted": self.mean_accepted,
            "tokens_per_s": self.tokens_per_s,
            "mean_tree_size": self.mean_tree_size,
            "mean_expected_accepted": (
                sum(s.expected_accepted for s in self.steps) / self.n_steps if self.steps else 0.0
            ),
            "t_total": self.t_total,
            "t_prefill": self.t_prefill,
            "t_draft": sum(s.t_draft for s in self.steps),
            "t_verify": sum(s.t_verify for s in self.steps),
            "t_bookkeeping": sum(s.t_bookkeeping for s in self.steps),
            "stop_reason": self.stop_reason,
        }
        if per_step:
            out["per_step"] = [asdict(s) for s in self.steps]
        return out

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.n_steps} steps · τ {self.mean_accepted:.2f} tokens/step · "
            f"{self.tokens_per_s:.1f} tokens/s · tree {self.mean_tree_size:.1f} nodes · stop: {self.stop_reason}"
        )
