"""Training a block drafter (``treespec train block``): DFlash's recipe on the EAGLE heads' data.

Data (``eagle_data.py``, as EAGLE-3's): the target's own greedy continuations with its hidden
states at the three feature layers (``fused``, the block's context) and its last layer (``feats``:
the target's distribution p_u = softmax(lm_head(feats_{u−1})) over x_u). ``--answers DATA.pt``
reuses the continuations of an earlier EAGLE run on the same prompts, so only features are computed.

Loss: per sequence, N random anchors a in the generated part (redrawn every batch). Each anchor's
block [x_a, m×K] at positions a..a+K sees the context x_0..x_{a−1} only (never other blocks), and
row k is scored against the target's distribution for x_{a+k}, restricted to the draft vocabulary:

    L = Σ_k w_k · CE(p_{a+k}, q_{k}) / Σ_k w_k,   w_k = exp(−(k−1)/γ)      (SpecForge's DFlash weights)

Soft labels (not only the greedy token) keep q a probability estimate, which matters when children
are drawn from it. Held out: top-1 agreement per depth and the argmax chain's τ (1 + its mean
accepted prefix). After the last epoch one temperature per depth is fitted for tree shaping
(``treespec.train.calibration``). Resumable (``OUT/checkpoint.pt``, EAGLE's ``TrainRun``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from treespec.devices import check_device
from treespec.errors import ConfigError
from treespec.files import write_text_atomic
from treespec.plugins.block_head import BlockHead, BlockSpec
from treespec.plugins.block_settings import BlockSettings
from treespec.plugins.eagle3_head import default_layers
from treespec.plugins.eagle3_train import crop, draft_vocabulary, pad_batch
from treespec.plugins.eagle_data import Progress, Sequence, quiet, training_data
from treespec.plugins.eagle_head import head_config_for
from treespec.plugins.eagle_train import TrainRun, frozen_target
from treespec.train import calibration
from treespec.train.checkpoint import prepare_out


def weights(s: BlockSettings) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ), k = 1..K: [K]."""
    gamma = s.gamma or s.block_size / 2
    return torch.exp(-torch.arange(s.block_size, dtype=torch.float32) / gamma)


