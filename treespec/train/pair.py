"""Training treespec's own model pair (``treespec train pair``): a Llama target and a Llama draft
(at most a tenth of the target's parameters) sharing one byte-level BPE tokenizer, trained from
scratch on the Python standard library's source (``treespec.train.pair_data``), float32 on the CPU.

Each model: seeded random init, AdamW (β 0.9/0.95, weight decay on matrices), linear warm-up then
cosine decay to ``min_lr`` of the peak, gradient clipping, on random windows of ``context + 1`` tokens
of the train stream. The windows of step i come from a generator seeded by (seed, model, i) alone, so
a resumed run reads exactly the windows an uninterrupted one would. The held-out loss is measured on
``eval_windows`` fixed, evenly spaced windows of the held-out stream.

Files in OUT: ``data/`` (tokenizer and token streams, a cache), ``checkpoint-<which>.pt`` (model,
optimiser, scheduler, step, RNG states, settings; every ``checkpoint_every`` steps and at a stop),
``log.jsonl`` (one line per evaluation), ``target/`` and ``draft/`` (``from_pretrained`` directories:
config, generation config, model.safetensors (sharded above 16 MB), tokenizer), ``training.json`` (the summary).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from treespec.devices import check_device
from treespec.errors import ConfigError
from treespec.files import save_torch_atomic, write_text_atomic, writing
from treespec.memory import check_fits, check_threads
from treespec.train.checkpoint import check_resumable, load_data, prepare_out
from treespec.train.pair_data import EOT_ID, PAD_ID, PairData, prepare
from treespec.train.pair_settings import (
    WHICH,
    ModelSize,  # noqa: F401 - imported from here before
    PairSettings,
    check_settings,
    llama_config,
    llama_parameters,
    parameter_count,
    training_bytes,
)

Progress = Callable[[str, int, int, str], None]  # (task, done, total, info)


def windows(stream: Any, starts: Any, length: int) -> Any:
    import torch

    idx = starts[:, None] + torch.arange(length + 1)[None]  # [B, T+1]
    return stream[idx]  # [B, T+1]


def lm_loss(model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def held_out_loss(model: Any, stream: Any, s: PairSettings) -> float:
    """Mean next-token loss over ``eval_windows`` fixed, evenly spaced windows of the held-out stream."""
    import torch

    device = next(model.parameters()).device
    length = min(s.context, stream.numel() - 1)
    starts = torch.linspace(0, stream.numel() - length - 1, s.eval_windows).long()  # [W]
    was_training, total = model.training, 0.0
    model.eval()
    with torch.no_grad():
        for b0 in range(0, s.eval_windows, s.batch_size):
            part = starts[b0 : b0 + s.batch_size]
            total += float(lm_loss(model, windows(stream, part, length).to(device))) * part.numel()
    model.train(was_training)
    return total / s.eval_windows


def schedule(s: PairSettings, total: int) -> Callable[[int], float]:
    warm = max(1, round(total * s.warmup))

    def factor(i: int) -> float:  # multiplier of the peak lr at step i (0-based)
        if i < warm:
            return (i + 1) / warm
        t = (i - warm) / max(1, total - warm)
        return s.min_lr + (1 - s.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


# ---------------------------------------------------------------------- one model
@dataclass
class RunState:
    step: int = 0
    seconds: float = 0.0  # wall-clock of training, evaluations and checkpoints, over all calls
    train_loss: float = float("nan")  # running mean (EMA) of the step losses
    held_out: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)


class _Trainer:
    """One model's training run: the model, its optimiser and schedule, the data streams, the state."""

    def __init__(self, s: PairSettings, which: str, data: PairData, log: Callable[[str], None]):
        import numpy as np
        import torch
        from transformers import LlamaForCausalLM

        self.s, self.which, self.log = s, which, log
        self.out, self.total = Path(s.out), s.steps_of(which)
        self.ckpt_file = self.out / f"checkpoint-{which}.pt"
        self.train_stream = torch.from_numpy(data.train.astype(np.int64))  # [N]
        self.held_stream = torch.from_numpy(data.held_out.astype(np.int64))  # [M]
        self.length = min(s.context, self.train_stream.numel() - 1)
        torch.manual_seed(s.seed + (0 if which == "target" else 1))
        # initialised on the CPU (the same weights on every device), then trained on --device
        self.model = LlamaForCausalLM(llama_config(s, which)).float().train().to(s.device or "cpu")
        self.device = next(self.model.parameters()).device
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=s.lr,
            betas=(0.9, 0.95),
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule(s, self.total))
        self.state = RunState()
        self.call_start, self.seconds_before = time.perf_counter(), 0.0

    def resume(self) -> None:
        """Continue from the checkpoint, if there is one written with the same settings."""
        import torch

        if not self.ckpt_file.is_file():
            return
        ckpt = load_data(self.ckpt_file)
        check_resumable(self.ckpt_file, ckpt["key"], self.s.key(self.which))
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.sched.load_state_dict(ckpt["sched"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        self.state = RunState(**ckpt["state"])
        if self.state.step < self.total:
            self.log(f"{self.which}: resuming from {self.ckpt_file} at step {self.state.step}/{self.total}")

    def start_clock(self) -> None:
        self.call_start, self.seconds_before = time.perf_counter(), self.state.seconds

    def clock(self) -> None:
        self.state.seconds = self.seconds_before + time.perf_counter() - self.call_start

    def checkpoint(self) -> None:
        import torch

        self.clock()
        save_torch_atomic(
            {
                "key": self.s.key(self.which),
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "sched": self.sched.state_dict(),
                "rng": {"torch": torch.get_rng_state()},
                "state": asdict(self.state),
            },
            self.ckpt_file,
        )

    def evaluate(self) -> None:
        """Held-out loss now, appended to the state and to ``OUT/log.jsonl``."""
        s, state = self.s, self.state
        loss = held_out_loss(self.model, self.held_stream, s)
        self.clock()
        state.held_out.append((state.step, loss))
        entry = {
            "which": self.which,
            "step": state.step,
            "train_loss": state.train_loss,
            "held_out_loss": loss,
            "lr": self.sched.get_last_lr()[0],
            "tokens": state.step * s.batch_size * self.length,
            "seconds": round(state.seconds, 1),
        }
        with (
            writing(self.out / "log.jsonl", "--out"),
            open(self.out / "log.jsonl", "a") as f,
        ):  # appended: a log, not a state
            f.write(json.dumps(entry) + "\n")
        trained = "" if state.step == 0 else f"train loss {state.train_loss:.4f} · "
        self.log(f"{self.which} step {state.step}/{self.total}: {trained}held-out loss {loss:.4f}")

    def step(self) -> None:
        """One optimiser step on a batch of windows drawn by a generator seeded by the step number
        (a resumed run draws the same batches)."""
        import torch

        s, state = self.s, self.state
        seed = s.seed * 1_000_003 + WHICH.index(self.which) * 100_003 + state.step
        if not -(2**63) <= seed < 2**64:  # what torch takes: a large --seed wraps (every smaller one is as it was)
            seed %= 2**64
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, self.train_stream.numel() - self.length, (s.batch_size,), generator=g)  # [B]
        loss = lm_loss(self.model, windows(self.train_stream, starts, self.length).to(self.device))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
        self.opt.step()
        self.sched.step()
        state.step += 1
        value = float(loss.detach())
        state.train_loss = value if math.isnan(state.train_loss) else 0.95 * state.train_loss + 0.05 * value
        if state.step % s.eval_every == 0 or state.step == self.total:
            self.evaluate()
        if state.step % s.checkpoint_every == 0 or state.step == self.total:
            self.checkpoint()


def train_model(
    s: PairSettings,
    which: str,
    data: PairData,
    stop_at: int | None = None,
    deadline: float = math.inf,
    progress: Progress | None = None,
    log: Callable[[str], None] = print,
) -> RunState:
    """Train (or resume) one model until its last step, step ``stop_at`` or ``time.monotonic()`` passing
    ``deadline`` (then checkpointed); write ``OUT/<which>/`` when its last step is done."""
    run = _Trainer(s, which, data, log)
    run.resume()
    state, total, out = run.state, run.total, run.out
    if state.step >= total and any((out / which).glob("model*.safetensors")):
        log(f"{which}: done already ({total} steps) → {out / which}")
        return state
    run.start_clock()
    if time.monotonic() >= deadline:
        log(f"{which}: no time left in --minutes; run the same command to continue")
        return state
    if state.step == 0 and not state.held_out:
        run.evaluate()  # the untrained model, for comparison
    end = min(total, stop_at) if stop_at is not None else total
    n_params = sum(p.numel() for p in run.model.parameters())
    while state.step < end and time.monotonic() < deadline:
        run.step()
        if progress:
            progress(
                f"{which} ({n_params / 1e6:.2f}M)",
                state.step,
                total,
                f"loss {state.train_loss:.3f} · held-out {state.held_out[-1][1]:.3f} · lr {run.sched.get_last_lr()[0]:.1e}",
            )
    if state.step < total:
        run.checkpoint()
        log(
            f"{which}: stopped at step {state.step}/{total} (checkpoint {run.ckpt_file}); run the same command to continue"
        )
        return state
    export(run.model, data.tokenizer, out / which)
    run.clock()
    return state


MAX_SHARD = "16MB"  # weights over this are split into shards + model.safetensors.index.json: no file in git over 20 MB


def export(model: Any, tokenizer: Any, folder: Path) -> None:
    """A ``from_pretrained`` directory: config, generation config (stops at ``<|endoftext|>``), weights, tokenizer."""
    from transformers import GenerationConfig

    from treespec.hf_bars import progress_bars

    model.generation_config = GenerationConfig(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=PAD_ID)
    # "Writing model shards" would break the rich progress bar
    with progress_bars(False), writing(folder, "--out"):  # transformers writes the folder's files itself
        model.eval().save_pretrained(folder, max_shard_size=MAX_SHARD)
        tokenizer.save_pretrained(folder)


# ---------------------------------------------------------------------- the pair
def train_pair(
    s: PairSettings,
    which: str = "both",
    stop_at: int | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Prepare the data, train the target and/or the draft (resuming), write ``OUT/training.json``."""
    import torch

    if which not in ("both", *WHICH):
        raise ConfigError(f"--which must be target, draft or both, got {which!r}")
    for name in (
        "steps",
        "draft_steps",
        "batch_size",
        "context",
        "eval_every",
        "eval_windows",
        "checkpoint_every",
        "threads",
    ):
        if getattr(s, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(s, name)}")
    s.target.check("target")
    s.draft.check("draft")
    check_settings(s)
    check_threads(s.threads)
    check_device(s.device)
    for w in WHICH if which == "both" else (which,):  # before building even a meta model: 10⁷ layers are 10⁷ objects
        n = llama_parameters(s, w)  # (on any --device: the models are built on the CPU first)
        check_fits(
            training_bytes(s, w, n),
            f"training the {w} ({n:,} parameters, --batch-size {s.batch_size} × --context {s.context})",
            f"lower the {w}'s sizes, --batch-size or --context",
        )
    params = {w: parameter_count(llama_config(s, w)) for w in WHICH}
    torch.set_num_threads(s.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(s.threads))  # the tokenizers library's thread pool
    out = prepare_out(s.out, "pair training")
    if params["draft"] * 10 > params["target"]:
        log(
            f"note: the draft has {params['draft']:,} parameters, more than a tenth of the target's {params['target']:,}"
        )
    data = prepare(s.held_out, s.max_files, s.vocab_size, s.context, out / "data", log=log)
    deadline = time.monotonic() + s.minutes * 60 if s.minutes else math.inf  # training time of the whole call
    states = {
        w: train_model(s, w, data, stop_at, deadline, progress, log) for w in (WHICH if which == "both" else (which,))
    }
    return write_summary(s, data, params, states)


def write_summary(
    s: PairSettings, data: PairData, params: dict[str, int], states: dict[str, RunState]
) -> dict[str, Any]:
    """``OUT/training.json``: corpus facts, sizes, steps, tokens seen, losses, wall-clock, versions.
    Models not trained in this call keep the entry an earlier call wrote."""
    import tokenizers
    import torch
    import transformers

    import treespec

    out = Path(s.out)
    path = out / "training.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    length = min(s.context, int(data.train.size) - 1)
    models = summary.get("models", {})
    for which, st in states.items():
        models[which] = {
            "size": asdict(s.size(which)),
            "parameters": params[which],
            "float32_megabytes": round(params[which] * 4 / 1e6, 2),
            "steps": st.step,
            "steps_planned": s.steps_of(which),
            "finished": st.step >= s.steps_of(which),
            "tokens_seen": st.step * s.batch_size * length,
            "train_loss_ema": st.train_loss,
            "held_out_loss_initial": st.held_out[0][1] if st.held_out else None,
            "held_out_loss": st.held_out[-1][1] if st.held_out else None,
            "held_out_history": st.held_out,
            "wall_clock_seconds": round(st.seconds, 1),
        }
    settings = asdict(replace(s, minutes=None))
    summary |= {
        "command": "treespec train pair",
        "settings": settings,
        "corpus": data.facts,
        "models": models,
        "draft_to_target_parameters": round(params["draft"] / params["target"], 4),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "treespec": treespec.__version__,
        },
    }
    write_text_atomic(path, json.dumps(summary, indent=2) + "\n", "--out")
    return summary
