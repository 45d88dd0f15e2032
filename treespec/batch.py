"""Decoding several prompts at once: per-row drafting, ONE target forward for every row's tree.

``Decoder.generate([p1, p2, ...])`` runs ``generate_batch``. Each row has its own drafter (one of
``Drafter.rows(B)``: the weights are shared, the per-sequence state is not) and its own builder (made
from the Decoder's builder spec for row i of batches of size B, told the batch size, and kept for
the next batch of that size, as the Decoder's builder is kept from prompt to prompt), so a
row's trees are the trees it would get alone, up to what its cost-aware builder decides at size B. A step:

    trees          = lockstep.draft_rows(rows, builders, roots, rooms − 1)  every row's builder; with a
                                          batching drafter (EAGLE) one draft forward per level for all rows
    logits_b       = BatchTarget.forward_trees([tree_b.tensors(len_b)])     ONE forward, [B, N_max]
    for each row:  acceptance_b = accept_b(tree_b, logits_b)                 per-row rule and generator
    BatchTarget.commit([acceptance_b.nodes])                                  per-row KV compaction
    for each row:  drafter_b.commit(tokens_b, hidden_b)

A row that reaches EOS, its max_new_tokens or the context leaves the batch (``BatchTarget.keep``,
``DraftRows.keep``). Sampling rows draw from independent generators seeded ``seed + row`` (reproducible
per row). A row's step statistics carry the batch step's times (drafting, the shared verification,
wall): every row waits for the whole step, and a cost-aware builder must price its nodes by them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from treespec import lockstep, step
from treespec.batch_target import BatchTarget
from treespec.errors import ConfigError, DecodingError, TreespecError
from treespec.interfaces import Commit, DraftRows, PrefillContext
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
    group = dec.drafter.rows(len(ids_list))
    builders = dec.row_builders(group.drafters)
    for i, ids in enumerate(ids_list):
        drafter, builder = group.drafters[i], builders[i]
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
        _run(dec, bt, group, rows, max_new_tokens, want, eos, step_stats)
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


def _run(dec: "Decoder", bt: BatchTarget, group: DraftRows, rows: list[_Row], max_new: int, want: Any, eos: set[int],
         step_stats: Any) -> None:
    t0 = time.perf_counter()
    hidden = bt.prefill([r.ids for r in rows], want_hidden=want)
    for r, h in zip(rows, hidden):
        r.drafter.prefill(PrefillContext(input_ids=torch.tensor(r.ids, dtype=torch.long), hidden=h))
        r.out.stats.t_prefill = time.perf_counter() - t0
    active = list(rows)
    last = time.perf_counter()  # the end of the previous step
    while active:
        # rows with no room left (context) stop before drafting
        rooms = [dec._room(r.committed, max_new - len(r.out.token_ids)) for r in active]
        keep = [i for i, room in enumerate(rooms) if room > 0]
        for i, r in enumerate(active):
            if rooms[i] <= 0:
                r.out.stats.stop_reason = "max_new_tokens" if len(r.out.token_ids) >= max_new else "context"
        if len(keep) < len(active):
            bt.keep(keep)
            group.keep(keep)
            active, rooms = [active[i] for i in keep], [rooms[i] for i in keep]
            if not active:
                return
        t_draft = time.perf_counter()
        trees = lockstep.draft_rows(group, [r.builder for r in active], [r.committed[-1] for r in active],
                                    [room - 1 for room in rooms])
        t_draft = time.perf_counter() - t_draft
        tts = [t.tensors(int(bt.lens[i]), dtype=bt.dtype) for i, t in enumerate(trees)]
        t_verify = time.perf_counter()
        logits, hiddens = bt.forward_trees(tts, want_hidden=want)
        t_verify = time.perf_counter() - t_verify
        accs = [r.accept(tree, tt, lg) for r, tree, tt, lg in zip(active, trees, tts, logits)]
        bt.commit([a.nodes for a in accs])
        done_rows, steps = [], []
        for i, (r, tree, acc, h) in enumerate(zip(active, trees, accs, hiddens)):
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
            steps.append((r, step.Step(verdict=step.Verdict(tree=tree, acceptance=acc, hidden=None), tokens=tokens,
                                       seconds={}), len(new)))
            if hit is not None:
                r.out.stats.stop_reason = "eos"
                done_rows.append(i)
        now = time.perf_counter()
        # every row waited for the whole step: its times are the step's (drafting, the shared forward)
        seconds = {"draft": t_draft, "verify": t_verify, "bookkeeping": max(0.0, now - last - t_draft - t_verify)}
        for r, done, emitted in steps:
            done.seconds.update(seconds)
            r.out.stats.steps.append(step_stats(done, emitted=emitted, wall=now - last, note=r.builder.plan_note()))
            r.builder.observe(r.out.stats.steps[-1])
        last = time.perf_counter()
        if done_rows:
            keep = [i for i in range(len(active)) if i not in done_rows]
            bt.keep(keep)
            group.keep(keep)
            active = [active[i] for i in keep]


def check_batch_settings(stream: Any) -> None:
    if stream is not None:
        raise ConfigError("stream is for one prompt: decode a batch without stream, or stream prompts one at a time")
