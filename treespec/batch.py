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

from treespec import inputs, lockstep, step, threads
from treespec.batch_target import BatchTarget
from treespec.errors import ConfigError, DecodingError, Interrupted, TreespecError
from treespec.interfaces import Commit, DraftRows, PrefillContext
from treespec.output import Output, emit
from treespec.stats import RunStats
from treespec.verify import greedy_rows

if TYPE_CHECKING:
    from treespec.decoder import Decoder


def is_batch(prompt: Any) -> bool:
    """A list of prompts (texts, or lists of ids), not one prompt given as a list of ids."""
    return (
        isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(p, (str, list, tuple)) for p in prompt)
    )


class _Row:
    def __init__(self, index: int, ids: list[int], drafter: Any, builder: Any, accept: Any, out: Output):
        self.index, self.ids, self.drafter, self.builder, self.accept, self.out = (
            index,
            ids,
            drafter,
            builder,
            accept,
            out,
        )
        self.committed = list(ids)
        self.admitted = time.perf_counter()


def generate_batch(
    dec: Decoder, prompts: list[Any], max_new_tokens: int, sampling: dict[str, Any], batch_size: int | None = None
) -> list[Output]:
    """Decode every prompt, at most ``batch_size`` rows at a time (default: all at once); a finished
    row's place goes to the next prompt waiting. Returns one ``Output`` per prompt, in order. Ctrl-C
    raises ``Interrupted``, a failure ``DecodingError``; either carries every prompt's output in
    ``.outputs``: the finished ones whole, the rows in flight with what they generated."""

    ids_list = []
    for i, p in enumerate(prompts):
        try:
            ids_list.append(dec.prompt_ids(p))
        except ConfigError as exc:
            raise ConfigError(f"prompt {i + 1} of {len(prompts)}: {exc}") from None
    max_new_tokens = inputs.positive_int("max_new_tokens", max_new_tokens)
    width = len(ids_list) if batch_size is None else min(inputs.positive_int("batch_size", batch_size), len(ids_list))
    outs = [Output(token_ids=[], text="", prompt_ids=ids, stats=RunStats(prompt_tokens=len(ids))) for ids in ids_list]
    run: _Batch | None = None
    try:
        run = _Batch(dec, ids_list, outs, width, max_new_tokens, sampling)
        run.loop()
    except (Exception, KeyboardInterrupt) as exc:  # Ctrl-C or a failure: every prompt's output so far
        interrupted = isinstance(exc, KeyboardInterrupt)
        for i, out in enumerate(outs):
            out.text = dec.text_of(out.token_ids, ids_list[i])
            started = run is not None and i < run.next
            out.stats.stop_reason = out.stats.stop_reason or (
                ("interrupted" if interrupted else "error") if started else "not started"
            )
        finished = sum(o.stats.stop_reason not in ("interrupted", "error", "not started") for o in outs)
        done = f"{finished} of {len(outs)} prompts finished, {sum(len(o.token_ids) for o in outs)} new tokens"
        if interrupted:
            raise Interrupted(f"interrupted ({done})", outs[0], outs) from None
        reason = str(exc) if isinstance(exc, TreespecError) else f"{type(exc).__name__}: {exc}"
        raise DecodingError(f"batched decoding stopped ({done}): {reason}", outs[0], outs) from exc
    finally:
        for r in run.active if run is not None else []:
            r.out.stats.t_total = time.perf_counter() - r.admitted
    for i, out in enumerate(outs):
        out.text = dec.text_of(out.token_ids, ids_list[i])
    return outs


