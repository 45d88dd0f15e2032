"""Training an EAGLE head for a target (``treespec train eagle``).

Data (``eagle_data.py``): the target's OWN greedy continuations of the prompts (what the head must predict at decode
time), with the target's last hidden states f (after its final norm) at every position. Both are
computed once and kept in ``OUT/data.pt``.

Loss, as EAGLE: for item j = (f_j + noise, x_{j+1}) the head predicts f̂_{j+1} and

    L = v_w · SmoothL1(f̂_{j+1}, f_{j+1})                        feature regression
      + p_w · CE(softmax(lm_head(f_{j+1})), log_softmax(lm_head(f̂_{j+1})))   token loss vs the target's p

with v_w = 1, p_w = 0.1, and uniform noise on the input features (the head reads its own imperfect
predictions below the root at decode time). Positions inside the prompt count too; the held-out
summary counts generated positions only: top-1 agreement = argmax of the head's next-token
distribution equals the target's greedy token.

Resumable: ``OUT/checkpoint.pt`` (head, optimiser, epoch, RNG state) is written after every epoch and
picked up by the same command; the final head is written in the published layout
(``config.json`` + ``model.safetensors``), loadable by ``--drafter eagle -D head=OUT``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from treespec.devices import check_device
from treespec.errors import ConfigError
from treespec.files import save_torch_atomic, write_text_atomic
from treespec.kv import causal_mask
from treespec.memory import check_fits, decoder_parameters
from treespec.plugins.eagle_data import Progress, Sequence, quiet, training_data
from treespec.plugins.eagle_head import EagleHead, head_config_for
from treespec.plugins.eagle_loss import DraftOut, batch_tensors, head_step
from treespec.plugins.train_settings import DataSettings
from treespec.target import TargetModel
from treespec.train import calibration
from treespec.train.checkpoint import check_resumable, load_data, prepare_out


@dataclass(frozen=True)
class TrainSettings(DataSettings):
    layers: int = 1
    epochs: int = 10
    batch_size: int = 32
    lr: float = 3e-3
    noise: float = 0.2  # uniform input noise, relative to the features' standard deviation
    v_weight: float = 1.0
    p_weight: float = 0.1
    seed: int = 0
    draft_vocab: int | None = None  # draft over the N most frequent target tokens (plugins/draft_vocab.py)
    # the saved head's weights (float16 halves a shipped head; loading casts to the target's)
    save_dtype: str = "float32"
    init: str | None = None  # start from this head's weights and draft vocabulary (fine-tuning)


@torch.no_grad()
def evaluate(
    head: EagleHead,
    embed: Any,
    lm_head: Any,
    seqs: list[Sequence],
    s: TrainSettings,
    vocab_ids: torch.Tensor | None = None,
) -> dict[str, float]:
    head.eval()
    total: dict[str, float] = {"loss": 0.0, "feature_loss": 0.0, "token_loss": 0.0, "top1": 0.0}
    n = 0
    out = DraftOut.of(lm_head, vocab_ids)
    for b0 in range(0, len(seqs), s.batch_size):
        _, part = head_step(
            head, embed, out, seqs[b0 : b0 + s.batch_size], 0.0, s, full_head=lm_head if vocab_ids is not None else None
        )
        for key in total:
            total[key] += part[key] * part["n"]
        n += part["n"]
    return {k: v / max(n, 1) for k, v in total.items()} | {"positions": n}


@torch.no_grad()
def held_out_logits(
    head: EagleHead, embed: Any, lm_head: Any, seqs: list[Sequence], s: TrainSettings, max_positions: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits [n, V] at generated positions and the target's greedy token there [n]."""
    head.eval()
    zs, ys, n = [], [], 0
    dev = next(head.parameters()).device
    for b0 in range(0, len(seqs), s.batch_size):
        ids, feats, valid, gen = (x.to(dev) for x in batch_tensors(seqs[b0 : b0 + s.batch_size]))
        t = ids.shape[1]
        pred = head(
            feats[:, :-1],
            embed(ids[:, 1:]),
            torch.arange(t - 1, device=dev)[None].expand(ids.shape[0], -1),
            causal_mask(0, t - 1, feats.dtype).to(dev)[None, None],
        )  # [B, T-1, H]
        keep = gen & valid
        zs.append(lm_head(pred[keep]).float())  # [n, V]
        ys.append(lm_head(feats[:, 1:][keep]).argmax(-1))  # [n] the target's greedy token
        n += int(keep.sum())
        if n >= max_positions:
            break
    return torch.cat(zs)[:max_positions], torch.cat(ys)[:max_positions]


