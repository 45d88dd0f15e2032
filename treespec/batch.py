"""Decoding several prompts at once: per-row drafting, ONE target forward for every row's tree.

``Decoder.generate([p1, p2, ...])`` runs ``generate_batch``. Each row has its own drafter (a
``Drafter.fork`` of the Decoder's: the weights are shared, the per-sequence state is not) and its own
builder (a fresh one from the Decoder's builder spec, attached to the row's drafter), so a row's
trees are exactly the trees it would get alone. A step:

    for each row:  tree_b = step.draft(drafter_b, builder_b, root_b, room_b − 1)
    logits_b       = BatchTarget.forward_trees([tree_b.tensors(len_b)])     ONE forward, [B, N_max]
    for each row:  acceptance_b = accept_b(tree_b, logits_b)                 per-row rule and generator
    BatchTarget.commit([acceptance_b.nodes])                                  per-row KV compaction
    for each row:  drafter_b.commit(tokens_b, hidden_b)

A row that reaches EOS, its max_new_tokens or the context leaves the batch (``BatchTarget.keep``).
Sampling rows draw from independent generators seeded ``seed + row`` (reproducible per row).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from treespec import step
from treespec.batch_target import BatchTarget
from treespec.errors import ConfigError, DecodingError, TreespecError
from treespec.interfaces import Commit, PrefillContext
from treespec.stats import RunStats

if TYPE_CHECKING:
    from treespec.decoder import Decoder, Output


def is_batch(prompt: Any) -> bool:
    """A list of prompts (texts, or lists of ids), not one prompt given as a list of ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(p, (str, list, tuple)) for p in prompt)


class _Row:
    def __init__(self, index: int, ids: list[int], drafter: Any, builder: Any, accept: Any, out: "Output"):
        self.index, self.ids, self.drafter, self.builder, self.accept, self.out = index, ids, drafter, builder, accept, out
        self.committed = list(ids)


def generate_batch(dec: "Decoder", prompts: list[Any], max_new_tokens: int, sampling: dict[str, Any]) -> list["Output"]:
    """Decode every prompt; returns one ``Output`` per prompt, in order (see the module docstring)."""
    from treespec import inputs
    from treespec.decoder import Output, step_stats

    ids_list = []
    for i, p in enumerate(prompts):
        try:
            ids_list.append(dec._prompt_ids(p))
        except ConfigError as exc:
            raise ConfigError(f"prompt {i + 1} of {len(prompts)}: {exc}") from None
    max_new_tokens = inputs.positive_int("max_new_tokens", max_new_tokens)
    seed = sampling.get("seed")
    rows = []
    for i, ids in enumerate(ids_list):
        drafter = dec.drafter.fork()
        builder = dec.fresh_builder(drafter)
        row_seed = None if seed is None else int(seed) + i
        params, draft = dec._sampling(sampling.get("temperature"), sampling.get("top_p"), sampling.get("top_k"),
                                      row_seed, sampling.get("draft_temperature"), sampling.get("rule", "auto"), builder)
        accept = step.greedy if params is None else step.sampling_rule(params, draft.generator, sampling.get("rule", "auto"))
        builder.start(draft)
        out = Output(token_ids=[], text="", prompt_ids=ids, stats=RunStats(prompt_tokens=len(ids)))
        rows.append(_Row(i, ids, drafter, builder, accept, out))
    bt = BatchTarget(dec.target)
    want = step.hidden_request(dec.drafter)
    eos = dec.target.eos_token_ids
    t_start = time.perf_counter()
    try:
        _run(dec, bt, rows, max_new_tokens, want, eos, step_stats)
    except KeyboardInterrupt:
        raise  # the Decoder's caller sees Ctrl-C; every row's Output keeps what it generated
    except Exception as exc:
        outs = [r.out for r in rows]
        for r in rows:
            r.out.text = dec.text_of(r.out.token_ids, r.ids)
            r.out.stats.stop_reason = r.out.stats.stop_reason or "error"
        reason = str(exc) if isinstance(exc, TreespecError) else f"{type(exc).__name__}: {exc}"
        err = DecodingError(f"batched decoding stopped: {reason}", outs[0])
        err.outputs = outs  # every row's partial output
        raise err from exc
    finally:
        for r in rows:
            r.out.stats.t_total = time.perf_counter() - t_start
    for r in rows:
        r.out.text = dec.text_of(r.out.token_ids, r.ids)
    return [r.out for r in rows]


