"""One tree forward through real (random-weight) Hugging Face models equals running every
root-to-node path as a plain sequence; KV compaction and rollback after a failed forward.

Everything runs in float64 so that a difference above ~1e-9 is a bug, not rounding
(../shared/README.md). One exception: the *eager* attention of Llama, Qwen2 and Mistral computes its
softmax in float32 whatever the model dtype (``softmax(..., dtype=torch.float32).to(query.dtype)`` in
transformers' ``eager_attention_forward``), so those runs carry float32 rounding (measured up to
~2.3e-6 on logits of magnitude ~5) and are compared at 2e-5 — still 50x below the smallest effect
of a wrong mask (``test_wrong_mask_is_detected`` checks that). GPT-2's eager softmax and every sdpa
path stay in float64 (measured ≤ 5e-15) and are compared at 1e-9.
Trees and prefixes are drawn from a seeded generator so failures reproduce.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import treespec
from treespec import DraftTree, TargetModel

TOL = 1e-9
EAGER_FP32_SOFTMAX_TOL = 2e-5
VOCAB = 96
ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
IMPLS = ["eager", "sdpa"]
SEEDS = [0, 1, 2, 3, 4]


# These models are tiny: one intra-op thread is as fast, and on a loaded 2-core machine two threads
# spin-wait on each other (single linears measured at ~18 ms instead of ~10 µs).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- models
def tol(model) -> float:
    """The comparison tolerance for ``model`` (see the module docstring)."""
    eager = model.config._attn_implementation == "eager"
    return EAGER_FP32_SOFTMAX_TOL if eager and model.config.model_type != "gpt2" else TOL


@functools.cache
def make_model(arch: str, impl: str):
    """A tiny seeded random-weight model in float64. A larger init range than the default keeps the
    attention far from uniform, so a wrong mask changes the logits by far more than TOL."""
    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, initializer_range=0.2, attn_implementation=impl)
    if arch == "gpt2":
        cfg = GPT2Config(
            n_embd=48, n_layer=2, n_head=4, n_positions=128, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, **common
        )
        model = GPT2LMHeadModel(cfg)
    else:
        cfg_cls, model_cls = {
            "llama": (LlamaConfig, LlamaForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM),
        }[arch]
        cfg = cfg_cls(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # GQA
            max_position_embeddings=128,
            **common,
        )
        model = model_cls(cfg)
    return model.to(torch.float64).eval()


@torch.inference_mode()
def plain_last(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [V] and last hidden state [H] at the last position of ``ids`` run as one plain
    causal sequence without any cache."""
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]


# ----------------------------------------------------------------------------- trees
def random_tree(rng: random.Random, root: int, n_layers: int = 3, max_branch: int = 3) -> DraftTree:
    """A random tree grown layer by layer, as builders do: every node of the last layer gets
    0..max_branch children (at least one node per layer keeps at least one child)."""
    tree = DraftTree(root)
    frontier = [0]
    for _ in range(n_layers):
        parents = []
        for node in frontier:
            parents += [node] * rng.randint(0, max_branch)
        if not parents:
            parents = [rng.choice(frontier)]
        tokens = [rng.randrange(VOCAB) for _ in parents]
        q = [rng.uniform(0.01, 1.0) for _ in parents]
        frontier = tree.add_children(torch.tensor(parents), torch.tensor(tokens), torch.tensor(q)).tolist()
    tree.validate()
    return tree


def walk_path(tree: DraftTree, node: int) -> list[int]:
    """Root-to-node ids by following parent pointers (independent of DraftTree.path)."""
    parents = tree.parents.tolist()
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def setup(arch: str, impl: str, seed: int, n_layers: int = 3, max_branch: int = 3):
    """A TargetModel prefilled with a random prefix without its last token, and a random tree whose
    root is that last token. Returns (target, prefix, tree, rng)."""
    rng = random.Random(f"{arch}-{impl}-{seed}")
    prefix = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 20))]
    target = TargetModel(make_model(arch, impl))
    target.prefill(torch.tensor(prefix[:-1]))
    assert target.past_len == len(prefix) - 1
    assert target.cache.get_seq_length() == len(prefix) - 1
    tree = random_tree(rng, prefix[-1], n_layers=n_layers, max_branch=max_branch)
    return target, prefix, tree, rng