@torch.no_grad()
def fit_temperature(
    head: EagleHead, embed: Any, lm_head: Any, seqs: list[Sequence], s: TrainSettings, max_positions: int = 8192
) -> float:
    """The temperature T that calibrates the head's confidence to greedy acceptance
    (``treespec.train.calibration``): a head that regresses features has shrunk logits, its top-1 right 90%
    of the time with q far below 0.9; T is fitted on held-out generated positions."""
    z, y = held_out_logits(head, embed, lm_head, seqs, s, max_positions)
    return calibration.fit_temperature(z, y)


# ---------------------------------------------------------------------- the loop
def _resume_key(settings: dict[str, Any]) -> dict[str, Any]:
    """What must match to resume: every setting but where the files are (``out`` may be spelt differently),
    the dtype the final head is saved in (a finished run re-run with another ``save_dtype`` re-saves it),
    where its answers were reused from (block drafters: ``--answers``) and how many prompts the target
    answered at once (``gen_batch_size``: the data it made are keyed by ``data_key``)."""
    return {k: v for k, v in settings.items() if k not in ("out", "save_dtype", "answers", "gen_batch_size", "device")}


def frozen_target(name: str, device: str | None = None) -> tuple[TargetModel, Any, Any]:
    """The target on ``device``, its weights frozen, with its embedding and output head (every trainer
    reads them; the drafter being trained goes where they are)."""
    target = TargetModel.load(name, device=device)
    for p in target.model.parameters():
        p.requires_grad_(False)
    return target, target.model.get_input_embeddings(), target.model.get_output_embeddings()


