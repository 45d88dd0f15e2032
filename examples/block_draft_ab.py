"""A step's drafting time with the block drafter of this checkout against the one of an earlier commit.

    python examples/block_draft_ab.py --rev 5f09002 --target treespec-py --prompts 20 --reps 6

Both drafters decode the same HumanEval prompts with a chain of ``--k`` on the same target, interleaved
rep by rep (a change in the machine's load hits both alike); the time inside the chain builder's
``build`` (the block forward, the context projection, the proposals and the tree) is divided by the
steps, and the medians printed. The earlier drafter is ``plugins/block.py`` and
``plugins/block_head.py`` at ``--rev`` (``git show``), loaded from a temporary folder. Both decodes are
checked equal token for token (both are lossless; the tests compare them with ``generate``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from treespec import Decoder
from treespec.bench.datasets import format_turns, load_prompts
from treespec.plugins import chain
from treespec.plugins.configs import BlockConfig

ROOT = Path(__file__).resolve().parents[1]


def old_drafter(rev: str, folder: Path) -> type:
    """The BlockDrafter class of commit ``rev``, its head module imported beside it."""
    for name in ("block_head", "block"):
        text = subprocess.run(
            ["git", "show", f"{rev}:plugins/{name}.py"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        text = text.replace("from treespec.plugins.block_head import", "from old_block_head import")
        (folder / f"old_{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("old_block", folder / "old_block.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.BlockDrafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the earlier commit")
    ap.add_argument("--target", default="treespec-py")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spent = [0.0]
    build = chain.ChainBuilder.build

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = build(self, *a, **kw)
        spent[0] += time.perf_counter() - t
        return out

    chain.ChainBuilder.build = timed
    new = Decoder(args.target, drafter="block", builder="chain", builder_options={"k": args.k})
    with tempfile.TemporaryDirectory() as folder:
        old_cls = old_drafter(args.rev, Path(folder))
        decoders = {
            "this checkout": new,
            args.rev: Decoder(
                new.target, drafter=old_cls(BlockConfig(), new.target), builder="chain", builder_options={"k": args.k}
            ),
        }
        prompts = [format_turns(new.target.tokenizer, item, []) for item in load_prompts("humaneval")[: args.prompts]]
        for dec in decoders.values():
            dec.generate(prompts[0], max_new_tokens=16)  # warm-up
        ms = {name: [] for name in decoders}
        for _ in range(args.reps):
            outputs = []
            for name, dec in decoders.items():
                spent[0], steps, ids = 0.0, 0, []
                for p in prompts:
                    out = dec.generate(p, max_new_tokens=args.max_new_tokens)
                    steps, ids = steps + len(out.stats.steps), ids + [out.token_ids]
                ms[name].append(spent[0] / steps * 1e3)
                outputs.append(ids)
            assert all(o == outputs[0] for o in outputs), "the two drafters decoded different tokens"
    print(f"| drafter | drafting ms a step, median of {args.reps} | each rep |\n|---|---|---|")
    for name, values in ms.items():
        print(f"| {name} | {statistics.median(values):.2f} | {' '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
