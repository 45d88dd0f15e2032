"""Measuring the per-rank acceptance vector that the `sequoia` builder plans its static tree from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _causal_lm(obj: Any) -> Any:
    """The Hugging Face model itself, from a model or a wrapper holding one in ``.model``
    (``TargetModel``, the ``model`` drafter). A causal LM's own ``.model`` is its backbone: kept."""
    return obj if isinstance(obj, torch.nn.Module) else obj.model


def _name(model: Any) -> str:
    inner = _causal_lm(model)
    name = (
        getattr(model, "name", None)
        or getattr(getattr(inner, "config", None), "_name_or_path", "")
        or type(inner).__name__
    )
    layers = getattr(getattr(inner, "config", None), "num_hidden_layers", None)
    return f"{name} ({layers} layers)" if layers else str(name)


@torch.inference_mode()
def greedy_positions(
    model: Any, draft: Any, prompts_ids: list[list[int]], max_new_tokens: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per prompt: the draft's logits [G, V] before each of the G tokens the target generates
    greedily (``model.generate(do_sample=False)``, stopping at its EOS ids), those tokens [G] (on the
    draft's device; a token ≥ V is one the draft cannot produce), and V = the vocabulary both share.
    ONE forward of the draft over prompt + continuation per prompt; empty prompts and prompts the
    target continues with nothing are skipped. ``model``/``draft``: causal LMs or wrappers of one
    (``TargetModel``, the ``model`` drafter)."""
    model, draft = _causal_lm(model), _causal_lm(draft)
    t_dev = next(model.parameters()).device
    d_dev = next(draft.parameters()).device
    vocab = min(model.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0])
    for ids in prompts_ids:
        if not ids:
            continue
        prompt = torch.tensor([list(ids)], dtype=torch.long, device=t_dev)  # [1, L]
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=max_new_tokens
        )
        seq = out[0].to(d_dev)  # [L + G]
        plen = prompt.shape[1]
        if seq.shape[0] <= plen:
            continue
        logits = draft(input_ids=seq[None, :-1]).logits[0, plen - 1 :, :vocab].float()  # [G, V] before each new token
        yield logits, seq[plen:], vocab


@torch.inference_mode()
def measure_acceptance(
    target: Any,
    drafter_model: Any,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    ranks: int = 16,
    *,
    target_name: str | None = None,
    drafter_name: str | None = None,
    dataset: str | None = None,
) -> dict:
    """The marginal per-rank acceptance vector of ``drafter_model`` against ``target``'s greedy output.

    For every prompt the target decodes greedily (``target.model.generate(do_sample=False)``, stopping
    at its ``generation_config``'s EOS ids), then ONE forward of the draft model over the whole
    sequence gives the draft's distribution at every generated position; the rank of the token the
    target chose there is counted. ``p_r`` = the fraction of generated positions where that rank is r
    (positions where it is ≥ ``ranks`` count in the total only, so Σ p_r ≤ 1).

    Why the marginal is the right vector for greedy verification of a static tree: a child of an
    accepted node is accepted iff its token is the target's greedy token at that node's path, and the
    target's greedy token is one fixed token, so the child of rank r is accepted iff that token has rank
    r in the draft's distribution. The events for different r are mutually exclusive, and the other
    siblings being rejected carries no information beyond that (unlike sampling verification, where
    Sequoia conditions p_r on the ranks < r having been rejected). And every accepted path *is* the
    target's greedy continuation, so the contexts a tree is checked at are exactly the prefixes of the
    target's greedy output measured here. The one approximation the tree's objective Π p_{r_i} makes
    is that ranks at successive depths are independent.

    ``target``: a ``TargetModel`` or a Hugging Face causal LM; ``drafter_model``: a causal LM sharing
    the target's tokenizer (e.g. ``load_causal_lm(path, num_hidden_layers=4)``) or a ``model`` drafter.
    Returns ``{"acceptance": [p_0 .. p_{ranks-1}], "positions": N, "beyond": the fraction of rank ≥
    ranks, "target", "drafter", "dataset", "prompts", "max_new_tokens", "ranks",
    "chain_expected_accepted": Σ_{d=1..8} p_0^d (E(A) of a chain of 8 under the same model)}``.
    """
    if ranks <= 0:
        raise ValueError(f"ranks must be > 0, got {ranks}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    counts, positions = _rank_counts(_causal_lm(target), _causal_lm(drafter_model), prompts_ids, max_new_tokens, ranks)
    if positions == 0:
        raise ValueError("no generated positions to measure: give non-empty prompts")
    acceptance = [c / positions for c in counts.tolist()]
    p0 = acceptance[0]
    return {
        "acceptance": acceptance,
        "positions": positions,
        "beyond": 1.0 - sum(counts.tolist()) / positions,
        "target": target_name or _name(target),
        "drafter": drafter_name or _name(drafter_model),
        "dataset": dataset,
        "prompts": len(prompts_ids),
        "max_new_tokens": max_new_tokens,
        "ranks": ranks,
        "chain_expected_accepted": sum(p0**d for d in range(1, 9)),
    }


def _rank_counts(
    model: Any, draft: Any, prompts_ids: list[list[int]], max_new_tokens: int, ranks: int
) -> tuple[torch.Tensor, int]:
    """([ranks] how often the target's greedy token had each draft rank, generated positions)."""
    counts = torch.zeros(ranks, dtype=torch.long)
    positions = 0
    for logits, chosen, vocab in greedy_positions(model, draft, prompts_ids, max_new_tokens):
        inside = chosen < vocab
        picked = logits.gather(1, chosen.clamp(max=vocab - 1)[:, None])  # [G, 1]
        rank = (logits > picked).sum(dim=1)  # [G] tokens the draft prefers (ties favour the target's token)
        rank = torch.where(inside, rank, ranks)  # a token the draft cannot produce is never accepted
        counts += torch.bincount(rank[rank < ranks].cpu(), minlength=ranks)[:ranks]
        positions += int(chosen.shape[0])
    return counts, positions
