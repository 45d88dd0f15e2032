"""What the lean target forward (``treespec.lean.lean_target``) changes in a decode, on this machine.

    python examples/lean_target.py --target smollm2 --dataset mt-bench --limit 16 --max-new-tokens 256

Three rows per prompt, back to back in an order that alternates from prompt to prompt: treespec's
default configuration for the target with trees verified by the lean forward, the same with the model's
own forward (``TREESPEC_LEAN_TARGET=off``), and Hugging Face's ``generate(do_sample=False)``. Every
treespec row is checked token for token against ``generate``. Prints a Markdown table (``ab_rows.compare``): tokens/s, τ,
and each row over the others with 95% intervals paired by prompt (``treespec.bench.paired``).
"""

from __future__ import annotations

import os

from ab_rows import compare, setup

import treespec
from treespec.bench.datasets import format_turns


def main() -> None:
    args, target, drafter, items = setup(limit=16)
    dec = treespec.Decoder(target, drafter=drafter, builder="opt-tree", builder_options={"nodes": "auto"})
    dec.generate(format_turns(target.tokenizer, items[0], []), max_new_tokens=8)  # warm: verdicts, costs

    def forward(setting: str):  # the same Decoder, trees verified by the lean forward or the model's own
        def run(ids: list[int]):
            os.environ["TREESPEC_LEAN_TARGET"] = setting
            return dec.generate(ids, max_new_tokens=args.max_new_tokens)

        return run

    compare(target, items, {"lean": forward("auto"), "model's forward": forward("off")}, args.max_new_tokens)


if __name__ == "__main__":
    main()
