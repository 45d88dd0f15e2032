"""The Decoder: what a user builds (target, drafter, builder) and calls (``generate``). Its decode loop
is ``treespec.engine`` (one prompt is a batch of one row), each step ``treespec.step.step_rows``
(draft → verify → commit)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from treespec import batch, decoder_args, inputs, step
from treespec.devices import InexactDtypeWarning, dtype_note
from treespec.engine import Engine
from treespec.errors import ConfigError, DecodingError, GenerationConfigNote, Interrupted, TreespecError
from treespec.factory import make_builder, make_drafter
from treespec.generation_settings import unhonoured
from treespec.interfaces import Drafter, DraftRows, PlanningBuilder, TreeBuilder
from treespec.memory import check_fits
from treespec.output import Output, StreamCallback, step_stats  # noqa: F401 - step_stats: public here before
from treespec.sampling import DraftSampling, IgnoredOptionWarning, SamplingParams, check_sampling, make_generator
from treespec.stats import RunStats
from treespec.target import TargetModel
from treespec.tree import DraftTree
from treespec.verify import Acceptance


class Decoder:
    """Lossless tree speculative decoding of one target with one drafter and one builder.

    ``target``: a model name/path or a ``TargetModel``; ``drafter``/``builder``: a registered name
    (or for ``drafter``, a model alias / hub id / directory) with options, or an instance.
    ``device_map``/``max_memory``/``offload_folder`` split a target that does not fit one device, or
    offload it to disk (accelerate, ``pip install 'treespec[accelerate]'``); drafts go on the device
    inputs enter the target by.
    """

    def __init__(
        self,
        target: str | TargetModel | Any,
        drafter: str | Drafter | Any = "model",
        builder: str | TreeBuilder = "opt-tree",
        drafter_options: dict[str, Any] | None = None,
        builder_options: dict[str, Any] | None = None,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        device_map: str | dict | None = None,
        max_memory: str | dict | None = None,
        offload_folder: str | None = None,
        tokenizer: Any = None,
    ):
        target, drafter = decoder_args.check_arguments(
            target, drafter, builder, drafter_options, builder_options, offload_folder
        )
        if decoder_args.is_loaded_model(target):  # the user's own model, as loaded: wrapped, not moved
            placed = dict(device=device, dtype=dtype, device_map=device_map, max_memory=max_memory)
            target = decoder_args.adopt_target(target, tokenizer, placed | {"offload_folder": offload_folder})
        elif tokenizer is not None and isinstance(target, TargetModel):
            target.tokenizer = tokenizer
        self.builder = make_builder(builder, builder_options)  # cheap: fail on bad options first
        self._builder_spec = (builder, dict(builder_options or {}))  # batch rows get builders of their own
        self._row_builders: dict[int, list[TreeBuilder]] = {}  # batch size -> its rows' builders (kept across batches)
        decoder_args.require_models(target, drafter, drafter_options)  # offline: one line naming every missing model
        if not isinstance(target, TargetModel):
            target = TargetModel.load(
                target,
                device=device,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                device_map=device_map,
                max_memory=max_memory,
                offload_folder=offload_folder,
            )
        if tokenizer is not None and target.tokenizer is not tokenizer:
            target.tokenizer = tokenizer  # the user's own: text in and out through it
        self.target = target
        _warn_about(target)
        self._check_budget()
        self.drafter = make_drafter(drafter, drafter_options, self.target)
        self._attach_builder()

    def _attach_builder(self) -> None:
        """A planning builder meets its target and drafter (opt-tree nodes=auto: a quick cost measurement)."""
        try:
            if isinstance(self.builder, PlanningBuilder):
                self.builder.attach(self.target, self.drafter)  # opt-tree nodes=auto: a quick cost measurement
        except TreespecError:
            raise
        except Exception as exc:  # the drafter's or builder's own code failed while measuring
            raise ConfigError(
                f"builder {type(self.builder).__name__} could not measure step costs with drafter "
                f"{type(self.drafter).__name__} ({type(exc).__name__}: {_first_line(exc)}); that drafter fails on "
                "this target: try another drafter, or a fixed budget (e.g. builder_options={'nodes': 8})"
            ) from exc

    def row_builders(self, drafters: list[Drafter]) -> list[TreeBuilder]:
        """The builders of a batch's rows: row i of every batch of this size keeps the same builder, so
        what it learns (calibrated p̂, cost curves, its rate) carries over from batch to batch, as the
        Decoder's own builder carries over from prompt to prompt."""
        pool = self._row_builders.get(len(drafters))
        if pool is None:
            pool = [self.fresh_builder(d, batch_size=len(drafters)) for d in drafters]
            for builder in pool:
                if isinstance(builder, PlanningBuilder):
                    builder.join_batch(pool)
            self._row_builders[len(drafters)] = pool
        return pool

    def fresh_builder(self, drafter: Drafter, batch_size: int = 1) -> TreeBuilder:
        """A builder like this Decoder's, with no state, attached to ``drafter`` (a row of a batch of
        ``batch_size``)."""
        spec, options = self._builder_spec
        builder = make_builder(spec, options) if isinstance(spec, str) else _fresh_like(self.builder)
        if isinstance(builder, PlanningBuilder):
            builder.batch_size = batch_size
            builder.attach(self.target, drafter)
        return builder

    def _check_budget(self) -> None:
        """Refuse a builder whose trees the target cannot verify in one forward (issue: a budget of
        100,000 nodes drafted for minutes, then failed allocating tens of GB)."""
        nodes, limit = self.builder.max_nodes, self.target.max_tree_nodes
        if nodes is not None and nodes > limit:
            raise ConfigError(
                f"builder {type(self.builder).__name__} may draft trees of {nodes} nodes, but this target verifies at most "
                f"{limit} in one forward (its context, or half this machine's memory for the tree's mask and logits): "
                f"use a budget of at most {limit} nodes"
            )
        drafted = self.builder.max_drafted
        if drafted is not None:  # the draft tree's [N, N] ancestor matrix, grown by doubling (old and new at once)
            capacity = 1 << max(drafted, 1).bit_length()
            check_fits(
                2 * capacity * capacity,
                f"builder {type(self.builder).__name__}, which drafts up to {drafted:,} "
                "nodes per step before keeping its best,",
                "lower its top_k or depth",
            )

    def encode(self, prompt: str | list[int] | torch.Tensor) -> list[int]:
        """Token ids of a prompt: text, a list of ids or a [L] / [1, L] tensor (checked: one line of error)."""
        return inputs.token_ids(prompt, self.target.tokenizer, self.target.vocab_size)

    def prompt_ids(self, prompt: str | list[int] | torch.Tensor) -> list[int]:
        """Token ids of a prompt that leaves room for at least one new token."""
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty: give at least one token")
        limit = self.target.max_positions
        if limit is not None and len(ids) >= limit:
            raise ConfigError(
                f"the prompt has {len(ids)} tokens but the target's context is {limit}: shorten the prompt"
            )
        return ids

    def text_of(self, ids: list[int], prompt_ids: list[int] | None = None) -> str:
        """Text of ``ids``; given the prompt, as the continuation of the prompt's text (so a leading
        space that the tokenizer folds into the first new token is kept)."""
        tok = self.target.tokenizer
        if tok is None:
            return ""
        if not prompt_ids:
            return tok.decode(ids, skip_special_tokens=True)
        head = tok.decode(prompt_ids, skip_special_tokens=True)
        full = tok.decode(list(prompt_ids) + list(ids), skip_special_tokens=True)
        return full[len(head) :] if full.startswith(head) else tok.decode(ids, skip_special_tokens=True)

    def generate(
        self,
        prompt: str | list[int] | torch.Tensor | list[str] | list[list[int]] | None = None,
        max_new_tokens: int = 128,
        stream: StreamCallback | None = None,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        draft_temperature: float | None = None,
        rule: str = "auto",
        batch_size: int | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        do_sample: bool | None = None,
        **unknown: Any,
    ) -> Output:
        """Decode. With ``temperature`` None or 0 (the default): greedily, and the output equals the
        target's own greedy decoding, token for token. With ``temperature > 0``: speculative sampling,
        and the output is distributed exactly as the target's own ``generate(do_sample=True,
        temperature=, top_k=, top_p=)`` (top_k None/0 and top_p None/1 are off; docs/sampling.md).

        ``seed`` makes a sampled run reproducible (without it the seed comes from torch's global RNG);
        ``draft_temperature`` (default: ``temperature``) is the draft's temperature for builders that
        draw children at random (``sample=true``); ``rule`` picks the verification rule:
        ``auto`` | ``specinfer`` | ``deterministic`` | ``target-only`` | ``block`` | ``traversal``.

        A list of prompts (texts or lists of ids) decodes them as one batch (``treespec.batch``): one
        target forward verifies every row's tree each step; returns a list of ``Output``, one per prompt.
        ``batch_size`` B keeps at most B rows in flight: when a row finishes, the next prompt takes its
        place (continuous batching); by default every prompt is a row from the start.

        As Hugging Face users call ``generate``: ``input_ids`` ([L], [1, L], or [B, L] for B rows) with
        its ``attention_mask`` (padding, left or right, is dropped), e.g. ``generate(**tokenizer(text,
        return_tensors="pt"))``; ``do_sample=True`` samples (at temperature 1 unless given), False is greedy.

        Calls on one Decoder are serialised: a second thread's call waits for the first to finish
        (the target's and the drafter's caches are per Decoder). Bad arguments raise ``ConfigError``;
        a failure while decoding raises ``DecodingError`` with everything generated so far in ``.output``,
        Ctrl-C ``Interrupted`` (a ``DecodingError``); for a list of prompts ``.outputs`` holds every
        prompt's output (finished, partial, not started).
        """
        decoder_args.refuse_unknown(unknown)
        prompt = decoder_args.hf_prompt(prompt, input_ids, attention_mask)
        temperature = decoder_args.sample_or_not(do_sample, temperature)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)  # ``self.sampling``'s arguments
        sampling.update(draft_temperature=draft_temperature, rule=rule)
        if batch.is_batch(prompt):
            batch.check_batch_settings(stream)
            if seed is not None:
                inputs.seed_value(seed)  # before any row starts (a row's seed + i would fail mid-batch)
            with self._exclusive():
                return batch.generate_batch(self, list(prompt), max_new_tokens, sampling, batch_size)
        if batch_size is not None:
            raise ConfigError("batch_size is for a list of prompts: pass [prompt, ...], or leave batch_size out")
        with self._exclusive():
            return self._generate(prompt, max_new_tokens, stream, sampling)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One decode at a time per target (the target's KV cache, and the drafter bound to it, hold one
        sequence): other threads wait, also those of other Decoders on the same TargetModel; a call
        from inside a running decode on the same thread (e.g. from its ``stream`` callback) is refused."""
        with self.target.exclusive():
            yield

    def _generate(
        self,
        prompt: str | list[int] | torch.Tensor,
        max_new_tokens: int,
        stream: StreamCallback | None,
        sampling: dict[str, Any],
    ) -> Output:
        """One prompt; ``sampling``: ``generate``'s sampling arguments, by the names ``self.sampling`` takes."""
        ids = self.prompt_ids(prompt)
        max_new_tokens = inputs.positive_int("max_new_tokens", max_new_tokens)
        if stream is not None and not callable(stream):
            raise ConfigError(f"stream must be a callable taking a list of token ids, got {type(stream).__name__}")
        params, draft = self.sampling(**sampling)
        accept = step.greedy if params is None else step.sampling_rule(params, draft.generator, sampling["rule"])
        out = Output(token_ids=[], text="", prompt_ids=ids, stats=RunStats(prompt_tokens=len(ids)))
        self.builder.start(draft)
        try:  # the one decode loop, with one row: this Decoder's own drafter and builder
            rows = DraftRows([self.drafter])
            Engine(
                self.target, rows, [self.builder], [ids], [out], max_new_tokens, lambda i, b: accept, self.room, stream
            ).run()
        except KeyboardInterrupt:  # Ctrl-C: keep what was generated
            out.stats.stop_reason = "interrupted"
            out.text = self.text_of(out.token_ids, ids)
            raise Interrupted(f"interrupted after {len(out.token_ids)} new tokens", out) from None
        except Exception as exc:
            out.stats.stop_reason = "error"
            out.text = self.text_of(out.token_ids, ids)
            reason = str(exc) if isinstance(exc, TreespecError) else f"{type(exc).__name__}: {exc}"
            raise DecodingError(f"decoding stopped after {len(out.token_ids)} new tokens: {reason}", out) from exc
        out.text = self.text_of(out.token_ids, ids)
        return out

    def sampling(
        self,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        draft_temperature: float | None,
        rule: str,
        builder: TreeBuilder | None = None,
    ) -> tuple[SamplingParams | None, DraftSampling | None]:
        """The target's sampling settings and the draft side's (None, None: greedy), checked by
        ``sampling.check_sampling``; options greedy decoding ignores are one warning each."""
        builder = builder or self.builder
        params, notes = check_sampling(temperature, top_p, top_k, draft_temperature, rule, builder.samples_children)
        for note in notes:
            warnings.warn(note, IgnoredOptionWarning, stacklevel=4)
        if params is None:
            return None, None
        has_dist = self.drafter.provides_probabilities and type(self.drafter).distribution is not Drafter.distribution
        if not has_dist and (rule == "specinfer" or builder.samples_children):
            what = "rule specinfer" if rule == "specinfer" else f"builder {type(builder).__name__} with sample=true"
            raise ConfigError(
                f"{what} needs the draft's full distribution, which drafter {type(self.drafter).__name__} does not "
                "provide: use a model/self drafter, or the deterministic rule (the default) with ranked children"
            )
        generator = make_generator(seed, self.target.device)
        draft_t = float(draft_temperature) if draft_temperature is not None else params.temperature
        return params, DraftSampling(temperature=draft_t, generator=generator)

    def draft_and_verify(self, prompt: str | list[int] | torch.Tensor) -> tuple[list[int], DraftTree, Acceptance]:
        """One greedy step for inspection (``treespec tree show``): prefill the prompt, build the first
        tree and verify it, without committing. Returns the prompt ids, the tree and what the target accepts."""
        with self._exclusive():
            ids = self.prompt_ids(prompt)
            self.builder.start(None)  # greedy: ranked children
            step.prefill(self.target, self.drafter, ids)
            done = step.step(self.target, self.drafter, self.builder, ids[-1], self.room(ids, 1 << 30), keep=False)
            return ids, done.tree, done.acceptance

    def room(self, committed: list[int], wanted: int) -> int:
        """New tokens the next step may emit: ``wanted``, capped by the target's context."""
        limit = self.target.max_positions
        return wanted if limit is None else min(wanted, limit - len(committed))


def _warn_about(target: TargetModel) -> None:
    """One warning each: a dtype whose greedy decoding is not exactly reproducible by trees, and the
    settings of the model's generation_config that treespec does not apply (the Decoder's caller's line)."""
    note = dtype_note(target.dtype)
    if note is not None:
        warnings.warn(note, InexactDtypeWarning, stacklevel=3)
    unapplied = unhonoured(getattr(target.model, "generation_config", None))
    if unapplied:
        warnings.warn(
            f"{target.name}'s generation_config sets {', '.join(unapplied)}, which treespec does not apply: its "
            "output is the model's own greedy (or sampled) decoding without them",
            GenerationConfigNote,
            stacklevel=3,
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def _fresh_like(builder: TreeBuilder) -> TreeBuilder:
    """A new builder of ``builder``'s class from its Config (how every plugin is built), so batch rows
    share no state (a shallow copy shared one cost planner and one calibration map among all rows);
    a builder that cannot be rebuilt from its Config is deep-copied."""
    import copy

    try:
        return type(builder)(builder.config)
    except Exception:  # noqa: BLE001 - a third-party builder with another constructor
        return copy.deepcopy(builder)
