"""Tooling: from treespec to a serving engine (``treespec export``, docs/serving.md).

    heads.py       a head and its target, read for export (the drafters' own readers and checks)
    vllm.py        the layout vLLM loads (speculators EAGLE-3, EAGLE-1) and its launch command
    sglang.py      the layout SGLang loads (LlamaForCausalLMEagle3, LlamaForCausalLMEagle) and its command
    acceptance.py  measuring acceptance by depth and rank for a target + drafter (`export measure`)
    tree.py        static trees from that measurement: OPT-Tree's optimum, vLLM's tree string, SGLang's shape
    plan.py        which tree each engine should run at a node budget (with treespec's cost profile)

Each engine module names the files of the engine's source its fields come from. Nothing here is
imported by the decoding core.
"""
