"""Training an EAGLE-3 head with training-time test (``treespec train eagle --version 3``).

Data: as EAGLE-1's trainer (``eagle_train.py``), the target's own greedy continuations, with its
hidden states at the three feature layers (fused input) and its last layer (the target's
distribution p_t = softmax(lm_head(F_t)) over the next token), kept in ``OUT/data.pt``.

Training-time test (EAGLE-3, arXiv 2503.01840): at decode time the head reads its OWN outputs below
the root, so training unrolls it the same way. Step 0 reads the fused target features g_t = fc(·);
step i ≥ 1 reads step i−1's outputs at the same rows. At row t, step i embeds x_{t+1+i}, sits at
position t+i, and is scored against the target's distribution for x_{t+2+i}:

    loss = Σ_i 0.8^i · mean_t CE(p_{t+1+i} restricted to the draft vocabulary, q_i,t)

Attention across steps is what a chain in the tree sees: step i's query at row t attends step 0's
keys at rows ≤ t (the committed prefix, true features) plus the keys of steps 1..i at row t (its own
ancestors in the chain). No feature regression and no input noise: the unrolled steps give the head
its own errors to learn from.

The draft vocabulary (``--draft-vocab N``) is the N target ids most frequent in the training
sequences, ascending: d2t[i] = used[i] − i, t2d[j] = j ∈ used; positions whose target argmax lies
outside it are left out of the loss. lm_head starts from the target's rows for those ids.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from treespec.devices import check_device
from treespec.errors import ConfigError
from treespec.files import write_text_atomic
from treespec.lean import apply_rope
from treespec.plugins.eagle3_head import Eagle3Head, default_layers
from treespec.plugins.eagle_data import Progress, Sequence, quiet, training_data
from treespec.plugins.eagle_head import head_config_for
from treespec.plugins.eagle_train import TrainRun, frozen_target
from treespec.plugins.train_settings import DataSettings
from treespec.train import calibration
from treespec.train.checkpoint import prepare_out

DECAY = 0.8  # step i's loss weight: DECAY ** i, as the reference


@dataclass(frozen=True)
class Train3Settings(DataSettings):
    epochs: int = 10
    batch_size: int = 16
    lr: float = 1e-3
    ttt_steps: int = 7  # unrolled steps (the reference: 7)
    max_len: int = 2048  # sequences are cut to their last max_len tokens for training (the reference: 2048)
    draft_vocab: int | None = None  # default: the whole vocabulary up to 32,000 ids
    seed: int = 0
    data_version: ClassVar[int] = 3  # the fused layers' features as well


def draft_vocabulary(seqs: list[Sequence], vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids of the sequences, ascending (ties: lower id first)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts.index_add_(0, s.ids, torch.ones_like(s.ids))
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def crop(seqs: list[Sequence], max_len: int) -> list[Sequence]:
    """Each sequence's last ``max_len`` tokens (the generated ones first to stay), prompt length adjusted."""
    out = []
    for s in seqs:
        cut = max(0, s.ids.numel() - max_len)
        out.append(
            s
            if cut == 0
            else Sequence(
                ids=s.ids[cut:], feats=s.feats[cut:], prompt_len=max(0, s.prompt_len - cut), fused=s.fused[cut:]
            )
        )
    return out


def pad_batch(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], fused [B, T, 3H], final feats [B, T, H], lengths [B], prompt lengths [B]."""
    width = max(s.ids.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    fused = torch.zeros(len(seqs), width, seqs[0].fused.shape[-1])
    feats = torch.zeros(len(seqs), width, seqs[0].feats.shape[-1])
    for r, s in enumerate(seqs):
        n = s.ids.numel()
        ids[r, :n], fused[r, :n], feats[r, :n] = s.ids, s.fused, s.feats
    return ids, fused, feats, torch.tensor([s.ids.numel() for s in seqs]), torch.tensor([s.prompt_len for s in seqs])


def unroll(head: Eagle3Head, embed: Any, fused: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: the head's outputs [B, T, H] at each of ``steps`` unrolled steps (module docstring)."""
    b, t, _ = fused.shape
    nq, nkv, d, _ = head.shape
    rep = nq // nkv
    scale = d**-0.5
    causal = torch.full((t, t), float("-inf"), device=fused.device).triu(1)  # [T, T]
    g = head.fuse(fused)  # [B, T, H]
    keys, values, outs = [], [], []
    for i in range(steps):
        tok = F.pad(ids[:, 1 + i :], (0, 1 + i))  # [B, T] x_{t+1+i} (0 past the end: masked out of the loss)
        q, k, v = head.qkv(embed(tok), g)  # [B, Hq|Hkv, T, D]
        cos, sin = head.rotary(g, (torch.arange(t, device=g.device) + i)[None].expand(b, -1))  # [B, T, D]
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
        keys.append(k.repeat_interleave(rep, 1))  # [B, Hq, T, D]
        values.append(v.repeat_interleave(rep, 1))
        scores = [q @ keys[0].transpose(-1, -2) * scale + causal]  # [B, Hq, T, T] the committed prefix
        scores += [(q * keys[j]).sum(-1, keepdim=True) * scale for j in range(1, i + 1)]  # [B, Hq, T, 1] ancestors
        a = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)  # [B, Hq, T, T + i]
        o = a[..., :t] @ values[0]  # [B, Hq, T, D]
        for j in range(1, i + 1):
            o = o + a[..., t + j - 1 : t + j] * values[j]
        g = head.finish(g, o)  # [B, T, H] step i's outputs: step i+1's features
        outs.append(g)
    return outs


