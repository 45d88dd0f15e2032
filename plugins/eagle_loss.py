"""One training step of an EAGLE head (``treespec train eagle``, ``eagle_train.py``): a batch of the
target's sequences as tensors, the loss and its parts.

    L = v_w · SmoothL1(f̂_{j+1}, f_{j+1}) + p_w · CE(p_target(x_{j+2}), log q_head)

over items j = (f_j + noise, x_{j+1}), positions where item j and j+1 exist; top-1 agreement over the
generated positions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from treespec.kv import causal_mask
from treespec.plugins.eagle_data import Sequence
from treespec.plugins.eagle_head import EagleHead

if TYPE_CHECKING:
    from treespec.plugins.eagle_train import TrainSettings


def batch_tensors(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], feats [B, T, H], valid [B, T-1] (item j and j+1 exist), generated [B, T-1]."""
    width = max(s.ids.numel() for s in seqs)
    h = seqs[0].feats.shape[-1]
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    feats = torch.zeros(len(seqs), width, h)
    valid = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    gen = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for r, s in enumerate(seqs):
        n = s.ids.numel()
        ids[r, :n], feats[r, :n] = s.ids, s.feats
        valid[r, : n - 1] = True
        gen[r, max(0, s.prompt_len - 2) : n - 1] = True  # item j predicts x_{j+2}: generated from j = prompt_len - 2
    return ids, feats, valid, gen


class DraftOut(torch.nn.Module):
    """The target's output layer restricted to a draft vocabulary: logits over ``ids`` only ([.., N]);
    ``ids`` maps a draft index back to the target's token id."""

    def __init__(self, lm_head: Any, ids: torch.Tensor):
        super().__init__()
        self.ids = ids.to(lm_head.weight.device)
        self.weight = lm_head.weight[self.ids].detach()  # [N, H] a copy: N/V of the output layer
        self.bias = lm_head.bias[self.ids].detach() if getattr(lm_head, "bias", None) is not None else None

    @staticmethod
    def of(lm_head: Any, ids: torch.Tensor | None) -> Any:
        return lm_head if ids is None else DraftOut(lm_head, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def head_step(
    head: EagleHead,
    embed: Any,
    lm_head: Any,
    seqs: list[Sequence],
    noise: float,
    s: TrainSettings,
    full_head: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over a batch, and its parts: feature loss, token loss, top-1 agreement (generated positions).

    ``lm_head`` may be a draft vocabulary's rows of the target's output layer (``DraftOut``): the token
    loss is then against the target's distribution renormalised over those tokens, and agreement (with
    ``full_head``, the whole output layer) counts the target's greedy token outside them as a miss."""
    ids, feats, valid, gen = batch_tensors(seqs)
    dev = next(head.parameters()).device
    ids, feats, valid, gen = ids.to(dev), feats.to(dev), valid.to(dev), gen.to(dev)
    b, t = ids.shape
    inp = feats[:, :-1]  # [B, T-1, H] f_j
    if noise > 0:
        scale = noise * feats[:, :-1][valid].std()
        inp = inp + (torch.rand_like(inp) - 0.5) * 2 * scale
    with torch.no_grad():
        emb = embed(ids[:, 1:])  # [B, T-1, H] x_{j+1}
        target_p = torch.softmax(lm_head(feats[:, 1:]).float(), dim=-1)  # [B, T-1, V]
    mask = causal_mask(0, t - 1, inp.dtype).to(dev)  # [T-1, T-1]
    pos = torch.arange(t - 1, device=dev)[None].expand(b, -1)  # [B, T-1]
    pred = head(inp, emb, pos, mask[None, None])  # [B, T-1, H] f̂_{j+1}
    logp = torch.log_softmax(lm_head(pred).float(), dim=-1)  # [B, T-1, V]
    vloss = F.smooth_l1_loss(pred[valid], feats[:, 1:][valid])
    ploss = -(target_p[valid] * logp[valid]).sum(-1).mean()
    loss = s.v_weight * vloss + s.p_weight * ploss
    with torch.no_grad():
        keep = gen & valid
        if full_head is None:
            agree = (logp.argmax(-1) == target_p.argmax(-1))[keep].float()
        else:  # the draft's token (mapped to target ids) against the target's greedy token over all V
            agree = (lm_head.ids[logp[keep].argmax(-1)] == full_head(feats[:, 1:][keep]).argmax(-1)).float()
    return loss, {
        "loss": loss.detach().item(),
        "feature_loss": vloss.detach().item(),
        "token_loss": ploss.detach().item(),
        "top1": float(agree.mean()) if agree.numel() else float("nan"),
        "n": int(agree.numel()),
    }
