"""Drafter `self`: the target's first k layers, sharing its weights, is lossless and matches a
separately loaded k-layer copy of the same model exactly."""

from __future__ import annotations

import pytest
import torch

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec.interfaces import Commit, PrefillContext
from treespec.plugins.self_drafter import SelfDrafter
from treespec.tree import DraftTree

N_PROMPTS = 12
MAX_NEW = 128


@pytest.fixture(scope="module")
def prompts(target64):
    return [target64.tokenizer(p).input_ids for p in tinystories_prompts(N_PROMPTS)]


def storages(model) -> dict[int, int]:
    return {p.data_ptr(): p.numel() for p in model.parameters()}


def test_weights_are_shared_not_copied(target64):
    before = storages(target64.model)
    drafter = SelfDrafter(SelfDrafter.Config(layers=3), target64)
    mine = storages(drafter.model)
    assert set(mine) <= set(before)  # every parameter is one of the target's
    assert sum(n for ptr, n in mine.items() if ptr not in before) == 0
    assert storages(target64.model) == before  # and the target is untouched
    assert len(drafter.model.model.layers) == 3 and len(target64.model.model.layers) == 5
    assert drafter.model.config.num_hidden_layers == 3 and target64.model.config.num_hidden_layers == 5
    target_params = {id(p) for p in target64.model.parameters()}
    assert all(id(p) in target_params for p in drafter.model.parameters())
    assert drafter.model.model.embed_tokens is target64.model.model.embed_tokens
    assert drafter.model.model.norm is target64.model.model.norm
    assert drafter.model.lm_head is target64.model.lm_head
    assert all(a is b for a, b in zip(drafter.model.model.layers, target64.model.model.layers[:3]))


@pytest.mark.parametrize("layers", [5, 9])
def test_too_many_layers_is_a_config_error(target64, layers):
    with pytest.raises(treespec.ConfigError, match="fewer than the target's 5"):
        SelfDrafter(SelfDrafter.Config(layers=layers), target64)


def test_unsupported_architecture_is_a_config_error(target64):
    class Odd(torch.nn.Module):
        config = target64.model.config

    fake = treespec.TargetModel.__new__(treespec.TargetModel)
    fake.model = Odd()
    with pytest.raises(treespec.ConfigError, match="does not know where Odd keeps"):
        SelfDrafter(SelfDrafter.Config(layers=2), fake)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf-forward"])
@pytest.mark.parametrize("k", [2, 4])
def test_distribution_equals_a_loaded_k_layer_model(target64, k, lean):
    from transformers import AutoModelForCausalLM

    from treespec.lean import LeanCausalLM

    ref = AutoModelForCausalLM.from_pretrained(STORIES260K, num_hidden_layers=k, dtype=torch.float64).eval()
    drafter = SelfDrafter(SelfDrafter.Config(layers=k, lean=lean), target64)
    assert isinstance(drafter.forward, LeanCausalLM) == lean
    seen = []  # the shallow model's logits per forward (float64, before ModelDrafter's float32 softmax)
    forward = drafter.forward

    def spy(**kwargs):
        out = forward(**kwargs)
        seen.append(out.logits[0])
        return out

    drafter.forward = spy
    target_seen = []
    target_hook = target64.model.register_forward_hook(lambda m, a, out: target_seen.append(1))
    try:
        committed = target64.tokenizer("Once upon a time, there was a little dog").input_ids
        drafter.prefill(PrefillContext(input_ids=torch.tensor(committed)))
        gen = torch.Generator().manual_seed(0)
        for step in range(3):
            tree = DraftTree(committed[-1])
            a = tree.add_children(
                torch.tensor([0, 0]), torch.randint(3, 512, (2,), generator=gen), torch.full((2,), 0.3)
            )
            b = tree.add_children(a[[0, 1]], torch.randint(3, 512, (2,), generator=gen), torch.full((2,), 0.3))
            nodes = torch.tensor([0, int(a[0]), int(b[0]), int(b[1])])
            seen.clear()
            prop = drafter.expand(tree, nodes, 5)
            (logits,) = seen
            rows = logits[-drafter.probs.shape[0] :]  # the tree rows of this forward (after pending tokens)
            for i, node in enumerate(nodes.tolist()):
                with torch.inference_mode():
                    want = ref(torch.tensor([committed[:-1] + tree.path_tokens(node)])).logits[0, -1]
                row = drafter.row_of[node] - drafter.root_pos
                assert torch.allclose(rows[row], want, rtol=0, atol=1e-9), (step, node)
                q, tok = torch.softmax(want, -1).topk(5)
                assert prop.tokens[i].tolist() == tok.tolist()
                assert torch.allclose(prop.q[i].double(), q, atol=1e-6)
            new = tree.tokens[tree.path(int(b[0]))[1 : 1 + step]].tolist() + [
                int(torch.randint(3, 512, (1,), generator=gen))
            ]
            drafter.commit(Commit(tokens=new))
            committed += new
    finally:
        target_hook.remove()
    assert not target_seen  # hooks on the view stay on the view; the target was never run