def _anchors(seqs: list[Sequence], n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` distinct anchors per sequence in its generated part (a ≥ prompt_len − 1, a ≤ T − 2):
    anchors [B, N] and which are real [B, N]."""
    a = torch.zeros(len(seqs), n, dtype=torch.long)
    real = torch.zeros(len(seqs), n, dtype=torch.bool)
    for r, s in enumerate(seqs):
        lo, hi = max(1, s.prompt_len - 1), s.ids.numel() - 2
        if hi < lo:
            continue
        pick = lo + torch.randperm(hi - lo + 1, generator=gen)[:n]
        a[r, : pick.numel()], real[r, : pick.numel()] = pick, True
    return a, real


def block_outputs(
    head: BlockHead, embed_w: torch.Tensor, out_w: torch.Tensor, seqs: list[Sequence], n: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One batch through the drafter: its logits [B, N, K, Vd], the target's p [B, N, K, Vd] over the
    draft vocabulary, the data tokens x_{a+k} [B, N, K], and which rows count [B, N, K]."""
    ids, fused, feats, lengths, _ = pad_batch(seqs)
    dev = out_w.device
    ids, fused, feats, lengths = ids.to(dev), fused.to(dev), feats.to(dev), lengths.to(dev)
    b, t = ids.shape
    k = head.spec.block_size
    a, real = _anchors(seqs, n, gen)
    a, real = a.to(dev), real.to(dev)
    c = head.fuse(fused)  # [B, T, H]
    ctx = head.context(c, torch.arange(t, device=dev)[None].expand(b, t))  # per layer [B, Hkv, T, D]
    last = c.gather(1, (a - 1).clamp(min=0)[..., None].expand(-1, -1, c.shape[-1]))  # [B, N, H] c_{a−1}
    last = last * (a > 0)[..., None]  # an empty context adds nothing
    x = head.block_input(F.embedding(ids.gather(1, a), embed_w), last)  # [B, N, K+1, H]
    positions = a[..., None] + torch.arange(k + 1, device=dev)  # [B, N, K+1]
    visible = torch.arange(t, device=dev)[None, None] < a[..., None]  # [B, N, T]: x_0..x_{a-1}
    out = head(x, positions, ctx, visible)  # [B, N, K+1, H]
    u = positions[..., 1:]  # [B, N, K] the predicted positions
    inside = real[..., None] & (u < lengths[:, None, None])
    uc = u.clamp(max=t - 1)
    tokens = ids.gather(1, uc.flatten(1)).view_as(u)  # [B, N, K] x_{a+k}
    with torch.no_grad():
        prev = feats.gather(1, (uc - 1).flatten(1)[..., None].expand(-1, -1, feats.shape[-1]))  # [B, N·K, H]
        p = torch.softmax((prev @ out_w.T).float(), -1).view(b, n, k, -1)  # [B, N, K, Vd]
    return {"logits": head.logits(out[..., 1:, :], out_w), "p": p, "tokens": tokens, "inside": inside}


def loss_of(head: BlockHead, o: dict[str, torch.Tensor], s: BlockSettings) -> torch.Tensor:
    """The weighted soft cross-entropy of the module docstring over ``block_outputs``' rows that count
    and whose token is in the draft vocabulary."""
    in_vocab = torch.zeros(head.spec.target_vocab_size, dtype=torch.bool, device=o["tokens"].device)
    in_vocab[head.draft_ids] = True
    valid = o["inside"] & in_vocab[o["tokens"]]  # [B, N, K]
    w = weights(s).to(valid.device)[None, None].expand_as(valid)  # [B, N, K]
    ce = -(o["p"] * torch.log_softmax(o["logits"].float(), -1)).sum(-1)  # [B, N, K]
    return (ce * w)[valid].sum() / w[valid].sum().clamp(min=1e-9)


def block_loss(
    head: BlockHead,
    embed_w: torch.Tensor,
    out_w: torch.Tensor,
    seqs: list[Sequence],
    s: BlockSettings,
    gen: torch.Generator,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One training batch: (loss, {"loss": its value})."""
    loss = loss_of(head, block_outputs(head, embed_w, out_w, seqs, s.anchors, gen), s)
    return loss, {"loss": loss.detach().item()}


@torch.no_grad()
def evaluate(
    head: BlockHead, embed_w: torch.Tensor, out_w: torch.Tensor, seqs: list[Sequence], s: BlockSettings
) -> dict[str, Any]:
    """Held-out loss, top-1 agreement per depth, and the argmax chain's τ (fixed anchors: seed 0)."""
    head.eval()
    gen = torch.Generator().manual_seed(0)
    hits = torch.zeros(s.block_size)
    counts = torch.zeros(s.block_size)
    prefix, blocks, loss, batches = 0.0, 0, 0.0, 0
    for b0 in range(0, len(seqs), s.batch_size):
        batch = seqs[b0 : b0 + s.batch_size]
        o = block_outputs(head, embed_w, out_w, batch, s.anchors, gen)
        loss, batches = loss + float(loss_of(head, o, s)), batches + 1
        hit = (head.draft_ids[o["logits"].argmax(-1)] == o["tokens"]) & o["inside"]  # [B, N, K]
        hits += hit.float().sum((0, 1)).cpu()
        counts += o["inside"].float().sum((0, 1)).cpu()
        full = o["inside"][..., 0]  # blocks with at least one position
        prefix += float(hit.long().cumprod(-1).sum(-1)[full].sum())
        blocks += int(full.sum())
    per_depth = (hits / counts.clamp(min=1)).tolist()
    return {
        "loss": loss / max(1, batches),
        "top1_per_depth": per_depth,
        "chain_tau": 1 + prefix / max(1, blocks),
        "positions": int(counts[0]),
    }


@torch.no_grad()
def fit_temperatures(
    head: BlockHead, embed_w: torch.Tensor, out_w: torch.Tensor, seqs: list[Sequence], s: BlockSettings
) -> list[float]:
    """One calibration temperature per depth, on held-out rows whose token is in the draft vocabulary."""
    to_draft = torch.full((head.spec.target_vocab_size,), -1, dtype=torch.long, device=out_w.device)
    to_draft[head.draft_ids] = torch.arange(head.draft_ids.numel(), device=out_w.device)
    zs: list[list[torch.Tensor]] = [[] for _ in range(s.block_size)]
    ys: list[list[torch.Tensor]] = [[] for _ in range(s.block_size)]
    gen = torch.Generator().manual_seed(1)
    for b0 in range(0, len(seqs), s.batch_size):
        o = block_outputs(head, embed_w, out_w, seqs[b0 : b0 + s.batch_size], s.anchors, gen)
        label = to_draft[o["tokens"]]
        keep = o["inside"] & (label >= 0)
        for d in range(s.block_size):
            zs[d].append(o["logits"][:, :, d][keep[:, :, d]].float())
            ys[d].append(label[:, :, d][keep[:, :, d]])
    out = []
    for d in range(s.block_size):
        z, y = torch.cat(zs[d]), torch.cat(ys[d])
        out.append(calibration.fit_temperature(z, y) if y.numel() else 1.0)
    return out


def plot_history(history: list[dict[str, Any]], path: Any) -> None:
    """``OUT/training.png``: training and held-out loss per epoch, and held-out top-1 agreement per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from treespec.files import savefig_atomic

    epochs = [h["epoch"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, [h["train_loss"] for h in history], marker="o", label="training (smoothed)")
    left.plot(epochs, [h["held_out"]["loss"] for h in history], marker="o", label="held out")
    left.set(xlabel="epoch", ylabel="weighted cross-entropy", title="loss")
    left.legend()
    for d in range(len(history[0]["held_out"]["top1_per_depth"])):
        right.plot(epochs, [h["held_out"]["top1_per_depth"][d] for h in history], marker=".", label=f"depth {d + 1}")
    right.set(xlabel="epoch", ylabel="top-1 agreement with the target", title="held out, per depth", ylim=(0, 1))
    right.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    savefig_atomic(fig, path, "--out", format="png", dpi=110)
    plt.close(fig)


def check(s: BlockSettings) -> None:
    """One line per bad setting, before the target is loaded."""
    if not 0 < s.holdout < 1:
        raise ConfigError(f"--holdout must be between 0 and 1, got {s.holdout}")
    for name, value in (("--block-size", s.block_size), ("--layers", s.layers), ("--anchors", s.anchors)):
        if value < 1:
            raise ConfigError(f"{name} must be ≥ 1, got {value}")
    if s.gamma is not None and not (math.isfinite(s.gamma) and s.gamma > 0):
        raise ConfigError(f"--gamma must be a finite number > 0, got {s.gamma}")
    if s.save_dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError(f"--save-dtype {s.save_dtype!r}: use float32, float16 or bfloat16")
    check_device(s.device)


def with_layers(s: BlockSettings, target: Any) -> BlockSettings:
    """``s`` with its feature layers filled in (EAGLE-3's three by default) and checked against the target."""
    cfg = target.model.config
    n_layers = int((cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg).num_hidden_layers)
    s = replace(s, feature_layers=tuple(s.feature_layers) or default_layers(n_layers))
    if not all(0 <= i <= n_layers for i in s.feature_layers):
        raise ConfigError(
            f"--feature-layers {','.join(map(str, s.feature_layers))}: hidden-state indices must lie in 0..{n_layers} "
            f"(i = the input of decoder layer i; {n_layers} = the last layer's output, after the final norm)"
        )
    return s


def new_drafter(target: Any, embed: Any, train_set: list[Sequence], s: BlockSettings) -> BlockHead:
    """A drafter to train from scratch: its draft vocabulary the ``--draft-vocab`` tokens the target
    generated most on the training prompts, its mask vector the average of their embeddings."""
    vocab = target.vocab_size
    size = min(vocab, s.draft_vocab or 32_000)
    used = draft_vocabulary(train_set, vocab, size)
    spec = BlockSpec(s.block_size, s.feature_layers, target.hidden_size, vocab, size, s.last_feature)
    head = BlockHead(head_config_for(target.model.config, layers=s.layers), spec)
    with torch.no_grad():
        head.draft_ids.copy_(used)
        head.mask.copy_(embed.weight[used.to(embed.weight.device)].float().mean(0))  # a start: the average token
    return head


def initial_drafter(target: Any, s: BlockSettings, log: Callable[[str], None]) -> BlockHead | None:
    """With ``--init``, the drafter fine-tuning starts from, which keeps its shape: its block size,
    layers and newest-row input must be the settings' (one line naming the flag that differs), its
    feature layers and draft vocabulary are its own (``--feature-layers`` / ``--draft-vocab`` that differ
    are refused). None: a new drafter."""
    if s.init is None:
        return None
    from treespec.plugins.block_head import load_block_head

    head, _ = load_block_head(s.init, target.hidden_size, target.vocab_size, f"target {target.name!r}")
    spec, layers = head.spec, len(head.layers)
    differ = [
        (f"pass --block-size {spec.block_size}", s.block_size != spec.block_size),
        (f"pass --layers {layers}", s.layers != layers),
        (f"pass --{'' if spec.last_feature else 'no-'}last-feature", s.last_feature != spec.last_feature),
        ("drop --feature-layers", bool(s.feature_layers) and tuple(s.feature_layers) != tuple(spec.target_layers)),
        ("drop --draft-vocab", s.draft_vocab is not None and s.draft_vocab != spec.draft_vocab_size),
    ]
    fixes = [fix for fix, bad in differ if bad]
    if fixes:
        raise ConfigError(
            f"--init {s.init} has block size {spec.block_size}, {layers} layer(s), feature layers "
            f"{','.join(map(str, spec.target_layers))} and {spec.draft_vocab_size} draft tokens: {'; '.join(fixes)}"
        )
    log(
        f"starting from {s.init} (feature layers {list(spec.target_layers)}, draft vocabulary: {spec.draft_vocab_size})"
    )
    return head.float().train()


def train_block(s: BlockSettings, progress: Progress = quiet, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) a block drafter; returns the summary also written to ``OUT/training.json``."""
    check(s)
    out = prepare_out(s.out, "block drafter training")
    torch.manual_seed(s.seed)
    target, embed, lm_head = frozen_target(s.target, s.device)
    init = initial_drafter(target, s, log)  # before minutes of generating data, too
    s = with_layers(replace(s, feature_layers=init.spec.target_layers) if init else s, target)
    seqs = training_data(target, s, out, progress, log, layers=s.feature_layers)
    n_hold = max(1, round(len(seqs) * s.holdout))
    held, train_set = crop(seqs[:n_hold], s.max_len), crop(seqs[n_hold:], s.max_len)
    head = (init or new_drafter(target, embed, train_set, s)).to(target.device)  # where the features are
    size, used = head.spec.draft_vocab_size, head.draft_ids
    embed_w, out_w = embed.weight.detach(), lm_head.weight[used].detach()  # [V, H], [Vd, H]
    run = TrainRun.new(head, s, len(train_set))
    ckpt_file = out / "checkpoint.pt"
    start, history = run.resume(ckpt_file, s, log)
    gen = torch.Generator().manual_seed(s.seed)
    t0 = time.perf_counter()
    for epoch in range(start, s.epochs):
        gen.manual_seed(s.seed * 1009 + epoch)
        running = run.epoch(epoch, train_set, lambda b: block_loss(head, embed_w, out_w, b, s, gen), s, progress)
        held_out = evaluate(head, embed_w, out_w, held, s)
        history.append({"epoch": epoch + 1, "train_loss": running, "held_out": held_out})
        depths = " ".join(f"{x:.2f}" for x in held_out["top1_per_depth"])
        log(
            f"epoch {epoch + 1}: train loss {running:.4f} · held-out loss {held_out['loss']:.4f} · top-1 per depth "
            f"{depths} · chain τ {held_out['chain_tau']:.2f}"
        )
        run.save(ckpt_file, s, epoch + 1, history)
    final = history[-1]["held_out"] if history else evaluate(head, embed_w, out_w, held, s)
    head.eval()
    temps = fit_temperatures(head, embed_w, out_w, held, s)
    log("calibration temperatures per depth " + " ".join(f"{t:.2f}" for t in temps))
    facts = {"train_sequences": len(train_set), "held_out_sequences": len(held), "draft_vocab": size}
    return finish(head, s, final, history, temps, facts | {"train_seconds": time.perf_counter() - t0})


def finish(
    head: BlockHead, s: BlockSettings, final: dict, history: list, temps: list[float], facts: dict[str, Any]
) -> dict[str, Any]:
    """Save the drafter (safetensors + config.json), ``training.json`` and ``training.png``; the summary."""
    out = Path(s.out)
    summary = {
        "settings": asdict(s),
        "feature_layers": list(s.feature_layers),
        **facts,
        "held_out": final,
        "history": history,
        "calibration_temperatures": temps,
        "parameters": sum(p.numel() for p in head.parameters()),
    }
    extra = {"target": s.target, "top1_per_depth": final["top1_per_depth"], "chain_tau": final["chain_tau"]}
    extra |= {"calibration_temperatures": temps, "trained_with": "treespec train block"}
    head.save(out, extra=extra, dtype=getattr(torch, s.save_dtype))
    write_text_atomic(out / "training.json", json.dumps(summary, indent=2) + "\n", "--out")
    if history:
        plot_history(history, out / "training.png")
    return summary