class _Batch:
    """The rows in flight, the prompts waiting, and the shared target cache and draft rows."""

    def __init__(
        self,
        dec: Decoder,
        ids_list: list[list[int]],
        outs: list[Output],
        width: int,
        max_new: int,
        sampling: dict[str, Any],
    ):
        self.dec, self.ids_list, self.outs, self.max_new, self.sampling = dec, ids_list, outs, max_new, sampling
        self.group: DraftRows = dec.drafter.rows(width)
        self.free = list(dec.row_builders(self.group.drafters))  # builders of no row (kept from batch to batch)
        self.bt = BatchTarget(dec.target)
        self.want = step.hidden_request(dec.drafter)
        self.eos = dec.target.eos_token_ids
        self.active: list[_Row] = []
        self.next = 0  # the next prompt to admit
        self._admit(self.group.drafters)

    def _admit(self, drafters: list[Any]) -> None:
        """Prompts ``next``, ``next + 1``, … take the rows of ``drafters`` (new rows at the batch's end)."""
        dec, s = self.dec, self.sampling
        rows = []
        for drafter in drafters:
            i, builder = self.next, self.free.pop(0)
            self.next += 1
            seed = None if s.get("seed") is None else inputs.seed_value(s["seed"]) + i
            params, draft = dec.sampling(
                s.get("temperature"),
                s.get("top_p"),
                s.get("top_k"),
                seed,
                s.get("draft_temperature"),
                s.get("rule", "auto"),
                builder,
            )
            accept = (
                step.greedy if params is None else step.sampling_rule(params, draft.generator, s.get("rule", "auto"))
            )
            builder.start(draft)
            rows.append(_Row(i, self.ids_list[i], drafter, builder, accept, self.outs[i]))
        t0 = time.perf_counter()
        prompts = [r.ids for r in rows]
        hidden = (
            self.bt.add(prompts, want_hidden=self.want)
            if self.active
            else self.bt.prefill(prompts, want_hidden=self.want)
        )
        for r, h in zip(rows, hidden):
            r.drafter.prefill(PrefillContext(input_ids=torch.tensor(r.ids, dtype=torch.long), hidden=h))
            r.out.stats.t_prefill = time.perf_counter() - t0
        self.active += rows

    def _leave(self, gone: list[int], reasons: list[str]) -> None:
        """Rows ``gone`` (indices into ``active``) are finished: they leave, and waiting prompts take
        their places."""
        now = time.perf_counter()
        for i, why in zip(gone, reasons):
            r = self.active[i]
            r.out.stats.stop_reason = why
            r.out.stats.t_total = now - r.admitted
            self.free.append(r.builder)
        keep = [i for i in range(len(self.active)) if i not in set(gone)]
        self.bt.keep(keep)
        self.group.keep(keep)
        self.active = [self.active[i] for i in keep]
        waiting = min(len(gone), len(self.ids_list) - self.next)
        if waiting > 0:
            self._admit(self.group.add(waiting))

    def loop(self) -> None:
        dec, bt = self.dec, self.bt
        last = time.perf_counter()  # the end of the previous step
        while self.active:
            # rows with no room left (max_new_tokens, context) stop before drafting
            rooms = [dec.room(r.committed, self.max_new - len(r.out.token_ids)) for r in self.active]
            full = [i for i, room in enumerate(rooms) if room <= 0]
            if full:
                self._leave(
                    full,
                    [
                        "max_new_tokens" if len(self.active[i].out.token_ids) >= self.max_new else "context"
                        for i in full
                    ],
                )
                last = time.perf_counter()  # newcomers' prefill is not the next step's cost
                continue
            active = self.active
            t_draft = time.perf_counter()
            trees = lockstep.draft_rows(
                self.group, [r.builder for r in active], [r.committed[-1] for r in active], [room - 1 for room in rooms]
            )
            t_draft = time.perf_counter() - t_draft
            tts = [t.tensors(int(bt.lens[i]), dtype=bt.dtype) for i, t in enumerate(trees)]
            t_verify = time.perf_counter()
            logits, hiddens = bt.forward_trees(tts, want_hidden=self.want)
            t_verify = time.perf_counter() - t_verify
            if all(r.accept is step.greedy for r in active):  # one pass over [B, N_max] (verify.greedy_rows)
                accs = greedy_rows(tts, logits)
            else:  # each row's own rule and generator
                accs = [
                    r.accept(tree, tt, logits[i, : len(tree)])
                    for i, (r, tree, tt) in enumerate(zip(active, trees, tts))
                ]
            bt.commit([a.nodes for a in accs])
            for r, tree, acc, h in zip(active, trees, accs, hiddens):
                r.builder.verified(tree, acc.nodes)
                tokens = acc.tokens + [acc.bonus]
                r.drafter.commit(Commit(tokens=tokens, hidden=h[acc.nodes.to(h.device)] if h is not None else None))
            now = time.perf_counter()
            # every row waited for the whole step: its times are the step's (drafting, the shared forward)
            seconds = {"draft": t_draft, "verify": t_verify, "bookkeeping": max(0.0, now - last - t_draft - t_verify)}
            ended = []
            for i, (r, tree, acc) in enumerate(zip(active, trees, accs)):
                done = step.Step(
                    verdict=step.Verdict(tree=tree, acceptance=acc, hidden=None),
                    tokens=acc.tokens + [acc.bonus],
                    seconds=seconds,
                )
                if emit(r.out, r.committed, done, self.eos, wall=now - last, note=r.builder.plan_note())[1]:
                    ended.append(i)
                r.builder.observe(r.out.stats.steps[-1])
            if ended:
                self._leave(ended, ["eos"] * len(ended))
            threads.follow()  # treespec/threads.py
            last = time.perf_counter()


def check_batch_settings(stream: Any) -> None:
    if stream is not None:
        raise ConfigError("stream is for one prompt: decode a batch without stream, or stream prompts one at a time")
