"""How often does tree verification part from the target's own greedy generate, per dtype?

    .venv/bin/python examples/dtype_probe.py bfloat16 8

For the small pair (`treespec-py` + its draft) on the first N HumanEval prompts, 64 new tokens, three
builders: the number of prompts whose output differs from `generate(do_sample=False)` in the same dtype,
and where it first differs. docs/reliability.md ("Dtypes, exactly") quotes its output.
"""

import sys

import treespec
from treespec.bench.datasets import load_prompts

dtype, n = sys.argv[1], int(sys.argv[2])
items = load_prompts("humaneval")[:n]
for builder, opts in [("opt-tree", {"nodes": 25}), ("chain", {}), ("static", {})]:
    dec = treespec.Decoder(
        "treespec-py", drafter="treespec-py-draft", builder=builder, builder_options=opts, dtype=dtype
    )
    model, tok = dec.target.model, dec.target.tokenizer
    first = []
    for item in items:
        ids = tok(item.turns[0], return_tensors="pt").input_ids
        want = model.generate(ids, do_sample=False, max_new_tokens=64, pad_token_id=0)[0, ids.shape[1] :].tolist()
        got = dec.generate(item.turns[0], max_new_tokens=64).token_ids
        m = min(len(want), len(got))
        if want[:m] != got[:m]:
            first.append(next(i for i in range(m) if want[i] != got[i]))
    print(
        f"{dtype:9s} {builder:9s} {len(first)}/{len(items)} prompts differ; first difference at new token {first}",
        flush=True,
    )
