"""Where a batched step's time goes: treespec's phases per step against Hugging Face's greedy step.

    python examples/batch_step_costs.py [--target treespec-py] [--drafter eagle] [--builder "chain k=3"]
                                        [--sizes 1,4,8,16] [--prompts 16] [--threads 2]

For each batch size B, on the first B HumanEval prompts (128 new tokens):

- Hugging Face: ``generate`` on the left-padded batch, timed for 1 and for 128 new tokens; the
  difference over 127 is its decode step (the prefill is left out);
- treespec: ``Decoder.generate(prompts)`` with the given drafter and builder; every row's step
  statistics carry the batch step's own times, so row 0's steps are the batch's: the medians of
  drafting, verification (the one target forward), bookkeeping (acceptance, cache compaction,
  the drafters' commits, statistics) and the whole step, and the tokens each row gained per step.

It prints one line per B: what one step costs each way, and the tokens per row-millisecond each way
(Hugging Face: 1 token per row per step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="treespec-py")
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--builder", default="chain k=3")
    ap.add_argument("--sizes", default="1,4,8,16")
    ap.add_argument("--prompts", type=int, default=16, help="the largest batch (the first N prompts)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from treespec.bench.batch_runner import left_pad
    from treespec.bench.datasets import load_prompts
    from treespec.decoder import Decoder
    from treespec.factory import make_drafter
    from treespec.options import parse_spec
    from treespec.target import TargetModel

    target = TargetModel.load(args.target)
    texts = [item.turns[0] for item in load_prompts("humaneval", limit=args.prompts)]
    ((b_name, b_opts),) = parse_spec(args.builder)
    dec = Decoder(target, drafter=make_drafter(args.drafter, {}, target), builder=b_name, builder_options=b_opts)
    ids = [dec.encode(t) for t in texts]
    model, pad = target.model, next(iter(target.eos_token_ids), 0)
    print(f"{args.target}, {args.drafter}, {args.builder}: medians per step (ms); rate = tokens per row per ms")
    for b in [int(s) for s in args.sizes.split(",")]:
        batch = ids[:b]
        x, att = left_pad(batch, pad)
        with torch.inference_mode():
            model.generate(x, attention_mask=att, do_sample=False, max_new_tokens=4, pad_token_id=pad)  # warm-up
            t0 = time.perf_counter()
            model.generate(x, attention_mask=att, do_sample=False, max_new_tokens=1, pad_token_id=pad)
            t1 = time.perf_counter()
            model.generate(x, attention_mask=att, do_sample=False, max_new_tokens=128, pad_token_id=pad)
            t2 = time.perf_counter()
        hf = ((t2 - t1) - (t1 - t0)) / 127
        dec.generate(batch, max_new_tokens=8)  # warm-up (and a batch's one-off cost measurement)
        outs = dec.generate(batch, max_new_tokens=128)
        steps = outs[0].stats.steps[1:]  # row 0's steps are the batch's (the first one feeds the prompts)

        def med(field: str, steps: list = steps) -> float:
            return statistics.median(getattr(s, field) for s in steps) * 1e3

        gained = statistics.mean(s.emitted for o in outs for s in o.stats.steps)
        print(
            f"B={b:>2}  HF step {hf * 1e3:5.1f} | treespec step {med('t_wall'):5.1f} = draft {med('t_draft'):4.1f}"
            f" + verify {med('t_verify'):4.1f} + bookkeeping {med('t_bookkeeping'):4.1f} (+ rest) | tokens per row-step"
            f" {gained:.2f} | rate HF {1 / (hf * 1e3):.3f}, treespec {gained / med('t_wall'):.3f}"
        )


if __name__ == "__main__":
    main()