def head_step(
    head: Eagle3Head, embed: Any, lm_head: Any, used: torch.Tensor, seqs: list[Sequence], s: Train3Settings
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The TTT loss over a batch, and per step: top-1 agreement with the target's greedy token at
    generated positions (step i's agreement is what a chain's depth-(i+1) node would see)."""
    ids, fused, feats, lengths, plen = pad_batch(seqs)
    dev = next(head.parameters()).device
    ids, fused, feats = ids.to(dev), fused.to(dev), feats.to(dev)
    b, t = ids.shape
    with torch.no_grad():
        target_logits = lm_head(feats).float()  # [B, T, V]: row u predicts x_{u+1}
        greedy = target_logits.argmax(-1)  # [B, T]
        p = torch.softmax(target_logits[..., used], -1)  # [B, T, Vd]
        inside = head.t2d[greedy]  # [B, T] the target's choice is in the draft vocabulary
    rows = torch.arange(t, device=dev)[None]  # [1, T]
    loss, parts = torch.zeros((), device=dev), {"top1": [], "n": []}
    for i, out in enumerate(unroll(head, embed, fused, ids, s.ttt_steps)):
        shift = 1 + i  # row t is scored against the target's distribution at row t + 1 + i
        valid = (rows <= (lengths.to(dev)[:, None] - 2 - i)) & F.pad(
            inside[:, shift:], (0, shift), value=False
        )  # [B, T]
        if not valid.any():
            break
        logq = torch.log_softmax(head.logits(out).float(), -1)  # [B, T, Vd]
        tgt = F.pad(p[:, shift:], (0, 0, 0, shift))  # [B, T, Vd]
        loss = loss + DECAY**i * -(tgt[valid] * logq[valid]).sum(-1).mean()
        with torch.no_grad():
            gen = valid & (rows + shift >= plen.to(dev)[:, None] - 1)  # the predicted token was generated
            hit = head.target_ids(logq.argmax(-1)) == F.pad(greedy[:, shift:], (0, shift))
            parts["top1"].append(float(hit[gen].float().mean()) if gen.any() else float("nan"))
            parts["n"].append(int(gen.sum()))
    return loss, {"loss": loss.detach().item(), **parts}


@torch.no_grad()
def evaluate(
    head: Eagle3Head, embed: Any, lm_head: Any, used: torch.Tensor, seqs: list[Sequence], s: Train3Settings
) -> dict[str, Any]:
    """Held-out loss and top-1 agreement per unrolled step (position-weighted)."""
    head.eval()
    loss, n_batches = 0.0, 0
    hits = [0.0] * s.ttt_steps
    counts = [0] * s.ttt_steps
    for b0 in range(0, len(seqs), s.batch_size):
        value, part = head_step(head, embed, lm_head, used, seqs[b0 : b0 + s.batch_size], s)
        loss += part["loss"]
        n_batches += 1
        for i, (top1, n) in enumerate(zip(part["top1"], part["n"])):
            if n:
                hits[i] += top1 * n
                counts[i] += n
    per_step = [h / c if c else float("nan") for h, c in zip(hits, counts)]
    return {"loss": loss / max(1, n_batches), "top1": per_step[0], "top1_per_step": per_step, "positions": counts[0]}


@torch.no_grad()
def fit_temperature(
    head: Eagle3Head, embed: Any, lm_head: Any, seqs: list[Sequence], max_positions: int = 8192
) -> float:
    """T calibrating step 0's q to greedy acceptance (``treespec.train.calibration``), on held-out
    generated positions whose target token is in the draft vocabulary."""
    to_draft = torch.cumsum(head.t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    zs, ys, n, dev = [], [], 0, to_draft.device
    for b0 in range(0, len(seqs), 16):
        ids, fused, feats, lengths, plen = (x.to(dev) for x in pad_batch(seqs[b0 : b0 + 16]))
        out = unroll(head, embed, fused, ids, 1)[0]  # [B, T, H]
        greedy = F.pad(lm_head(feats[:, 1:]).argmax(-1), (0, 1))  # [B, T] the target's token for x_{t+2}
        rows = torch.arange(ids.shape[1], device=dev)[None]
        keep = (rows <= lengths[:, None] - 2) & (rows + 1 >= plen[:, None] - 1) & head.t2d[greedy]
        zs.append(head.logits(out[keep]).float())
        ys.append(to_draft[greedy[keep]])
        n += int(keep.sum())
        if n >= max_positions:
            break
    return calibration.fit_temperature(torch.cat(zs)[:max_positions], torch.cat(ys)[:max_positions])


def _check(s: Train3Settings) -> None:
    """One line for settings that cannot train, before the target is loaded."""
    if not 0 < s.holdout < 1:
        raise ConfigError(f"--holdout must be between 0 and 1, got {s.holdout}")
    if s.ttt_steps < 1:
        raise ConfigError(f"--ttt-steps must be ≥ 1, got {s.ttt_steps}")
    if s.draft_vocab and s.draft_vocab < 2:  # 0 or None: the default
        raise ConfigError(f"--draft-vocab must be ≥ 2, got {s.draft_vocab}")
    if s.max_len < 8:
        raise ConfigError(f"--max-len must be ≥ 8, got {s.max_len}")
    check_device(s.device)


def _new_head(config: Any, hidden: int, vocab: int, used: torch.Tensor, lm_head: torch.nn.Module) -> Eagle3Head:
    """A fresh head over the draft vocabulary ``used`` (target ids), its output rows the target's own."""
    size = int(used.numel())
    head = Eagle3Head(head_config_for(config), target_hidden=hidden, draft_vocab=size, target_vocab=vocab)
    with torch.no_grad():
        head.d2t.copy_(used - torch.arange(size))
        head.t2d.zero_()[used] = True
        rows = lm_head.weight[used.to(lm_head.weight.device)]  # [Vd, H] a start: the target's own output rows
        head.lm_head.weight.copy_(rows)
    return head


def _epoch_line(h: dict[str, Any]) -> str:
    steps = " ".join(f"{a:.2f}" for a in h["held_out"]["top1_per_step"])
    return (
        f"epoch {h['epoch']}: train loss {h['train_loss']:.4f} · held-out loss {h['held_out']['loss']:.4f} · "
        f"top-1 agreement per unrolled step {steps}"
    )


def _final_figures(final: dict[str, Any]) -> dict[str, Any]:
    return {
        "held_out_positions": final["positions"],
        "top1": final["top1"],
        "top1_per_step": final["top1_per_step"],
        "held_out_loss": final["loss"],
    }


def train3(s: Train3Settings, progress: Progress = quiet, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) an EAGLE-3 head; returns the summary also written to ``OUT/training.json``."""
    _check(s)
    out = prepare_out(s.out, "EAGLE-3 training")
    torch.manual_seed(s.seed)
    target, embed, lm_head = frozen_target(s.target, s.device)
    model = target.model
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = default_layers(int(cfg.num_hidden_layers))
    seqs = training_data(target, s, out, progress, log, layers=layers)
    vocab = target.vocab_size
    size = min(vocab, s.draft_vocab or 32_000)
    n_hold = max(1, round(len(seqs) * s.holdout))
    held, train_set = crop(seqs[:n_hold], s.max_len), crop(seqs[n_hold:], s.max_len)
    used = draft_vocabulary(train_set, vocab, size)

    head = _new_head(model.config, target.hidden_size, vocab, used, lm_head).to(target.device)
    used = used.to(target.device)  # trained where the target's features are computed
    run = TrainRun.new(head, s, len(train_set))
    ckpt_file = out / "checkpoint.pt"
    start, history = run.resume(ckpt_file, s, log)
    t0 = time.perf_counter()
    for epoch in range(start, s.epochs):
        running = run.epoch(
            epoch, train_set, lambda batch: head_step(head, embed, lm_head, used, batch, s), s, progress
        )
        held_out = evaluate(head, embed, lm_head, used, held, s)
        history.append({"epoch": epoch + 1, "train_loss": running, "held_out": held_out})
        log(_epoch_line(history[-1]))
        run.save(ckpt_file, s, epoch + 1, history)
    final = history[-1]["held_out"] if history else evaluate(head, embed, lm_head, used, held, s)
    head.eval()
    temperature = fit_temperature(head, embed, lm_head, held)
    log(f"calibration temperature {temperature:.3f} (the head's q for tree builders: softmax(logits / T))")
    summary = {
        "settings": asdict(s),
        "version": 3,
        "layers": list(layers),
        "draft_vocab": size,
        "train_sequences": len(train_set),
        "held_out_sequences": len(held),
        **_final_figures(final),
        "history": history,
        "calibration_temperature": temperature,
        "train_seconds": time.perf_counter() - t0,
        "parameters": sum(p.numel() for p in head.parameters()),
    }
    head.save(
        out,
        layers=layers,
        extra={
            "target": s.target,
            "top1_held_out": final["top1"],
            "calibration_temperature": temperature,
            "trained_with": "treespec train eagle --version 3",
        },
    )
    write_text_atomic(out / "training.json", json.dumps(summary, indent=2) + "\n", "--out")
    return summary
