"""The decode loop, for one prompt or many: rows in flight, one step for all of them, rows leaving.

``Decoder.generate(prompt)`` runs it with one row (its own drafter and builder, and ``stream``);
``Decoder.generate([p1, p2, ...])`` with up to ``batch_size`` rows, each with a drafter of
``Drafter.rows(B)`` and a builder of its own (``treespec.batch``). Read ``run`` top to bottom:

    admit          prompts take free rows: the target prefills them (``BatchTarget``: one row on the
                   single sequence's own cache and fast path, several in one batched cache), each
                   drafter sees its prompt
    every step     rows with no room left (max_new_tokens, the context) leave before drafting; then
                   ``step.step_rows``: every row's tree, ONE target forward, each row's acceptance and
                   commit; ``output.emit`` cuts each row's tokens at EOS and records its statistics;
                   each builder observes its row's step; rows that hit EOS leave, waiting prompts
                   take their places (continuous batching)

Every row waits for the whole step, so a row's step statistics are the step's times (drafting, the
shared verification, wall): a cost-aware builder prices its nodes by them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treespec import step, threads
from treespec.batch_target import BatchTarget
from treespec.interfaces import DraftRows, PlanningBuilder, TreeBuilder
from treespec.output import Output, StreamCallback, emit

#: a prompt's acceptance rule, made when it takes a row: (prompt index, the row's builder) → rule
AcceptFor = Callable[[int, TreeBuilder], step.AcceptRule]


@dataclass
class Row:
    """One prompt in flight: its drafter and builder, rule, output and committed tokens."""

    index: int  # the prompt's index
    drafter: Any
    builder: TreeBuilder
    accept: step.AcceptRule
    out: Output
    committed: list[int]  # prompt + new tokens; the last one is the next step's root
    admitted: float = field(default_factory=time.perf_counter)

    @property
    def planner(self) -> PlanningBuilder | None:
        """The builder, if it plans from measured costs (it is told every step's statistics)."""
        return self.builder if isinstance(self.builder, PlanningBuilder) else None


class Engine:
    """The rows in flight, the prompts waiting, the shared target and draft rows (``run``)."""

    def __init__(
        self,
        target: Any,
        drafters: DraftRows,
        builders: list[TreeBuilder],
        prompts: list[list[int]],
        outs: list[Output],
        max_new: int,
        accept_for: AcceptFor,
        room: Callable[[list[int], int], int],
        stream: StreamCallback | None = None,
    ):
        """``drafters``: the rows' drafters (``DraftRows``: its drafters are the first rows, ``add`` makes
        more); ``builders``: one per row, free ones taken by waiting prompts; ``room(committed, wanted)``:
        how many tokens a row may still emit; ``stream``: called with each step's new tokens (one row)."""
        self.prompts, self.outs, self.max_new, self.accept_for, self.room = prompts, outs, max_new, accept_for, room
        self.group, self.free, self.stream = drafters, list(builders), stream
        self.target = BatchTarget(target)
        self.eos = target.eos_token_ids
        self.active: list[Row] = []
        self.next = 0  # the next prompt to take a row

    # ------------------------------------------------------------------ rows coming and going
    def admit(self, drafters: list[Any]) -> None:
        """Prompts ``next``, ``next + 1``, … take the rows of ``drafters`` (new rows at the batch's end)."""
        rows = []
        for drafter in drafters:
            i, builder = self.next, self.free.pop(0)
            self.next += 1
            rows.append(Row(i, drafter, builder, self.accept_for(i, builder), self.outs[i], list(self.prompts[i])))
        t0 = time.perf_counter()
        step.prefill_rows(self.target, drafters, [r.committed for r in rows], join=bool(self.active))
        for r in rows:  # every row waited for the whole prefill
            r.out.stats.t_prefill = time.perf_counter() - t0
        self.active += rows

    def leave(self, gone: list[int], reasons: list[str]) -> None:
        """Rows ``gone`` (indices into ``active``) are finished: they leave, and waiting prompts take
        their places."""
        now = time.perf_counter()
        for i, why in zip(gone, reasons):
            r = self.active[i]
            r.out.stats.stop_reason, r.out.stats.t_total = why, now - r.admitted
            self.free.append(r.builder)
        left = set(gone)
        keep = [i for i in range(len(self.active)) if i not in left]
        self.target.keep(keep)
        self.group.keep(keep)
        self.active = [self.active[i] for i in keep]
        waiting = min(len(gone), len(self.prompts) - self.next)
        if waiting > 0:
            self.admit(self.group.add(waiting))

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Every prompt to its end (EOS, max_new tokens, the context). A failure or Ctrl-C leaves each
        row's output as far as it got, its time so far included."""
        try:
            self._loop()
        finally:
            for r in self.active:  # rows still in flight
                r.out.stats.t_total = time.perf_counter() - r.admitted

    def _loop(self) -> None:
        self.admit(self.group.drafters)
        last = time.perf_counter()  # the end of the previous step
        while self.active:
            rooms = [self.room(r.committed, self.max_new - len(r.out.token_ids)) for r in self.active]
            full = [i for i, room in enumerate(rooms) if room <= 0]
            if full:  # rows with no room left stop before drafting
                outs = [self.active[i].out for i in full]
                self.leave(full, ["max_new_tokens" if len(o.token_ids) >= self.max_new else "context" for o in outs])
                last = time.perf_counter()  # newcomers' prefill is not the next step's cost
                continue
            active = self.active
            done = step.step_rows(
                self.target,
                self.group,
                [r.builder for r in active],
                [r.committed[-1] for r in active],
                [room - 1 for room in rooms],  # one step emits at most depth + 1 tokens
                [r.accept for r in active],
            )
            now = time.perf_counter()
            ended = []
            for i, (r, d) in enumerate(zip(active, done)):
                planner = r.planner
                note = planner.plan_note() if planner is not None else None
                new, eos = emit(r.out, r.committed, d, self.eos, wall=now - last, note=note)
                if planner is not None:
                    planner.observe(r.out.stats.steps[-1])
                if self.stream is not None:
                    self.stream(new)
                if eos:
                    ended.append(i)
            if ended:
                self.leave(ended, ["eos"] * len(ended))
            threads.follow()  # another process took a core, or gave it back (treespec/threads.py)
            last = time.perf_counter()
