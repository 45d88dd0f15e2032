"""Decoding several prompts at once: rows in flight on one target, refilled as rows finish.

``Decoder.generate([p1, p2, ...])`` runs ``generate_batch``: the prompts go through the one decode
loop (``treespec.engine``) with up to ``batch_size`` rows. Each row has its own drafter (one of
``Drafter.rows(B)``: the weights are shared, the per-sequence state is not) and its own builder (made
from the Decoder's builder spec for row i of batches of size B, told the batch size, and kept for
the next batch of that size, as the Decoder's builder is kept from prompt to prompt), so a row's
trees are the trees it would get alone, up to what its cost-aware builder decides at size B. Sampling
rows draw from independent generators seeded ``seed + row`` (reproducible per row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from treespec import inputs, step
from treespec.engine import Engine
from treespec.errors import ConfigError, DecodingError, Interrupted, TreespecError
from treespec.interfaces import TreeBuilder
from treespec.output import Output
from treespec.stats import RunStats

if TYPE_CHECKING:
    from treespec.decoder import Decoder


def is_batch(prompt: Any) -> bool:
    """A list of prompts (texts, or lists of ids), not one prompt given as a list of ids."""
    return (
        isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(p, (str, list, tuple)) for p in prompt)
    )


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
    run: Engine | None = None
    try:
        group = dec.drafter.rows(width)
        builders = dec.row_builders(group.drafters)
        run = Engine(dec.target, group, builders, ids_list, outs, max_new_tokens, _rules(dec, sampling), dec.room)
        run.run()
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
    for i, out in enumerate(outs):
        out.text = dec.text_of(out.token_ids, ids_list[i])
    return outs


def _rules(dec: Decoder, s: dict[str, Any]) -> Any:
    """The acceptance rule of prompt i when it takes a row with ``builder``: its sampling settings
    (seed + i), told to the builder (``TreeBuilder.start``)."""

    def rule_for(i: int, builder: TreeBuilder) -> step.AcceptRule:
        seed = None if s.get("seed") is None else inputs.seed_value(s["seed"]) + i
        rule = s.get("rule", "auto")
        params, draft = dec.sampling(
            s.get("temperature"), s.get("top_p"), s.get("top_k"), seed, s.get("draft_temperature"), rule, builder
        )
        builder.start(draft)
        return step.greedy if params is None else step.sampling_rule(params, draft.generator, rule)

    return rule_for


def check_batch_settings(stream: Any) -> None:
    if stream is not None:
        raise ConfigError("stream is for one prompt: decode a batch without stream, or stream prompts one at a time")