def check_tree_forward(target: TargetModel, context: list[int], tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_tree on ``tree`` (whose root is context[-1], not cached); every node's logits and
    hidden state must equal the plain run of context[:-1] + its path."""
    assert target.past_len == len(context) - 1
    tt = tree.tensors(target.past_len, dtype=target.dtype)
    logits, hidden = target.forward_tree(tt, want_hidden=True)
    n, atol = len(tree), tol(target.model)
    assert logits.shape == (n, VOCAB)
    assert hidden.shape == (n, target.config.hidden_size)
    assert target.past_len == len(context) - 1 + n
    for node in range(n):
        ids = context[:-1] + [int(tree.tokens[i]) for i in walk_path(tree, node)]
        ref_logits, ref_hidden = plain_last(target.model, ids)
        torch.testing.assert_close(
            logits[node], ref_logits, atol=atol, rtol=0, msg=lambda m, node=node: f"node {node}: {m}"
        )
        torch.testing.assert_close(
            hidden[node], ref_hidden, atol=atol, rtol=0, msg=lambda m, node=node: f"node {node}: {m}"
        )
    return logits, hidden


def assert_cache_len(target: TargetModel, length: int) -> None:
    """Every layer (not just layer 0, which is all get_seq_length() looks at) holds ``length`` rows."""
    assert target.cache.get_seq_length() == length
    assert [layer.keys.shape[-2] for layer in target.cache.layers] == [length] * len(target.cache.layers)
    assert [layer.values.shape[-2] for layer in target.cache.layers] == [length] * len(target.cache.layers)


params = pytest.mark.parametrize("arch,impl", [(a, i) for a in ARCHS for i in IMPLS])


# ----------------------------------------------------------------------------- forward_tree
@params
@pytest.mark.parametrize("seed", SEEDS)
def test_every_node_matches_plain_run(arch, impl, seed):
    target, prefix, tree, _ = setup(arch, impl, seed)
    logits, _ = check_tree_forward(target, prefix, tree)
    assert_cache_len(target, len(prefix) - 1 + len(tree))
    # without want_hidden: same logits, no hidden states
    target2 = TargetModel(target.model)
    target2.prefill(torch.tensor(prefix[:-1]))
    logits2, hidden2 = target2.forward_tree(tree.tensors(target2.past_len, dtype=target2.dtype))
    assert hidden2 is None
    torch.testing.assert_close(logits2, logits, atol=tol(target.model), rtol=0)


@params
def test_prefill_hidden_matches_plain_run(arch, impl):
    rng = random.Random(f"prefill-{arch}-{impl}")
    prefix = [rng.randrange(VOCAB) for _ in range(12)]
    target = TargetModel(make_model(arch, impl))
    hidden = target.prefill(torch.tensor(prefix[:-1]), want_hidden=True)
    assert hidden.shape == (len(prefix) - 1, target.config.hidden_size)
    for i in (0, 5, len(prefix) - 2):
        ref = plain_last(target.model, prefix[: i + 1])[1]
        torch.testing.assert_close(hidden[i], ref, atol=tol(target.model), rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_token_prompt_has_empty_cache(impl):
    """A one-token prompt prefills nothing; the first tree forward starts from an empty cache."""
    rng = random.Random(7)
    target = TargetModel(make_model("llama", impl))
    assert target.prefill(torch.tensor([], dtype=torch.long)) is None
    assert target.past_len == 0
    root = rng.randrange(VOCAB)
    check_tree_forward(target, [root], random_tree(rng, root))


@params
def test_wrong_mask_is_detected(arch, impl):
    """Sanity check of the comparison's power: letting one sibling see another must change its
    logits by far more than the tolerance."""
    rng = random.Random(11)
    target = TargetModel(make_model(arch, impl))
    prefix = [rng.randrange(VOCAB) for _ in range(8)]
    target.prefill(torch.tensor(prefix[:-1]))
    tree = DraftTree(prefix[-1])
    tree.add_children(torch.tensor([0, 0]), torch.tensor([3, 4]), torch.tensor([0.5, 0.5]))
    tt = tree.tensors(target.past_len, dtype=target.dtype)
    leaky = tt.attention_mask.clone()
    leaky[..., 2, target.past_len + 1] = 0.0  # node 2 may see its sibling node 1
    logits, _ = target.forward_tree(dataclasses.replace(tt, attention_mask=leaky))
    ref, _ = plain_last(target.model, prefix + [4])
    assert (logits[2] - ref).abs().max() > 50 * tol(target.model)


# ----------------------------------------------------------------------------- commit
@params
@pytest.mark.parametrize("seed", SEEDS)
def test_commit_then_plain_token(arch, impl, seed):
    target, prefix, tree, rng = setup(arch, impl, seed)
    target.forward_tree(tree.tensors(target.past_len, dtype=target.dtype))
    base = target.past_len - len(tree)
    node = rng.randrange(len(tree))  # usually a path whose rows are not contiguous: copy + crop
    path = walk_path(tree, node)
    target.commit(torch.tensor(path))
    assert target.past_len == base + len(path)
    assert_cache_len(target, base + len(path))
    t = rng.randrange(VOCAB)
    with torch.inference_mode():
        out = target.model(
            input_ids=torch.tensor([[t]]),
            position_ids=torch.tensor([[target.past_len]]),
            **{target.cache_keyword: target.cache},
            use_cache=True,
        )
    ref, _ = plain_last(target.model, prefix[:-1] + [int(tree.tokens[i]) for i in path] + [t])
    torch.testing.assert_close(out.logits[0, -1], ref, atol=tol(target.model), rtol=0)


@params
@pytest.mark.parametrize("which", ["root", "deepest", "chain"])
def test_commit_then_next_tree(arch, impl, which):
    """A full two-step cycle: tree forward, commit a path, then the bonus token is the next root of a
    second tree forward, whose every node must again match the plain run of the whole sequence."""
    rng = random.Random(f"two-steps-{arch}-{impl}-{which}")
    prefix = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 20))]
    target = TargetModel(make_model(arch, impl))
    target.prefill(torch.tensor(prefix[:-1]))
    if which == "chain":  # a chain: the accepted rows are already contiguous (crop only)
        tree = random_tree(rng, prefix[-1], n_layers=4, max_branch=1)
        node = len(tree) - 1
    else:
        tree = random_tree(rng, prefix[-1])
        node = 0 if which == "root" else int(tree.depths.argmax())
    check_tree_forward(target, prefix, tree)
    path = walk_path(tree, node)
    target.commit(torch.tensor(path))
    assert_cache_len(target, len(prefix) - 1 + len(path))
    bonus = rng.randrange(VOCAB)
    context = prefix[:-1] + [int(tree.tokens[i]) for i in path] + [bonus]
    tree2 = random_tree(rng, bonus)
    check_tree_forward(target, context, tree2)


# ----------------------------------------------------------------------------- failures roll back
def _bad_mask(tt, past_len):
    return dataclasses.replace(tt, attention_mask=tt.attention_mask[..., :-1])  # one column short


def _bad_ids(tt, past_len):
    ids = tt.input_ids.clone()
    ids[-1] = VOCAB + 5  # out of vocabulary
    return dataclasses.replace(tt, input_ids=ids)


@params
@pytest.mark.parametrize("corrupt", [_bad_ids, _bad_mask], ids=["out_of_vocab_ids", "mask_wrong_shape"])
def test_failed_forward_leaves_cache_as_it_was(arch, impl, corrupt):
    """A forward that raises must leave the cache exactly as it was: every layer at past_len with
    the same contents, and decoding must continue correctly.

    With a mask of the wrong shape the model fails inside layer 0's attention, *after* layer 0
    appended its keys/values but before layer 1 did (found while writing this test)."""
    target, prefix, tree, rng = setup(arch, impl, seed=5)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in target.cache.layers]
    past_len = target.past_len
    tt = tree.tensors(past_len, dtype=target.dtype)
    with pytest.raises(treespec.TreespecError):
        target.forward_tree(corrupt(tt, past_len))
    assert target.past_len == past_len
    assert target.cache.get_seq_length() == past_len
    assert_cache_len(target, past_len)
    for layer, (k, v) in zip(target.cache.layers, before):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    # decoding continues: the same tree now succeeds and matches the plain runs, and commit works
    check_tree_forward(target, prefix, tree)
    path = walk_path(tree, int(tree.depths.argmax()))
    target.commit(torch.tensor(path))
    assert_cache_len(target, past_len + len(path))
