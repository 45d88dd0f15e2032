"""`treespec bench`: τ, speed and exactness of treespec configurations and Hugging Face baselines,
on the same prompts, interleaved prompt by prompt so that machine drift hits every configuration alike.

A configuration spec is ``"NAME key=v1,v2 key2=v"``: options separated by spaces, and a comma list
sweeps that option (the cartesian product of all sweeps becomes one configuration each).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from treespec import threads
from treespec.bench import paired, planning
from treespec.bench.baselines import (
    ASSISTED_KEYS,
    BASELINES,
    LOOKUP_DEFAULTS,
    assistant_settings,
    assisted_for,
    count_and_follow,
    whole,
)
from treespec.bench.datasets import PromptItem, format_turns
from treespec.errors import ConfigError
from treespec.factory import make_builder, make_drafter, resolve_drafter_name
from treespec.options import parse_spec
from treespec.target import TargetModel


def _label(name: str, options: dict[str, Any]) -> str:
    return " ".join([name, *(f"{k}={v}" for k, v in options.items())])


@dataclass
class Config:
    """One row of the table."""

    label: str
    kind: str  # "treespec" | "hf-greedy" | "hf-assisted" | "hf-lookup"
    builder: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # builder options, or the baseline's settings
    drafter: str | None = None  # drafter label
    drafter_options: dict[str, Any] = field(default_factory=dict)
    run: Callable[[list[int], int, int], Sample] | None = field(default=None, repr=False)  # (ids, max_new, seed)


@dataclass
class Sample:
    """One configuration on one prompt."""

    token_ids: list[int]
    seconds: float
    forwards: int  # target forwards that produced tokens (treespec: steps; HF: generate's forward calls)
    steps: list[dict[str, Any]] = field(default_factory=list)  # treespec per-step statistics


class Bench:
    def __init__(
        self,
        target: str,
        drafters: list[str],
        builders: list[str],
        baselines: list[str],
        max_new_tokens: int = 128,
        device: str | None = None,
        dtype: str | None = None,
        sampling: dict[str, Any] | None = None,
        seed: int = 0,
        placement: dict[str, Any] | None = None,
        rules: list[str] | None = None,
        pairs: list[tuple[str, str]] | None = None,
    ):
        """``pairs``: (builder spec, drafter spec) configurations run besides every drafter × builder.
        ``sampling``: None for greedy decoding, else ``{"temperature": t, "top_p": p, "top_k": k}``
        (t > 0) for every configuration: treespec samples exactly, the Hugging Face rows call
        ``generate(do_sample=True, ...)``; prompt n runs with seed ``seed + n`` in every row. Under
        sampling the reference row is ``hf-sample`` and outputs are not compared token for token
        (exactness in distribution is what tests/test_sampling_*.py check). ``rules``: under sampling,
        every treespec configuration once per verification rule (docs/sampling.md), labelled ``| rule=R``."""
        self.max_new = max_new_tokens
        self.rules = rules or [None]
        self.sampling = dict(sampling) if sampling and sampling.get("temperature") else None
        if self.sampling is not None:
            from treespec.sampling import SamplingParams

            SamplingParams(**self.sampling)  # one-line errors for bad settings
        self.seed = seed
        self.reference = "hf-greedy" if self.sampling is None else "hf-sample"
        self.target = TargetModel.load(target, device=device, dtype=dtype, **(placement or {}))  # device_map, ...
        self.target_name = target
        self.configs: list[Config] = [Config(self.reference, "hf-greedy", run=self._hf_runner({}))]
        hf_drafts = self._add_treespec(drafters, builders, pairs or [])
        self._add_baselines(baselines, hf_drafts)

    def _add_treespec(
        self, drafters: list[str], builders: list[str], pairs: list[tuple[str, str]]
    ) -> list[tuple[Any, str, Any]]:
        """One configuration per (builder variant, drafter variant), then per variant of each pair;
        returns the draft models seen, ``((model, layers), drafter label, HF model)``, for the
        assisted-generation baseline."""
        hf_drafts: list[tuple[Any, str, Any]] = []
        every = [v for spec in builders for v in parse_spec(spec)]
        jobs = [(spec, every) for spec in drafters] + [(d, parse_spec(b)) for b, d in pairs]
        for spec, builder_variants in jobs:
            for d_name, d_opts in parse_spec(spec):
                name, opts = resolve_drafter_name(d_name, d_opts)
                drafter = make_drafter(name, opts, self.target)
                short = Path(opts["model"]).name if name == "model" else name
                if name == "compose":  # a+b: the parts' short names
                    short = "+".join(Path(p).name for p in drafter.config.parts)
                d_label = _label(short, {k: v for k, v in opts.items() if k not in ("model", "parts")})
                if (
                    getattr(drafter, "model", None) is not None
                    and name == "model"
                    and (opts["model"], opts.get("layers")) not in {key for key, _, _ in hf_drafts}
                ):
                    hf_drafts.append(((opts["model"], opts.get("layers")), d_label, drafter.model))  # once per model
                for b_name, b_opts in builder_variants:
                    for rule in self.rules:
                        builder = make_builder(b_name, b_opts)
                        options = dict(builder.config) | ({"rule": rule} if rule else {})
                        self.configs.append(
                            Config(
                                f"{_label(b_name, b_opts)} | {d_label}" + (f" | rule={rule}" if rule else ""),
                                "treespec",
                                b_name,
                                options,
                                d_label,
                                {k: v for k, v in dict(drafter.config).items() if v is not None},
                                run=self._treespec_runner(drafter, builder, rule),
                            )
                        )
        return hf_drafts

    def _add_baselines(self, baselines: list[str], hf_drafts: list[tuple[Any, str, Any]]) -> None:
        """Hugging Face's own speculative decoding: assisted generation (per draft model), prompt lookup."""
        for spec in baselines:
            for b_name, b_opts in parse_spec(spec):
                if b_name not in BASELINES:
                    raise ConfigError(f"unknown baseline {b_name!r}; baselines: {', '.join(sorted(BASELINES))}")
                if b_name == "hf-assisted":
                    unknown = set(b_opts) - ASSISTED_KEYS
                    if unknown:
                        raise ConfigError(
                            f"hf-assisted: unknown setting(s) {sorted(unknown)}; settings: {sorted(ASSISTED_KEYS)}"
                        )
                    for _, d_label, model in hf_drafts:
                        settings = assistant_settings(model, b_opts)
                        short = {
                            "num_assistant_tokens": "k",
                            "num_assistant_tokens_schedule": "schedule",
                            "assistant_confidence_threshold": "confidence",
                        }
                        name = _label("hf-assisted", {short[k]: v for k, v in b_opts.items()})
                        self.configs.append(
                            Config(
                                f"{name} | {d_label}",
                                "hf-assisted",
                                options=settings,
                                drafter=d_label,
                                run=self._hf_runner({"assistant_model": model}, model, settings),
                            )
                        )
                elif b_name == "hf-lookup":
                    unknown = set(b_opts) - set(LOOKUP_DEFAULTS)
                    if unknown:
                        raise ConfigError(
                            f"hf-lookup: unknown setting(s) {sorted(unknown)}; settings: {sorted(LOOKUP_DEFAULTS)}"
                        )
                    settings = {**LOOKUP_DEFAULTS, **{k: whole(f"hf-lookup {k}", v) for k, v in b_opts.items()}}
                    self.configs.append(
                        Config(
                            _label("hf-lookup", b_opts), "hf-lookup", options=settings, run=self._hf_runner(settings)
                        )
                    )

    # ------------------------------------------------------------------ runners
    def _treespec_runner(
        self, drafter: Any, builder: Any, rule: str | None = None
    ) -> Callable[[list[int], int], Sample]:
        from treespec.decoder import Decoder

        dec = Decoder(self.target, drafter=drafter, builder=builder)
        sampling = dict(self.sampling or {}) | ({"rule": rule} if rule else {})

        def run(ids: list[int], max_new: int, seed: int) -> Sample:
            out = dec.generate(ids, max_new_tokens=max_new, seed=seed, **sampling)
            steps = [asdict(s) for s in out.stats.steps]
            return Sample(out.token_ids, out.stats.t_total, out.stats.n_steps, steps)

        return run

    def _hf_runner(self, kwargs: dict[str, Any], assistant: Any = None, settings: dict | None = None):
        model = self.target.model
        pad = next(iter(self.target.eos_token_ids), 0)

        sampling = (
            {"do_sample": False}
            if self.sampling is None
            else {
                "do_sample": True,
                "temperature": self.sampling["temperature"],
                "top_k": self.sampling.get("top_k") or 0,
                "top_p": self.sampling.get("top_p", 1.0),
            }
        )

        def run(ids: list[int], max_new: int, seed: int) -> Sample:
            if assistant is not None:  # HF reads the assistant's settings from its generation_config
                for key, value in (settings or {}).items():
                    setattr(assistant.generation_config, key, value)
            calls = [0]
            hook = model.register_forward_pre_hook(lambda *_: count_and_follow(calls))
            try:
                x = torch.tensor([ids], device=self.target.device)
                torch.manual_seed(seed)  # Hugging Face samples from torch's global RNG
                t = time.perf_counter()
                with torch.inference_mode(), threads.following():  # as treespec's rows do
                    out = model.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        **sampling,
                        max_new_tokens=max_new,
                        pad_token_id=pad,
                        **kwargs,
                    )
                seconds = time.perf_counter() - t
            finally:
                hook.remove()
            return Sample(out[0, len(ids) :].tolist(), seconds, calls[0])

        return run

    # ------------------------------------------------------------------ the run
    def prompts_fit(self, ids: list[int]) -> list[int]:
        """Left-truncate a prompt so that prompt + max_new_tokens fits the target's context."""
        limit = self.target.max_positions
        if limit is not None and len(ids) + self.max_new > limit:
            return ids[-(limit - self.max_new) :]
        return ids

    def run(
        self,
        items: list[PromptItem],
        on_sample: Callable[[Config, int, Sample, bool], None] | None = None,
        warmup: bool = True,
        on_prompt: Callable[[dict[str, list[Sample | None]]], None] | None = None,
    ) -> dict[str, list[Sample | None]]:
        """Every configuration on every prompt (turn by turn), interleaved; returns samples per label.
        ``on_prompt(samples so far)`` is called after every prompt (e.g. to save partial results)."""
        tok = self.target.tokenizer
        prompts: list[tuple[PromptItem, int]] = [
            (it, t) for t in range(max(len(i.turns) for i in items)) for it in items if t < len(it.turns)
        ]
        self.categories = [item.category for item, _ in prompts]  # per prompt, as the samples are ordered
        samples: dict[str, list[Sample | None]] = {c.label: [] for c in self.configs}
        answers: dict[str, list[str]] = {it.id: [] for it in items}
        self.truncated = 0
        if warmup:
            first = self.prompts_fit(format_turns(tok, items[0], []))
            for c in self.configs:
                c.run(first, min(8, self.max_new), self.seed)
        for n, (item, turn) in enumerate(prompts):
            ids = format_turns(tok, item, answers[item.id][:turn])
            fitted = self.prompts_fit(ids)
            self.truncated += len(fitted) < len(ids)
            order = self.configs[n % len(self.configs) :] + self.configs[: n % len(self.configs)]
            results = {c.label: c.run(fitted, self.max_new, self.seed + n) for c in order}
            reference = results[self.reference].token_ids
            answers[item.id].append(tok.decode(reference, skip_special_tokens=True))
            for c in self.configs:
                samples[c.label].append(results[c.label])
                if on_sample:
                    same = self.sampling is not None or results[c.label].token_ids == reference  # sampled: not compared
                    on_sample(c, n, results[c.label], same)
            self.n_prompts = n + 1
            if on_prompt:
                on_prompt(samples)
        self.n_prompts = len(prompts)
        return samples

    def rows(self, samples: dict[str, list[Sample]]) -> list[dict[str, Any]]:
        ref = samples[self.reference]
        compare = self.sampling is None  # sampled outputs are not compared token for token
        per_config = {}
        for c in self.configs:
            got = samples[c.label]
            tokens = sum(len(s.token_ids) for s in got)
            seconds = sum(s.seconds for s in got)
            forwards = sum(s.forwards for s in got)
            steps = [st for s in got for st in s.steps]
            row = {
                "config": c.label,
                "builder": c.builder,
                "drafter": c.drafter,
                "options": c.options,
                "drafter_options": c.drafter_options,
                "tau": tokens / forwards if forwards else None,
                "tokens_per_s": tokens / seconds if seconds else None,
                "lossless": all(a.token_ids == b.token_ids for a, b in zip(got, ref)) if compare else None,
                "mismatches": sum(a.token_ids != b.token_ids for a, b in zip(got, ref)) if compare else None,
                "corr_ea_a": _pearson([s["expected_accepted"] for s in steps], [s["accepted"] for s in steps]),
                "steps": forwards,
                "new_tokens": tokens,
                "seconds": seconds,
                "per_prompt": [[len(s.token_ids), s.seconds] for s in got],  # paired by prompt (bench/paired.py)
            }
            if steps:
                total = sum(s["t_draft"] + s["t_verify"] + s["t_bookkeeping"] for s in steps)
                for phase in ("draft", "verify", "bookkeeping"):
                    row[f"share_{phase}"] = sum(s[f"t_{phase}"] for s in steps) / total if total else None
                row["mean_tree_size"] = statistics.mean(s["tree_size"] for s in steps)
                row["plan"] = planning.summary(steps)  # None unless the builder plans (nodes=auto)
            per_config[c.label] = row
        base = per_config[self.reference]["tokens_per_s"]
        assisted_rows = [per_config[c.label] for c in self.configs if c.kind == "hf-assisted"]
        for c in self.configs:
            row = per_config[c.label]
            row["speedup"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
            row["speedup_interval"] = paired.interval(row["per_prompt"], per_config[self.reference]["per_prompt"])
            assisted = assisted_for(row, assisted_rows)
            row["assisted_config"] = assisted["config"] if assisted else None
            row["speedup_vs_assisted"] = (
                row["tokens_per_s"] / assisted["tokens_per_s"] if assisted and row["tokens_per_s"] else None
            )
        return [per_config[c.label] for c in self.configs]


def _pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # a constant series
        return None
