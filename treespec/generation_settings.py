"""The settings of a Hugging Face ``GenerationConfig`` that treespec does not apply: read by the
``Decoder`` (a warning for a model's own ``generation_config``) and by ``model.generate`` through
treespec (``treespec.hf``: refused in one line). Imports nothing of treespec's, so ``import treespec.hf``
stays light."""

from __future__ import annotations

from typing import Any

#: generation settings treespec cannot honour, with the value that leaves the output unchanged
NEUTRAL: dict[str, Any] = {
    "min_length": 0, "min_new_tokens": 0, "max_time": None, "stop_strings": None, "num_beams": 1,
    "min_p": None, "top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "renormalize_logits": False, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "remove_invalid_values": False, "exponential_decay_length_penalty": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None, "token_healing": False,
    "guidance_scale": 1.0, "watermarking_config": None, "num_return_sequences": 1, "output_attentions": False,
    "output_hidden_states": False, "output_scores": False, "output_logits": False, "penalty_alpha": None,
    "dola_layers": None, "diversity_penalty": 0.0, "num_beam_groups": 1, "constraints": None,
    "force_words_ids": None, "cache_implementation": None,
}  # fmt: skip


def unhonoured(generation_config: Any) -> list[str]:
    """The settings of a ``GenerationConfig`` that change ``generate``'s output and treespec does not apply,
    as ``name=value``; empty when it holds none."""
    if generation_config is None:
        return []
    return [
        f"{k}={getattr(generation_config, k)!r}"
        for k, neutral in sorted(NEUTRAL.items())
        if getattr(generation_config, k, None) not in (None, neutral)
    ]