BUILDERS = {"opt-tree-n25": ("opt-tree", {"nodes": 25}), "chain-k4": ("chain", {"k": 4})}


@pytest.mark.parametrize("builder_key", list(BUILDERS))
@pytest.mark.parametrize("layers", [3, 4])
def test_lossless_and_same_tau_as_the_loaded_copy(layers, builder_key, target64, greedy_reference, prompts):
    builder, b_opts = BUILDERS[builder_key]
    dec = treespec.Decoder(
        target64, drafter="self", drafter_options={"layers": layers}, builder=builder, builder_options=b_opts
    )
    assert isinstance(dec.drafter, SelfDrafter)
    steps = tokens = 0
    for ids in prompts:
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        assert out.token_ids == want, greedy_reference.explain(ids, out.token_ids, want)
        steps, tokens = steps + out.stats.n_steps, tokens + len(out.token_ids)
    if layers == 4:  # same weights, same maths: same acceptance as the separately loaded 4-layer model
        other = treespec.Decoder(
            target64, drafter=str(STORIES260K), drafter_options={"layers": 4}, builder=builder, builder_options=b_opts
        )
        o_steps = o_tokens = 0
        for ids in prompts:
            out = other.generate(ids, max_new_tokens=MAX_NEW)
            o_steps, o_tokens = o_steps + out.stats.n_steps, o_tokens + len(out.token_ids)
        assert (steps, tokens) == (o_steps, o_tokens)
        assert tokens / steps > 1.5  # the shallow draft does speculate


def test_gpt2_self_layers_1_is_lossless():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=96, n_positions=256, n_embd=32, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=95, pad_token_id=95
    )
    model = GPT2LMHeadModel(cfg).double().eval()
    model.generation_config.eos_token_id = 95  # generate and the Decoder stop at the same token
    model.generation_config.pad_token_id = 95
    target = treespec.TargetModel(model)
    before = storages(model)
    dec = treespec.Decoder(
        target, drafter="self", drafter_options={"layers": 1}, builder="opt-tree", builder_options={"nodes": 10}
    )
    assert len(dec.drafter.model.transformer.h) == 1 and len(model.transformer.h) == 3
    assert set(storages(dec.drafter.model)) <= set(before)
    gen = torch.Generator().manual_seed(1)
    for n in (1, 5, 17):
        ids = torch.randint(0, 95, (n,), generator=gen).tolist()
        with torch.inference_mode():
            want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40)[0, n:].tolist()
        out = dec.generate(ids, max_new_tokens=40)
        assert out.token_ids == want


def test_a_tokenizer_longer_than_the_embedding_is_one_line_naming_the_model():
    """Issue 29 (2): the self drafter's embedding check read ``config.model``, which a self-draft has not
    (AttributeError instead of the check's own message)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treespec.errors import ConfigError

    model = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(STORIES260K)
    tok.add_tokens(["<extra_a>", "<extra_b>"])  # 514 tokens, 512 embedding rows
    with pytest.raises(ConfigError, match="embeds 512 tokens but the target's tokenizer has 514"):
        treespec.Decoder(model, tokenizer=tok, drafter="self", drafter_options={"layers": 3})
