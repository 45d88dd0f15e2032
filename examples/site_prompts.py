"""Function prompts cut from installed packages: the third stage of the default pair's block drafter.

    python examples/site_prompts.py --head more-prompts.jsonl --out site-prompts.jsonl \
        --ids docs/training/block-site-ids.txt

The first ``--held-out`` lines of ``--head`` (the 300 the earlier stages held out, so the held-out
numbers stay comparable) come first. Then come ``--limit`` prompts (a signature and its docstring,
``treespec.train.code_prompts.function_prompts``), a random sample drawn with ``--seed`` from the
``*.py`` files of the ``--packages`` installed beside this Python (folders named ``test`` or ``tests``
skipped; ``numpy/testing`` and the like are kept). With ``--ids`` the prompts are the ones that file
names (``package/path.py:line`` a line, in its order): the shipped run's sample, rebuilt from the same
package versions (the file's header lists them). An id not found is reported, never filled in. Only
ids are kept in the repository: the prompts' text belongs to those packages.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from importlib import metadata
from pathlib import Path

from treespec.train.code_prompts import function_prompts

PACKAGES = (
    "transformers",
    "sympy",
    "networkx",
    "numpy",
    "pydantic",
    "rich",
    "hypothesis",
    "jinja2",
    "pygments",
    "typer",
)


def package_prompts(packages: list[str]) -> list[dict[str, str]]:
    """Every prompt of the packages' source files, in sorted path order."""
    site = Path(sysconfig.get_paths()["purelib"])
    out = []
    for name in packages:
        if not (site / name).is_dir():
            raise SystemExit(f"package {name!r} is not installed in {site}: install it or leave it out of --packages")
        for path in sorted((site / name).rglob("*.py")):
            rel = path.relative_to(site).as_posix()
            if {"test", "tests"} & set(rel.split("/")):
                continue
            try:
                out.extend(function_prompts(rel, path.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, required=True, help="the earlier stages' prompts file")
    ap.add_argument("--held-out", type=int, default=300, help="its first lines to keep (the held-out ones)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--packages", default=",".join(PACKAGES))
    ap.add_argument("--limit", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ids", type=Path, help="rebuild the sample this file names")
    ap.add_argument("--write-ids", type=Path, help="write the sample's ids (and the package versions) here")
    args = ap.parse_args()
    packages = args.packages.split(",")
    prompts = package_prompts(packages)
    if args.ids:
        wanted = [line.strip() for line in args.ids.read_text().splitlines() if line.strip() and line[0] != "#"]
        by_id = {p["id"]: p for p in prompts}
        missing = [i for i in wanted if i not in by_id]
        if missing:
            raise SystemExit(
                f"{len(missing)} of {len(wanted)} ids not in these packages (first: {missing[0]}): other versions"
            )
        sample = [by_id[i] for i in wanted]
    else:
        sample = random.Random(args.seed).sample(prompts, min(args.limit, len(prompts)))
    head = args.head.read_text().splitlines(keepends=True)[: args.held_out]
    args.out.write_text("".join(head) + "".join(json.dumps(p) + "\n" for p in sample))
    if args.write_ids:
        versions = " ".join(f"{name}=={metadata.version(name)}" for name in packages)  # import = distribution names
        args.write_ids.write_text(f"# {versions}\n" + "".join(p["id"] + "\n" for p in sample))
    print(f"wrote {args.out}: {len(head)} held-out + {len(sample)} package prompts")


if __name__ == "__main__":
    main()