@dataclass
class TrainRun:
    """The head being trained with its optimiser and schedule (linear warm-up over 2 %, then linear
    decay); EAGLE-3's trainer uses it too (``head`` any module, ``s`` any settings with lr, batch_size,
    epochs and seed)."""

    head: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    steps_per_epoch: int

    @classmethod
    def new(cls, head: torch.nn.Module, s: Any, n_train: int) -> TrainRun:
        opt = torch.optim.AdamW(head.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
        steps_per_epoch = math.ceil(n_train / s.batch_size)
        total = steps_per_epoch * s.epochs
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: min(1.0, (i + 1) / max(1, total // 50)) * max(0.05, 1 - i / max(1, total))
        )
        return cls(head, opt, sched, steps_per_epoch)

    def resume(self, ckpt_file: Path, s: Any, log: Callable[[str], None]) -> tuple[int, list]:
        """(epochs done, history) from ``ckpt_file`` if there is one written with the same settings."""
        if not ckpt_file.is_file():
            return 0, []
        ckpt = load_data(ckpt_file)
        check_resumable(ckpt_file, _resume_key(ckpt["settings"]), _resume_key(asdict(s)))
        self.head.load_state_dict(ckpt["head"])
        self.opt.load_state_dict(ckpt["opt"])
        self.sched.load_state_dict(ckpt["sched"])
        torch.set_rng_state(ckpt["rng"])
        log(f"resuming from {ckpt_file} after epoch {ckpt['epoch']}")
        return ckpt["epoch"], ckpt["history"]

    def epoch(
        self,
        epoch: int,
        train_set: list,
        loss_of: Callable[[list], tuple[torch.Tensor, dict]],
        s: Any,
        progress: Progress,
    ) -> float:
        """One pass over ``train_set`` in an order fixed by the seed and the epoch, ``loss_of(batch)``
        giving (loss, parts with "loss"); the smoothed loss."""
        self.head.train()
        order = list(range(len(train_set)))
        random.Random(s.seed * 100_003 + epoch).shuffle(order)  # per epoch: a resumed run sees the same order
        running = 0.0
        for i in range(self.steps_per_epoch):
            batch = [train_set[j] for j in order[i * s.batch_size : (i + 1) * s.batch_size]]
            loss, part = loss_of(batch)
            self.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
            self.opt.step()
            self.sched.step()
            running = part["loss"] if i == 0 else 0.9 * running + 0.1 * part["loss"]
            progress(f"epoch {epoch + 1}/{s.epochs}", i + 1, self.steps_per_epoch, f"loss {running:.4f}")
        return running

    def save(self, ckpt_file: Path, s: Any, epoch: int, history: list) -> None:
        save_torch_atomic(
            {
                "settings": asdict(s),
                "head": self.head.state_dict(),
                "opt": self.opt.state_dict(),
                "sched": self.sched.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
                "history": history,
            },
            ckpt_file,
        )


def train(s: TrainSettings, progress: Progress = quiet, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) a head; returns the summary also written to ``OUT/training.json``."""
    if not 0 < s.holdout < 1:
        raise ConfigError(f"--holdout must be between 0 and 1, got {s.holdout}")
    check_device(s.device)
    out = prepare_out(s.out, "EAGLE training")
    torch.manual_seed(s.seed)
    target, embed, lm_head = frozen_target(s.target, s.device)
    model = target.model
    head_config = head_config_for(model.config, layers=s.layers)
    params = decoder_parameters({**head_config.to_dict(), "vocab_size": 0}, s.layers)  # its embeddings are the target's
    check_fits(
        16 * params,
        f"an EAGLE head of {s.layers:,} layers ({params:,} parameters, with its gradients and AdamW's state)",
        "lower --layers (EAGLE-1/2 heads have 1)",
    )  # before minutes of generating data
    init = _init(target, s, log)  # before minutes of generating data, too
    seqs = training_data(target, s, out, progress, log)
    n_hold = max(1, round(len(seqs) * s.holdout))
    held, train_set = seqs[:n_hold], seqs[n_hold:]
    head, ids = init or (EagleHead(head_config), _draft_vocab(train_set, target, s, log))
    head = head.to(target.device)  # trained where the target's features are computed
    draft_out = DraftOut.of(lm_head, ids)

    run = TrainRun.new(head, s, len(train_set))
    ckpt_file = out / "checkpoint.pt"
    start, history = run.resume(ckpt_file, s, log)
    before = evaluate(run.head, embed, lm_head, held, s, ids) if start == 0 else history[0]["held_out_before"]
    for epoch in range(start, s.epochs):
        running = run.epoch(
            epoch, train_set, lambda batch: head_step(run.head, embed, draft_out, batch, s.noise, s), s, progress
        )
        held_out = evaluate(run.head, embed, lm_head, held, s, ids)
        history.append({"epoch": epoch + 1, "train_loss": running, "held_out": held_out, "held_out_before": before})
        log(
            f"epoch {epoch + 1}: train loss {running:.4f} · held-out loss {held_out['loss']:.4f} · "
            f"top-1 agreement {held_out['top1']:.3f}"
        )
        run.save(ckpt_file, s, epoch + 1, history)
    return _finish(run.head, embed, draft_out, held, len(train_set), history, before, s, out, log, ids)


def _init(
    target: TargetModel, s: TrainSettings, log: Callable[[str], None]
) -> tuple[EagleHead, torch.Tensor | None] | None:
    """With ``s.init``, the head training starts from and its own draft vocabulary (a head fine-tuned on
    new data keeps the vocabulary its output layer was trained over); None: a new head."""
    from treespec.plugins import draft_vocab
    from treespec.plugins.eagle_head import load_head, read_config, target_dims

    if s.init is None:
        return None
    hidden, vocab = target_dims(target.config)
    vocab = min(vocab, target.vocab_size)
    head, _ = load_head(s.init, hidden, vocab, f"target {target.name!r}")
    if head.config.num_hidden_layers != s.layers:
        raise ConfigError(
            f"--init {s.init} has {head.config.num_hidden_layers} decoder layer(s): pass --layers "
            f"{head.config.num_hidden_layers}"
        )
    ids = draft_vocab.load(read_config(s.init)[1], vocab, s.init)
    size = len(ids) if ids is not None else vocab
    if s.draft_vocab is not None and s.draft_vocab != size:
        raise ConfigError(
            f"--draft-vocab {s.draft_vocab}: --init {s.init} drafts over its own vocabulary ({size} tokens); "
            "drop --draft-vocab"
        )
    log(f"starting from {s.init} (draft vocabulary: {size} tokens)")
    return head.float().train(), ids


def _draft_vocab(
    train_set: list[Sequence], target: TargetModel, s: TrainSettings, log: Callable[[str], None]
) -> torch.Tensor | None:
    """The draft vocabulary: the ``s.draft_vocab`` tokens the target generated most often (training
    prompts' continuations only), or None for the whole vocabulary."""
    from treespec.plugins import draft_vocab

    vocab = target.vocab_size
    if s.draft_vocab is None or s.draft_vocab >= vocab:
        return None
    if s.draft_vocab <= 0:
        raise ConfigError(f"--draft-vocab must be > 0, got {s.draft_vocab}")
    ids = draft_vocab.rank_tokens((x.ids[x.prompt_len :] for x in train_set), vocab, s.draft_vocab)
    counts = torch.bincount(torch.cat([x.ids[x.prompt_len :] for x in train_set]), minlength=vocab)
    covered = float(counts[ids].sum()) / max(1, int(counts.sum()))
    log(
        f"draft vocabulary: the {s.draft_vocab} most frequent of {vocab} tokens cover {covered:.1%} of the "
        "target's generated tokens"
    )
    return ids


def _finish(
    head: EagleHead,
    embed: Any,
    lm_head: Any,
    held: list,
    n_train: int,
    history: list,
    before: dict,
    s: TrainSettings,
    out: Path,
    log: Callable[[str], None],
    ids: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Calibrate, save the head in the published layout (with its draft vocabulary, if any) and write
    ``training.json``."""
    from treespec.plugins import draft_vocab

    final = history[-1]["held_out"] if history else before
    temperature = fit_temperature(head, embed, lm_head, held, s)
    log(f"calibration temperature {temperature:.3f} (the head's q for tree builders: softmax(logits / T))")
    summary = {
        "settings": asdict(s),
        "train_sequences": n_train,
        "held_out_sequences": len(held),
        "held_out_positions": final.get("positions"),
        "top1_before": before["top1"],
        "top1": final["top1"],
        "held_out_loss": final["loss"],
        "history": history,
        "calibration_temperature": temperature,
        "parameters": sum(p.numel() for p in head.parameters()),
    }
    if s.save_dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError(f"--save-dtype {s.save_dtype!r}: use float32, float16 or bfloat16")
    head.save(
        out,
        extra={
            "target": s.target,
            "top1_held_out": final["top1"],
            "calibration_temperature": temperature,
            "trained_with": "treespec train eagle",
        },
        dtype=getattr(torch, s.save_dtype),
    )
    if ids is not None:
        draft_vocab.save(out, ids)
    write_text_atomic(out / "training.json", json.dumps(summary, indent=2) + "\n", "--out")
    return summary
