"""How many of its draft tokens an EAGLE head should draft over, on this machine: one row per cut.

    python examples/draft_vocab_cut.py --target smollm2 --dataset mt-bench --start 2 --every 5 --limit 16 --cuts 8192,4096,2048

A head trained with ``treespec train eagle --draft-vocab N`` drafts over the N tokens its target says
most often (``plugins/draft_vocab.py``); the drafter's ``vocab=M`` keeps the first M of them, a cheaper
output layer for every draft call, at the cost of the steps whose token is outside. This decodes each
prompt with the target's default configuration once per cut (``eagle.vocab=M`` in the composition;
each cut a Decoder of its own, whose planner learns on its own) and with Hugging Face's
``generate(do_sample=False)``, back to back in an order that alternates from prompt to prompt, every
treespec row checked token for token, and prints the table of ``ab_rows.compare``: tokens/s, τ, the
share of plain steps, and each row over the others with 95% intervals paired by prompt.
"""

from __future__ import annotations

from ab_rows import compare, setup

import treespec


def main() -> None:
    args, target, drafter, items = setup(limit=16, extra=lambda ap: ap.add_argument("--cuts", default="8192,4096"))
    cuts = [int(c) for c in args.cuts.split(",")]
    part = "eagle." if "+" in drafter else ""  # in a composition the option names its part

    def row(cut: int):
        dec = treespec.Decoder(
            target,
            drafter=drafter,
            drafter_options={f"{part}vocab": cut},
            builder="opt-tree",
            builder_options={"nodes": "auto"},
        )
        return lambda ids: dec.generate(ids, max_new_tokens=args.max_new_tokens)

    compare(target, items, {f"vocab={cut}": row(cut) for cut in cuts}, args.max_new_tokens)


if __name__ == "__main__":
    main()