def _run(dec: "Decoder", bt: BatchTarget, rows: list[_Row], max_new: int, want: Any, eos: set[int], step_stats: Any) -> None:
    t0 = time.perf_counter()
    hidden = bt.prefill([r.ids for r in rows], want_hidden=want)
    for r, h in zip(rows, hidden):
        r.drafter.prefill(PrefillContext(input_ids=torch.tensor(r.ids, dtype=torch.long), hidden=h))
        r.out.stats.t_prefill = time.perf_counter() - t0
    active = list(rows)
    while active:
        # rows with no room left (context) stop before drafting
        rooms = [dec._room(r.committed, max_new - len(r.out.token_ids)) for r in active]
        keep = [i for i, room in enumerate(rooms) if room > 0]
        for i, r in enumerate(active):
            if rooms[i] <= 0:
                r.out.stats.stop_reason = "max_new_tokens" if len(r.out.token_ids) >= max_new else "context"
        if len(keep) < len(active):
            bt.keep(keep)
            active, rooms = [active[i] for i in keep], [rooms[i] for i in keep]
            if not active:
                return
        trees, drafting = [], []
        for r, room in zip(active, rooms):
            t = time.perf_counter()
            trees.append(step.draft(r.drafter, r.builder, r.committed[-1], room - 1))
            drafting.append(time.perf_counter() - t)
        tts = [t.tensors(int(bt.lens[i]), dtype=bt.dtype) for i, t in enumerate(trees)]
        t_verify = time.perf_counter()
        logits, hiddens = bt.forward_trees(tts, want_hidden=want)
        t_verify = time.perf_counter() - t_verify
        accs = [r.accept(tree, tt, lg) for r, tree, tt, lg in zip(active, trees, tts, logits)]
        bt.commit([a.nodes for a in accs])
        done_rows = []
        for i, (r, tree, acc, h, t_draft) in enumerate(zip(active, trees, accs, hiddens, drafting)):
            t_own = time.perf_counter()
            r.builder.verified(tree, acc.nodes)
            tokens = acc.tokens + [acc.bonus]
            r.drafter.commit(Commit(tokens=tokens, hidden=h[acc.nodes.to(h.device)] if h is not None else None))
            new = tokens
            hit = next((j for j, t in enumerate(new) if t in eos), None)
            if hit is not None:
                new = new[: hit + 1]
            r.committed += new
            r.out.token_ids += new
            r.out.stats.new_tokens = len(r.out.token_ids)
            seconds = {"draft": t_draft, "verify": t_verify / len(active),  # the shared forward, split evenly
                       "bookkeeping": time.perf_counter() - t_own}
            done = step.Step(verdict=step.Verdict(tree=tree, acceptance=acc, hidden=None), tokens=tokens, seconds=seconds)
            r.out.stats.steps.append(step_stats(done, emitted=len(new), note=r.builder.plan_note()))
            r.builder.observe(r.out.stats.steps[-1])
            if hit is not None:
                r.out.stats.stop_reason = "eos"
                done_rows.append(i)
        if done_rows:
            keep = [i for i in range(len(active)) if i not in done_rows]
            bt.keep(keep)
            active = [active[i] for i in keep]


def check_batch_settings(stream: Any) -> None:
    if stream is not None:
        raise ConfigError("stream is for one prompt: decode a batch without stream, or stream prompts one at a time")
