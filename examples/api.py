"""treespec's Python API in one page. Run from the repository root: python examples/api.py"""

import treespec
from treespec.plugins.configs import OptTreeConfig
from treespec.plugins.opt_tree import OptTreeBuilder

PROMPT = 'def is_palindrome(text):\n    """Return True if text reads the same backwards."""\n'

# 1. By name: plugins come from the registry, options are validated against each plugin's Config.
#    "treespec-py" and "treespec-py-draft" are treespec's own pair, shipped in the package.
dec = treespec.Decoder(
    target="treespec-py",
    drafter="model",
    drafter_options={"model": "treespec-py-draft"},
    builder="opt-tree",
    builder_options={"nodes": 16},
)
out = dec.generate(PROMPT, max_new_tokens=64)
print(out.text)
print(out.stats.summary())

# 2. Instances work too: share one loaded target between decoders, pass a configured builder.
target = dec.target
chain_like = OptTreeBuilder(OptTreeConfig(nodes=1, threshold=0.0, max_depth=6))  # n = 1: a chain
dec2 = treespec.Decoder(target, drafter=dec.drafter, builder=chain_like)
out2 = dec2.generate(out.prompt_ids, max_new_tokens=64)
assert out2.token_ids == out.token_ids  # both equal the target's own greedy decoding

# 3. Per-step statistics: tree size, depth, E(A) = Σ p̂, accepted tokens, time per phase.
for i, step in enumerate(out.stats.steps[:5]):
    print(
        f"step {i}: {step.tree_size} nodes, depth {step.depth}, E(A) {step.expected_accepted:.2f}, "
        f"accepted {step.accepted} (+1 bonus), draft {step.t_draft * 1e3:.1f} ms, verify {step.t_verify * 1e3:.1f} ms"
    )

# 4. Streaming: the callback receives each step's new token ids.
dec.generate("import os\n\n\ndef walk(root):\n", max_new_tokens=32, stream=lambda ids: print(ids, flush=True))

# 5. Composing drafters: one drafter made of several, their candidates merged by token (docs/plugins.md).
both = treespec.compose(dec.drafter, "ngram", merge="mix", weights=[0.7, 0.3])  # instances or names
out5 = treespec.Decoder(target, drafter=both, builder="opt-tree").generate(out.prompt_ids, max_new_tokens=64)
assert out5.token_ids == out.token_ids
print(f"model+ngram: {out5.stats.mean_accepted:.2f} tokens/step (model alone: {out.stats.mean_accepted:.2f})")
# by name, as on the command line (--drafter self+ngram -D self.layers=3):
treespec.Decoder(target, drafter="self+ngram", drafter_options={"self.layers": 3, "ngram.max_ngram": 4})
# the target's EAGLE head (for treespec-py its packaged head is the default: -D head=... otherwise)
print(treespec.Decoder(target, drafter="eagle", builder="opt-tree").generate(PROMPT, max_new_tokens=64).stats.summary())
