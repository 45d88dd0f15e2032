"""Drafter `eagle3`: an EAGLE-3 head drafting from three of the target's layers (``eagle3_head.py``).

The head's sequence and tree bookkeeping are EAGLE's (``eagle.py``): item j = (feature at x_j,
x_{j+1}) at position j; committed items carry the target's TRUE fused features (its hidden states at
three layers, concatenated: ``Drafter.target_hidden_layers``, so the Decoder asks the target for
those instead of the last layer), and a tree node below the root is fed with its parent's OUTPUT,
the head's own pre-norm state (which ``Eagle3Head.fuse`` passes through, fc being for 3·H only).

The head predicts over its draft vocabulary (Vd ≤ V): q is scattered onto the target ids
d + d2t[d], so builders and verifiers see target ids only, and a target token outside the draft
vocabulary has q = 0 (never proposed; with sampling, the exact residual still reaches it).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from treespec.errors import ConfigError
from treespec.plugins.configs import Eagle3Config
from treespec.plugins.eagle import EagleDrafter
from treespec.plugins.eagle3_head import config_layers, default_layers, load_head3
from treespec.target import TargetModel


def default_head3(target: TargetModel) -> str:
    """The packaged EAGLE-3 head for the packaged target, if one ships; any other target needs ``head=``."""
    from treespec.catalog import PACKAGED_MODELS, resolve_name

    own = PACKAGED_MODELS["treespec-py"].resolve()
    packaged = PACKAGED_MODELS.get("treespec-py-eagle3")
    if packaged is not None and target.name and Path(resolve_name(target.name)).expanduser().resolve() == own:
        return "treespec-py-eagle3"
    raise ConfigError(
        f"drafter 'eagle3' needs an EAGLE-3 head trained for target {target.name!r}: pass -D head=DIR-or-HUB-ID "
        "(e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B for Llama-3.1-8B-Instruct; make one with "
        "`treespec train eagle --version 3 --target ...`)"
    )


class Eagle3Drafter(EagleDrafter):
    Config = Eagle3Config
    config: Eagle3Config  # type: ignore[assignment]
    drafter = "eagle3"

    def __init__(self, config: Eagle3Config, target: TargetModel):  # noqa: D107 - EagleDrafter's state, another head
        super(EagleDrafter, self).__init__(config, target)
        raw = self.load(target, config.head or default_head3(target), load_head3)  # the head, on the target's device
        self.meta = raw.get("treespec", {})
        cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        n_layers = int(cfg.num_hidden_layers)
        layers = tuple(config.layers) if config.layers else (config_layers(raw) or default_layers(n_layers))
        if len(layers) != 3 or not all(0 <= i <= n_layers for i in layers):
            raise ConfigError(
                f"drafter 'eagle3': layers={list(layers)} must be three hidden-state indices in 0..{n_layers} "
                f"(i = the input of decoder layer i; the target has {n_layers} layers)"
            )
        self.target_hidden_layers = layers  # type: ignore[misc]  # per instance: the Decoder reads it
        self.forward = self.head
        own = self.head.embed_tokens  # a head of another width than the target embeds with its own table
        self.embed = own if own is not None else target.model.get_input_embeddings()  # shared: no copy
        offloaded = self.embed.weight.device.type == "meta"
        self.embed_ids = self.embed if offloaded else (lambda ids: F.embedding(ids, self.embed.weight))
        self.full_vocab = self.head.lm_head.out_features == self.vocab and not bool(self.head.d2t.any())
        self.ids = self.head.target_ids(torch.arange(self.head.lm_head.out_features, device=self.device))  # [Vd]
        self.temperature = float(config.temperature or self.meta.get("calibration_temperature") or 1.0)
        self._new_sequence()

    def _q_draft(self, feats: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """The draft distribution over the head's own vocabulary [M, Vd] (``self.ids`` maps it to target ids)."""
        return torch.softmax(self.head.logits(feats).float() / (temperature or self.temperature), dim=-1)

    def _q(self, feats: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """The draft distribution over TARGET ids [M, V] from the head's outputs [M, H], at the
        calibration temperature (or ``temperature``)."""
        q = torch.softmax(self.head.logits(feats).float() / (temperature or self.temperature), dim=-1)  # [M, Vd]
        if self.full_vocab:
            return q
        out = torch.zeros(q.shape[0], self.vocab, device=q.device, dtype=q.dtype)  # [M, V]
        out[:, self.ids] = q
        return out
