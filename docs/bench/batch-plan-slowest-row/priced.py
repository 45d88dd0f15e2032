"""Judge a batch plan's depth choices without the machine's noise (issue 28; not part of the package).

    python priced.py sweep B K1,K2,... TABLE.json   # fixed chains: measured ms per target forward -> TABLE
    python priced.py price B static|refill TABLE.json [chain=K ...]   # auto's steps priced by TABLE

Greedy acceptance is deterministic, so the steps a plan takes are too, given its choices; only walls are
noisy. ``price`` runs ``opt-tree nodes=auto`` (or fixed chains) on 40 HumanEval prompts, records the
chain depth of every batch step (``BatchPlan``) and sums TABLE[depth]: the seconds those choices would
take if every step cost what a fixed chain's step of that depth measured in one sweep. ``static``: one
``generate`` per B prompts (a batch that starts together); ``refill``: all prompts, B rows in flight."""

import json
import sys
import time

import torch

import treespec
from treespec.bench.datasets import format_turns, load_prompts
from treespec.plugins import batch_budget
from treespec.target import TargetModel

torch.set_num_threads(2)
target = TargetModel.load("treespec-py")
prompts = [format_turns(target.tokenizer, it, []) for it in load_prompts("humaneval", limit=40)]


def forwards_of(run):
    calls = [0]
    hook = target.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    t = time.perf_counter()
    try:
        run()
    finally:
        hook.remove()
    return calls[0], time.perf_counter() - t


def decode(dec, b, mode):
    if mode == "static":
        for i in range(0, len(prompts), b):
            dec.generate(prompts[i : i + b], max_new_tokens=128)
    else:
        dec.generate(prompts, max_new_tokens=128, batch_size=b)


def decoder(spec):
    if spec.startswith("chain="):
        return treespec.Decoder(target, drafter="eagle", builder="chain", builder_options={"k": spec[6:]})
    return treespec.Decoder(target, drafter="eagle", builder="opt-tree", builder_options={"nodes": "auto"})


def sweep(b, ks, out):
    table = {}
    for k in ks:
        dec = decoder(f"chain={k}")
        dec.generate(prompts[:b], max_new_tokens=8)  # warm-up
        fw, seconds = forwards_of(lambda: decode(dec, b, "static"))
        table[k] = 1e3 * seconds / fw
        print(f"chain k={k}: {fw} forwards, {seconds:.2f} s, {table[k]:.2f} ms per forward", flush=True)
    json.dump(table, open(out, "w"), indent=1)


def price(b, mode, path, specs):
    table = {int(k): v for k, v in json.load(open(path)).items()}
    top = max(table)
    per_round = (table[top] - table[top - 2]) / 2
    cost = lambda d: table.get(d, table[top] + per_round * (d - top))  # noqa: E731
    depths = []
    step = batch_budget.BatchPlan._new_step

    def traced(self, planner):
        step(self, planner)
        depths.append(self.current.rounds)

    batch_budget.BatchPlan._new_step = traced
    for spec in specs or ["auto"]:
        dec = decoder(spec)
        dec.generate(prompts[:b], max_new_tokens=8)  # warm-up (auto: its cost curves at this size)
        depths.clear()
        fw, seconds = forwards_of(lambda: decode(dec, b, mode))
        priced = fw * cost(int(spec[6:])) if spec.startswith("chain=") else sum(cost(d) for d in depths)
        hist = {d: depths.count(d) for d in sorted(set(depths))} if not spec.startswith("chain=") else {}
        print(f"{mode} B={b} {spec}: priced {priced / 1e3:.2f} s, {fw} forwards, wall {seconds:.2f} s {hist}")


if __name__ == "__main__":
    what, b = sys.argv[1], int(sys.argv[2])
    if what == "sweep":
        sweep(b, [int(k) for k in sys.argv[3].split(",")], sys.argv[4])
    else:
        price(b, sys.argv[3], sys.argv[4], sys.argv[5:])
