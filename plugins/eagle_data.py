"""The data an EAGLE head learns from (``treespec train eagle``, both versions): the target's OWN
greedy continuations of the prompts (what the head must predict at decode time), with the target's
last hidden states f (after its final norm) at every position, and for EAGLE-3 the hidden states of
three chosen layers. Computed once and kept in ``OUT/data.pt`` (plain tensors and ints, read back
with ``weights_only``), reused while the data settings (``data_key()``) stay the same.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treespec.errors import ConfigError
from treespec.files import save_torch_atomic
from treespec.plugins.train_settings import DataSettings
from treespec.target import TargetModel
from treespec.train.checkpoint import load_data, same_settings


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] long: prompt + the target's continuation
    feats: torch.Tensor  # [T, H] the target's last hidden states
    prompt_len: int
    fused: torch.Tensor | None = None  # [T, k·H] hidden states of k chosen layers (EAGLE-3), if collected


def sequences(data: dict[str, Any]) -> list[Sequence]:
    """The sequences of a ``data.pt`` read with ``checkpoint.load_data`` (stored as plain dicts)."""
    return [
        Sequence(ids=x["ids"], feats=x["feats"], prompt_len=int(x["prompt_len"]), fused=x.get("fused"))
        for x in data["seqs"]
    ]


Progress = Callable[[str, int, int, str], None]  # (task, done, total, info)


def quiet(task: str, done: int, total: int, info: str) -> None:
    pass


# ---------------------------------------------------------------------- data
@torch.inference_mode()
def collect(
    target: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch: int,
    progress: Progress,
    layers: tuple[int, ...] | None = None,
    journal: Path | None = None,
    key: Any = None,
) -> list[Sequence]:
    """The target's greedy continuation of every prompt, and its features along prompt + continuation
    (and, with ``layers``, the hidden states of those layers concatenated: EAGLE-3's fused input).

    With ``journal``, every batch's continuations are saved there as they finish (with ``key``), and
    an interrupted run picks up from them: generating is the long part (an hour for 2,000 prompts of
    256 tokens here), and a stop should cost a batch, not the hour."""
    model, dev, eos = target.model, target.device, target.eos_token_ids
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    done = _journaled(prompts, journal, key)
    todo = [i for i in order if i not in done]
    for b0 in range(0, len(todo), batch):
        idx = todo[b0 : b0 + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)  # [B, W] left-padded
        att = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            att[r, width - len(prompts[i]) :] = 1
        gen = model.generate(
            input_ids=ids.to(dev),
            attention_mask=att.to(dev),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )[:, width:].cpu()  # [B, ≤ max_new]
        for r, i in enumerate(idx):
            cont = gen[r].tolist()
            stop = next((j for j, t in enumerate(cont) if t in eos), None)
            cont = cont[: stop + 1] if stop is not None else cont
            seq = torch.tensor(prompts[i] + cont, dtype=torch.long)  # [T]
            done[i] = Sequence(seq, torch.empty(0), len(prompts[i]))
        if journal is not None:
            index = sorted(done)
            save_torch_atomic(
                {"key": key, "index": index, "conts": [done[i].ids[done[i].prompt_len :] for i in index]}, journal
            )
        progress("generating the target's continuations", len(done), len(order), "")
    for b0 in range(0, len(order), batch):
        _features(model, dev, [done[i] for i in order[b0 : b0 + batch]], layers)
        progress("computing the target's features", min(b0 + batch, len(order)), len(order), "")
    return [done[i] for i in range(len(prompts))]


def _journaled(prompts: list[list[int]], journal: Path | None, key: Any) -> dict[int, Sequence]:
    """The continuations an interrupted run saved in ``journal`` for the same ``key`` (features to come)."""
    done: dict[int, Sequence] = {}
    if journal is not None and journal.is_file():
        saved = load_data(journal)
        if same_settings(saved.get("key", {}), key):
            for i, cont in zip(saved["index"], saved["conts"]):
                done[int(i)] = Sequence(
                    torch.tensor(prompts[int(i)] + cont.tolist(), dtype=torch.long),
                    torch.empty(0),
                    len(prompts[int(i)]),
                )
    return done


def _features(model: Any, dev: Any, seqs: list[Sequence], layers: tuple[int, ...] | None) -> None:
    """Fill each sequence's features (the last hidden state; with ``layers``, those layers' hidden states
    concatenated) from ONE forward of the batch, right-padded."""
    width = max(s.ids.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T] right-padded
    for r, s in enumerate(seqs):
        ids[r, : s.ids.numel()] = s.ids
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    states = model(input_ids=ids.to(dev), output_hidden_states=True, **extra).hidden_states  # no [B, T, V] logits
    hs = states[-1].float().cpu()  # [B, T, H]
    fused = torch.cat([states[j] for j in layers], -1).float().cpu() if layers else None  # [B, T, k·H]
    for r, s in enumerate(seqs):
        s.feats = hs[r, : s.ids.numel()].clone()
        if fused is not None:
            s.fused = fused[r, : s.ids.numel()].clone()


def reuse_answers(s: DataSettings, out: Path, log: Callable[[str], None]) -> None:
    """Write ``OUT/generated.pt`` (the data collector's journal) from an earlier run's ``data.pt`` on the
    same prompts, so only the features are computed (``eagle_data.collect`` picks the journal up)."""
    from treespec.bench.datasets import load_prompts

    data = load_data(s.answers, mmap=True)  # the continuations only: its features (GBs) stay on disk
    old = data.get("key", {})
    same = {k: old.get(k) for k in ("target", "data", "offset", "max_new_tokens")}
    want = {k: getattr(s, k) for k in same}
    if not same_settings(same, want):
        raise ConfigError(
            f"--answers {s.answers}: made with {same}, this run needs {want}; drop --answers to generate anew"
        )
    n = min(len(data["seqs"]), len(load_prompts(s.data)[s.offset : s.offset + s.limit]))
    conts = [x["ids"][int(x["prompt_len"]) :].clone() for x in data["seqs"][:n]]
    save_torch_atomic(
        {"key": {**s.data_key(), "kept": 0}, "index": list(range(n)), "conts": conts}, out / "generated.pt"
    )
    log(f"reusing {n} continuations from {s.answers}: computing the target's features only")


def training_data(
    target: TargetModel,
    s: Any,
    out: Path,
    progress: Progress,
    log: Callable[[str], None],
    layers: tuple[int, ...] | None = None,
) -> list:
    """The target's own generations for the dataset's prompts, with its features: reused from
    ``OUT/data.pt`` when that was made with the same data settings, else generated and saved."""
    from treespec.bench.datasets import format_turns, load_prompts

    data_file = out / "data.pt"
    if s.answers and not data_file.is_file():  # --answers: an earlier run's continuations
        reuse_answers(s, out, log)
    cached = load_data(data_file) if data_file.is_file() else None
    if cached is not None and same_settings(cached["key"], s.data_key()):
        seqs = sequences(cached)
        log(f"reusing the target's generations in {data_file} ({len(seqs)} sequences)")
        return seqs
    items = load_prompts(s.data)[s.offset : s.offset + s.limit]
    kept = _prefix(cached, s.data_key(), len(items))
    if kept:
        log(f"reusing {len(kept)} of {len(items)} sequences in {data_file}; generating the rest")
    if len(items) < 2:
        raise ConfigError(f"dataset {s.data!r} has {len(items)} prompts after --offset {s.offset}: need at least 2")
    limit = target.max_positions
    if limit is not None and limit <= s.max_new_tokens:
        raise ConfigError(
            f"--max-new-tokens {s.max_new_tokens} leaves no room for a prompt in the target's context of {limit}"
        )
    prompts = [format_turns(target.tokenizer, it, []) for it in items[len(kept) :]]
    if limit:
        prompts = [p[-(limit - s.max_new_tokens) :] for p in prompts]  # keep the prompt's tail
    t0 = time.perf_counter()
    journal = out / "generated.pt"  # the continuations so far: an interrupted run resumes from them
    new = collect(
        target,
        prompts,
        s.max_new_tokens,
        s.gen_batch_size or s.batch_size,
        progress,
        layers,
        journal=journal,
        key={**s.data_key(), "kept": len(kept)},
    )
    seqs = kept + new
    rows = [
        {"ids": x.ids, "feats": x.feats, "prompt_len": x.prompt_len} | ({"fused": x.fused} if layers else {})
        for x in seqs
    ]
    save_torch_atomic(
        {"key": s.data_key(), "seqs": rows}, data_file
    )  # plain tensors and ints: read back with weights_only
    journal.unlink(missing_ok=True)
    log(
        f"generated {sum(x.ids.numel() - x.prompt_len for x in new)} tokens for {len(new)} prompts "
        f"in {time.perf_counter() - t0:.0f} s → {data_file}"
    )
    return seqs


def _prefix(cached: dict[str, Any] | None, key: dict[str, Any], wanted: int) -> list[Sequence]:
    """The cached sequences when ``data.pt`` holds a prefix of the wanted prompts: the same settings
    but for a smaller ``--limit`` (growing a dataset generates only the new prompts). Prompts are read
    in a fixed order, so the first ``limit`` of a larger run are the same rows."""
    if cached is None:
        return []
    old = dict(cached["key"])
    if old.pop("limit", None) is None or not same_settings(old, {k: v for k, v in key.items() if k != "limit"}):
        return []
    seqs = sequences(cached)
    return seqs if len(seqs) < wanted else []
