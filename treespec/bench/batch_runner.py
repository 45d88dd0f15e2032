"""`treespec bench --batch-size 1,4,8,16`: throughput of batched tree decoding against Hugging Face's
batched greedy ``generate`` (left-padded), at every batch size, on the same prompts.

For each batch size B the prompts are cut into batches of B (in order; the last may be smaller). For
each batch every configuration runs once, interleaved (the order rotates batch by batch), and is timed
end to end; throughput = new tokens of all rows / seconds. Before the timed runs of a batch size, every
configuration decodes one untimed batch of that size (8 tokens): one-off costs — the allocator growing, ``opt-tree
nodes=auto`` measuring its batched cost curves for that size (``cost_measure.quick``) — are paid there, once per
process as in a server, and reported per row (``warmup_seconds``). Every treespec configuration also runs as
``… | refill``: all prompts in one ``generate(prompts, batch_size=B)`` call, at most B rows in flight
and a finished row's place given to the next prompt (continuous batching; Hugging Face's ``generate``
has no such mode: its rows of a batch start and stop together), right after that B's batches. Every row is compared token for token
with its prompt's own greedy ``generate`` (batch of one: the hf-greedy runs at B = 1, else computed after the first B): treespec rows must equal it;
Hugging Face's batched rows are reported as they come (left padding changes a row's arithmetic, so a
near-tie can flip). Memory: the process's resident set after each batch (peak per B, and its growth
from the first to the last batch of that B).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from treespec import threads
from treespec.bench import paired
from treespec.bench.baselines import count_and_follow
from treespec.factory import make_drafter, resolve_drafter_name
from treespec.files import savefig_atomic
from treespec.options import parse_spec
from treespec.target import TargetModel


def rss_mb() -> float:
    """Resident set size of this process, in MiB (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class BatchRun:
    tokens: int
    seconds: float
    forwards: int  # the target model's forward calls (prefills included)
    outputs: list[list[int]]
    rss: float
    nodes: int = 0  # drafted nodes verified, summed over every row's steps (treespec)
    row_steps: int = 0  # every row's steps, summed


@dataclass
class BatchConfig:
    label: str
    kind: str  # "hf-greedy" | "treespec" | "treespec-refill"
    run: Callable[..., BatchRun] = field(repr=False)  # (prompts, max_new) or, refill: (prompts, max_new, B)


class BatchBench:
    def __init__(
        self,
        target: str,
        drafters: list[str],
        builders: list[str],
        sizes: list[int],
        max_new_tokens: int = 128,
        device: str | None = None,
        dtype: str | None = None,
        placement: dict[str, Any] | None = None,
    ):
        self.sizes, self.max_new = sizes, max_new_tokens
        self.target = TargetModel.load(target, device=device, dtype=dtype, **(placement or {}))
        self.target_name = target
        self.configs = [BatchConfig("hf-greedy", "hf-greedy", self._hf)]
        for spec in drafters:
            for d_name, d_opts in parse_spec(spec):
                name, opts = resolve_drafter_name(d_name, d_opts)
                for b_name, b_opts in (v for s in builders for v in parse_spec(s)):
                    label = (
                        " ".join([b_name, *(f"{k}={v}" for k, v in b_opts.items())])
                        + " | "
                        + " ".join([d_name, *(f"{k}={v}" for k, v in d_opts.items())])
                    )
                    self.configs.append(BatchConfig(label, "treespec", self._treespec(name, opts, b_name, b_opts)))
        self.refills = [
            BatchConfig(c.label + " | refill", "treespec-refill", c.run) for c in self.configs if c.kind == "treespec"
        ]

    def _treespec(self, name: str, opts: dict[str, Any], b_name: str, b_opts: dict[str, Any]) -> Callable:
        from treespec.decoder import Decoder

        dec = Decoder(
            self.target, drafter=make_drafter(name, opts, self.target), builder=b_name, builder_options=b_opts
        )

        def run(prompts: list[list[int]], max_new: int, rows: int | None = None) -> BatchRun:
            before = self.target.forwards  # the model's forwards and the lean ones (treespec.lean)
            t = time.perf_counter()
            outs = dec.generate(prompts, max_new_tokens=max_new, batch_size=rows)
            seconds = time.perf_counter() - t
            steps = [st for o in outs for st in o.stats.steps]
            return BatchRun(
                sum(len(o.token_ids) for o in outs),
                seconds,
                self.target.forwards - before,
                [o.token_ids for o in outs],
                rss_mb(),
                sum(st.tree_size for st in steps),
                len(steps),
            )

        return run

    def _hf(self, prompts: list[list[int]], max_new: int) -> BatchRun:
        model, dev = self.target.model, self.target.device
        eos = self.target.eos_token_ids
        pad = next(iter(eos), 0)
        ids, att = left_pad(prompts, pad)
        calls = [0]
        hook = model.register_forward_pre_hook(lambda *_: count_and_follow(calls))
        try:
            t = time.perf_counter()
            with torch.inference_mode(), threads.following():  # as treespec's rows do
                gen = model.generate(
                    ids.to(dev), attention_mask=att.to(dev), do_sample=False, max_new_tokens=max_new, pad_token_id=pad
                )[:, ids.shape[1] :].cpu()
            seconds = time.perf_counter() - t
        finally:
            hook.remove()
        outs = []
        for row in gen.tolist():
            stop = next((i for i, tok in enumerate(row) if tok in eos), None)
            outs.append(row[: stop + 1] if stop is not None else row)
        return BatchRun(sum(len(o) for o in outs), seconds, calls[0], outs, rss_mb())

    def run(
        self,
        prompts: list[list[int]],
        progress: Callable[[str], None] = lambda _: None,
        on_rows: Callable[[list[dict[str, Any]]], None] = lambda _: None,
    ) -> list[dict[str, Any]]:
        """Every configuration at every batch size; returns the rows of results.json. ``on_rows(rows so
        far)`` is called when a batch size is done (its rows are complete), e.g. to save partial results."""
        rows: list[dict[str, Any]] = []
        self.warmup: dict[tuple[str, int], float] = {}  # seconds of each configuration's untimed warm-up batch
        reference: list[list[int]] | None = None  # each prompt's own greedy output
        n = 0
        for b in self.sizes:
            runs: dict[str, list[tuple[int, BatchRun]]] = {c.label: [] for c in self.configs}
            for c in self.configs:  # warm-up at this batch size, untimed: one-off costs (auto's quick cost
                # measurement at size b, allocator growth) are paid here, once per process, as in a server
                t = time.perf_counter()
                c.run(prompts[: min(b, len(prompts))], min(8, self.max_new))
                self.warmup[(c.label, b)] = time.perf_counter() - t
            for start in range(0, len(prompts), b):
                chunk = prompts[start : start + b]
                order = self.configs[n % len(self.configs) :] + self.configs[: n % len(self.configs)]
                n += 1
                for c in order:
                    runs[c.label].append((start, c.run(chunk, self.max_new)))
                    progress(f"B={b} {c.label[:40]}")
            for c in self.refills:  # every prompt in one call, B rows in flight
                runs[c.label] = [(0, c.run(prompts, self.max_new, b))]
                progress(f"B={b} {c.label[:40]}")
            if reference is None:  # the hf-greedy row at B = 1 ran exactly that
                reference = (
                    [o for _, r in runs["hf-greedy"] for o in r.outputs]
                    if b == 1
                    else [self._hf([p], self.max_new).outputs[0] for p in prompts]
                )
                progress("references")
            rows += self._rows(b, runs, reference)
            on_rows(rows)
        return rows

    def _rows(
        self, b: int, runs: dict[str, list[tuple[int, BatchRun]]], reference: list[list[int]]
    ) -> list[dict[str, Any]]:
        """The rows of batch size ``b``: every configuration's totals, exactness against ``reference``
        and speed against Hugging Face's batched greedy at the same size."""
        rows = []
        for c in self.configs + self.refills:
            got = runs[c.label]
            outs = [o for start, r in got for o in r.outputs]
            tokens, seconds = sum(r.tokens for _, r in got), sum(r.seconds for _, r in got)
            mism = sum(o != ref for o, ref in zip(outs, reference))
            rows.append(
                {
                    "config": c.label,
                    "kind": c.kind,
                    "batch_size": b,
                    "new_tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds if seconds else None,
                    "forwards": sum(r.forwards for _, r in got),
                    "mismatches": mism,
                    "lossless": mism == 0,
                    "nodes_per_row_step": (
                        sum(r.nodes for _, r in got) / sum(r.row_steps for _, r in got)
                        if sum(r.row_steps for _, r in got)
                        else None
                    ),
                    "peak_rss_mb": max(r.rss for _, r in got),
                    "rss_growth_mb": got[-1][1].rss - got[0][1].rss,
                    "warmup_seconds": self.warmup.get((c.label.removesuffix(" | refill"), b)),
                    # per batch of b prompts, run back to back with the other rows' (refill: one run)
                    "per_batch": [[r.tokens, r.seconds] for _, r in got],
                }
            )
        hf = next(r for r in rows if r["kind"] == "hf-greedy")
        for row in rows:
            row["vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"] if hf["tokens_per_s"] else None
            paired_runs = len(row["per_batch"]) == len(hf["per_batch"])  # a refill row is one run: no pairs
            row["vs_hf_interval"] = paired.interval(row["per_batch"], hf["per_batch"]) if paired_runs else None
        return rows


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per batch size with a planning row (``nodes=auto``): its rate over the best fixed row of the same
    kind (batches, or refilled), with the paired interval and issue 28's within-5% verdict where the rows
    ran batch by batch (a refill row is one run: ratio only)."""
    lines = []
    for r in (r for r in rows if r["kind"].startswith("treespec") and "nodes=auto" in r["config"]):
        fixed = [
            o
            for o in rows
            if o["batch_size"] == r["batch_size"] and o["kind"] == r["kind"] and o is not r and o["tokens_per_s"]
        ]
        best = max(fixed, key=lambda o: o["tokens_per_s"], default=None)
        if best is None or not r["tokens_per_s"]:
            continue
        line = f"- B={r['batch_size']} {r['config']}: {r['tokens_per_s'] / best['tokens_per_s']:.2f}× {best['config']}"
        if r["kind"] == "treespec" and "per_batch" in r:
            bounds = paired.interval(r["per_batch"], best["per_batch"])
            if bounds is not None:
                line += f" (95% interval {paired.span(bounds)})"
            line += f"; within {1 - paired.NEAR_BEST:.0%}: {paired.verdict(bounds, paired.NEAR_BEST)}"
        lines.append(line)
    return lines


def markdown_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The throughput table of a batch run (report.markdown)."""
    out = [
        "| config | batch | tokens/s | × HF batched greedy | target forwards | drafted nodes per row-step | "
        "lossless vs own greedy | peak RSS MiB | RSS growth MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cell = r["config"].replace("|", "\\|")
        same = "yes" if r["lossless"] else "no ({} rows differ)".format(r["mismatches"])
        nodes = f"{r['nodes_per_row_step']:.1f}" if r.get("nodes_per_row_step") is not None else "—"
        out.append(
            f"| {cell} | {r['batch_size']} | {r['tokens_per_s']:.0f} | {paired.cell(r['vs_hf'], r.get('vs_hf_interval'))} | {r['forwards']} | {nodes} | "
            f"{same} | {r['peak_rss_mb']:.0f} | {r['rss_growth_mb']:+.0f} |"
        )
    return out


def plot(out: Any, rows: list[dict[str, Any]]) -> Any:
    """tokens/s against batch size, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if r["config"] == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label[:50])
    ax.set_xlabel("batch size")
    ax.set_ylabel("new tokens / s (all rows)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path = out / "throughput_vs_batch.png"
    fig.tight_layout()
    savefig_atomic(fig, path, "--out", dpi=110)
    plt.close(fig)
    return path


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's batch layout: ids [B, W] left-padded with ``pad``, attention mask [B, W] (1 = token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, W]
    att = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, W]
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        att[r, width - len(p) :] = 1
    return ids, att
