"""Drafter `eagle3`: heads in the layout EAGLE-3's authors publish (tests/published_heads.py, built
from their definitions) load, compute the published forward, draft from the right three target
layers with the draft→target id map, and decode losslessly; wrong heads are one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
from published_heads import eagle3_forward, eagle3_head
from transformers import DynamicCache

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec.errors import ConfigError
from treespec.interfaces import PrefillContext
from treespec.plugins.configs import Eagle3Config
from treespec.plugins.eagle3 import Eagle3Drafter
from treespec.plugins.eagle3_head import default_layers
from treespec.tree import DraftTree


def drafter(target, head, **options) -> Eagle3Drafter:
    return Eagle3Drafter(Eagle3Config(head=str(head), **options), target)


@pytest.fixture(scope="module")
def pair_target():
    """treespec-py (8 layers: features from hidden_states 2, 4 and 5) in float64."""
    return treespec.TargetModel.load("treespec-py", dtype="float64")


@pytest.mark.parametrize("fmt, dtype", [("bin", torch.float16), ("safetensors", torch.bfloat16)])
def test_loads_the_published_layout_and_computes_the_published_forward(target64, tmp_path, fmt, dtype):
    folder = eagle3_head(tmp_path / "head", hidden=64, vocab=512, draft_vocab=200, fmt=fmt, dtype=dtype)
    d = drafter(target64, folder)  # fp16/bf16 cast to the target's float64; no embedding in the file
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 512, (7,), generator=gen)
    causal = torch.full((7, 7), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    embeds = torch.nn.functional.embedding(toks, d.embed.weight)[None]
    for width in (3 * 64, 64):  # the target's fused layers (fc), then the head's own outputs (no fc)
        feats = torch.randn(7, width, generator=gen, dtype=torch.float64)
        want_out, want_logits = eagle3_forward(folder, feats, toks, embedding=d.embed.weight)
        got = d.head(feats[None], embeds, torch.arange(7)[None], causal, DynamicCache())[0]
        assert torch.allclose(got, want_out, atol=1e-6), (got - want_out).abs().max()
        q = d._q(got)  # [7, 512] over target ids
        want_q = torch.softmax(want_logits, -1)
        assert torch.allclose(q.double(), want_q, atol=1e-6)
        assert (q[:, ~d.head.t2d] == 0).all() and torch.allclose(q.sum(-1), torch.ones(7, dtype=q.dtype))


def test_root_proposals_come_from_the_three_layers_and_map_to_target_ids(pair_target, tmp_path):
    """The drafter's children of the root = the published forward over the target's hidden states
    2, 4 and 5 (the inputs of layers 2, L//2, L−3 of 8), computed from a plain forward of the prompt."""
    assert default_layers(8) == (2, 4, 5)
    folder = eagle3_head(tmp_path / "head", hidden=256, vocab=4096, draft_vocab=1500, intermediate=256)
    d = drafter(pair_target, folder)
    assert d.target_hidden_layers == (2, 4, 5)
    dec = treespec.Decoder(pair_target, drafter=d, builder="chain")
    ids = dec.encode("def add(a, b):\n    return")
    with torch.inference_mode():
        hs = pair_target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    fused = torch.cat([hs[2][0], hs[4][0], hs[5][0]], -1)  # [C, 768]
    _, logits = eagle3_forward(folder, fused[:-1], torch.tensor(ids[1:]), embedding=d.embed.weight)
    want = logits[-1].topk(4).indices
    treespec.step.prefill(pair_target, d, ids)
    d.begin_step(ids[-1])
    tree = DraftTree(ids[-1])
    got = d.expand(tree, torch.tensor([0]), 4)
    assert got.tokens[0].tolist() == want.tolist()
    assert all(bool(d.head.t2d[t]) for t in got.tokens[0].tolist())  # target ids inside the draft vocabulary


def test_config_layer_ids_and_the_layers_option(target64, tmp_path):
    folder = eagle3_head(tmp_path / "head", hidden=64, vocab=512, draft_vocab=512)
    config = json.loads((folder / "config.json").read_text())
    config["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": [0, 2, 3]
    }  # SpecForge/SGLang: outputs of layers 0, 2, 3
    (folder / "config.json").write_text(json.dumps(config))
    assert drafter(target64, folder).target_hidden_layers == (1, 3, 4)
    assert drafter(target64, folder, layers=[1, 2, 5]).target_hidden_layers == (1, 2, 5)
    with pytest.raises(ConfigError, match="three hidden-state indices in 0..5"):
        drafter(target64, folder, layers=[1, 2, 9])


def test_top_level_layer_ids_are_vllms_and_read_as_they_are(target64, tmp_path):
    """Issue 29: the top-level ``eagle_aux_hidden_state_layer_ids`` is vLLM's key, and vLLM captures
    id i as the input of decoder layer i (vllm/model_executor/models/interfaces.py,
    ``_maybe_add_hidden_state``) = hidden_states[i]: no +1 (SGLang's +1 belongs to ``eagle_config``)."""
    folder = eagle3_head(tmp_path / "head", hidden=64, vocab=512, draft_vocab=512)
    config = json.loads((folder / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (folder / "config.json").write_text(json.dumps(config))
    assert drafter(target64, folder).target_hidden_layers == (1, 3, 4)


@pytest.mark.parametrize("builder, options", [("opt-tree", {"nodes": 12}), ("chain", {"k": 4}), ("eagle2", {})])
def test_lossless_with_a_reduced_vocabulary(target64, greedy_reference, tmp_path, builder, options):
    """A head whose draft vocabulary is the 200 most frequent target ids of real stories (as EAGLE-3's
    scandata picks it); every builder's output equals the target's greedy decoding."""
    prompts = tinystories_prompts(3)
    counts = torch.zeros(512)
    for p in tinystories_prompts(60)[3:]:
        counts.index_add_(
            0, torch.tensor(target64.tokenizer(p).input_ids), torch.ones(len(target64.tokenizer(p).input_ids))
        )
    used = counts.topk(200).indices
    folder = eagle3_head(tmp_path / "head", hidden=64, vocab=512, draft_vocab=200, used=used, seed=5)
    dec = treespec.Decoder(
        target64,
        drafter="eagle3",
        drafter_options={"head": str(folder), "layers": [1, 3, 4]},
        builder=builder,
        builder_options=options,
    )
    for prompt in prompts:
        ids = dec.encode(prompt)
        out = dec.generate(ids, max_new_tokens=48)
        assert out.token_ids == greedy_reference(ids, 48), prompt


def test_wrong_heads_are_one_line(target64, tmp_path):
    from published_heads import eagle1_head

    three = eagle3_head(tmp_path / "three", hidden=64, vocab=512, draft_vocab=100)
    one = eagle1_head(tmp_path / "one", hidden=64, vocab=512)
    with pytest.raises(ConfigError, match="is an EAGLE-3 head: use --drafter eagle3"):
        treespec.Decoder(target64, drafter="eagle", drafter_options={"head": str(three)}, builder="chain")
    with pytest.raises(ConfigError, match="is an EAGLE-1/2 head .*use --drafter eagle$"):
        drafter(target64, one)
    with pytest.raises(ConfigError, match="reads target features of size 128 but target .* has 64"):
        drafter(target64, eagle3_head(tmp_path / "wide", hidden=128, vocab=512, draft_vocab=100))
    with pytest.raises(ConfigError, match="needs an EAGLE-3 head trained for target"):
        treespec.Decoder(target64, drafter="eagle3", builder="chain")
    assert STORIES260K.is_dir()


def test_prefill_of_a_one_token_prompt_drafts_nothing_and_stays_lossless(target64, greedy_reference, tmp_path):
    folder = eagle3_head(tmp_path / "head", hidden=64, vocab=512, draft_vocab=300)
    d = drafter(target64, folder, layers=[1, 3, 4])
    d.prefill(PrefillContext(input_ids=torch.tensor([1]), hidden=torch.zeros(0, 192, dtype=torch.float64)))
    d.begin_step(1)
    assert d.expand(DraftTree(1), torch.tensor([0]), 3).q.sum() == 0
    dec = treespec.Decoder(target64, drafter=d, builder="opt-tree")
    assert dec.generate([1], max_new_tokens=24).token_ids == greedy_reference([1], 24)


def test_a_deeper_node_reads_its_parents_output(target64, tmp_path):
    """Below the root the head is fed its own pre-norm output (no fc), at position C-2+depth, seeing
    the committed items and its ancestors: the published forward over [fc(fused) ..., out_root]."""
    folder = eagle3_head(tmp_path / "head", hidden=64, vocab=512, draft_vocab=512, seed=9)
    d = drafter(target64, folder, layers=[1, 3, 4])
    ids = target64.tokenizer(tinystories_prompts(1)[0]).input_ids
    with torch.inference_mode():
        hs = target64.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    fused = torch.cat([hs[1][0], hs[3][0], hs[4][0]], -1)[:-1]  # [C-1, 192]
    treespec.step.prefill(target64, d, ids)
    d.begin_step(ids[-1])
    tree = DraftTree(ids[-1])
    child = int(d.expand(tree, torch.tensor([0]), 1).tokens[0, 0])
    tree.add_children(torch.tensor([0]), torch.tensor([child]), torch.tensor([0.5]))
    d.expand(tree, torch.tensor([1]), 2)  # feeds the child
    got = d.distribution(tree, torch.tensor([1]))[0]
    g = fused.double() @ d.head.fc.weight.double().T  # the committed items' g
    out, _ = eagle3_forward(folder, g, torch.tensor(ids[1:]), embedding=d.embed.weight)
    _, logits = eagle3_forward(
        folder, torch.cat([g, out[-1:]]), torch.tensor(ids[1:] + [child]), embedding=d.embed.weight
    )
    assert torch.allclose(got.double(), torch.softmax(logits[-1], -1), atol=1e-6)


def test_training_time_test_unrolls_what_decoding_runs(target64):
    """Step i of the unrolled training forward at row t equals the decode-time head fed a chain: the
    committed items 0..t (true features) and, at depth i, its own previous output, cache and all."""
    from treespec.plugins.eagle3_head import Eagle3Head
    from treespec.plugins.eagle3_train import unroll
    from treespec.plugins.eagle_head import head_config_for

    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(target64.model.config), 64, 512, 512).double()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.tensor(target64.tokenizer(tinystories_prompts(2)[1]).input_ids)
    with torch.no_grad():
        hs = target64.model(ids[None], output_hidden_states=True).hidden_states
        fused = torch.cat([hs[1], hs[3], hs[4]], -1)  # [1, T, 192]
        embed = target64.model.get_input_embeddings()
        outs = unroll(head, embed, fused, ids[None], 3)
        t = 9
        cache = DynamicCache()
        causal = torch.full((t + 1, t + 1), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
        out = head(fused[:, : t + 1], embed(ids[None, 1 : t + 2]), torch.arange(t + 1)[None], causal, cache)[:, -1:]
        assert torch.allclose(out[0, 0], outs[0][0, t], atol=1e-9)
        for i in (1, 2):  # depth i: token x_{t+1+i} at position t+i, fed the previous output
            out = head(out, embed(ids[None, t + 1 + i : t + 2 + i]), torch.tensor([[t + i]]), None, cache)
            assert torch.allclose(out[0, 0], outs[i][0, t], atol=1e-9), i


def test_cli_trains_an_eagle3_head_that_decodes_losslessly(tmp_path, greedy_reference):
    import os
    import subprocess
    import sys

    env = os.environ | {"OMP_NUM_THREADS": "1"}
    exe = [sys.executable, "-m", "treespec.cli.app"]
    out = tmp_path / "head3"
    r = subprocess.run(
        exe
        + [
            "train",
            "eagle",
            "--version",
            "3",
            "--target",
            str(STORIES260K),
            "--data",
            "tinystories",
            "--offset",
            "300",
            "--limit",
            "120",
            "--epochs",
            "3",
            "--ttt-steps",
            "3",
            "--lr",
            "3e-3",
            "--draft-vocab",
            "300",
            "--max-new-tokens",
            "48",
            "--gen-batch-size",
            "40",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "training.json").read_text())
    assert summary["draft_vocab"] == 300 and len(summary["top1_per_step"]) == 3
    assert summary["settings"]["gen_batch_size"] == 40  # once dropped without a word for version 3
    assert summary["history"][-1]["held_out"]["loss"] < summary["history"][0]["held_out"]["loss"]  # it learns
    prompt = tinystories_prompts(4)[3]
    r = subprocess.run(
        exe
        + [
            "run",
            "--target",
            str(STORIES260K),
            "--dtype",
            "float64",
            "--drafter",
            "eagle3",
            "-D",
            f"head={out}",
            "--max-new-tokens",
            "48",
            "--prompt",
            prompt,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    ids = greedy_reference.target.tokenizer(prompt).input_ids
    got = json.loads(r.stdout)
    assert got["token_ids"] == greedy_reference(ids, 48)


def test_a_head_of_another_width_than_its_target_embeds_with_its_own_table(target64, greedy_reference, tmp_path):
    """Issue 29 (6): heads with ``target_hidden_size`` ≠ their own width (SpecForge, vLLM) were refused.
    A 48-wide head for the 64-wide target: fc reads 3 × 64, the head embeds with its own [V, 48] table,
    computes the published forward, and decodes losslessly."""
    folder = eagle3_head(tmp_path / "head", hidden=48, heads=4, kv_heads=2, vocab=512, draft_vocab=200,
                         target_hidden=64, seed=7)  # fmt: skip
    d = drafter(target64, folder)
    assert d.embed is d.head.embed_tokens and d.embed.weight.shape == (512, 48)
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 512, (6,), generator=gen)
    causal = torch.full((6, 6), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    embeds = torch.nn.functional.embedding(toks, d.embed.weight)[None]
    for width in (3 * 64, 48):  # the target's fused layers (fc), then the head's own outputs
        feats = torch.randn(6, width, generator=gen, dtype=torch.float64)
        want_out, want_logits = eagle3_forward(
            folder, feats, toks, embedding=target64.model.get_input_embeddings().weight
        )
        got = d.head(feats[None], embeds, torch.arange(6)[None], causal, DynamicCache())[0]
        assert torch.allclose(got, want_out, atol=1e-6), (got - want_out).abs().max()
    dec = treespec.Decoder(target64, drafter="eagle3", drafter_options={"head": str(folder)}, builder="chain",
                           builder_options={"k": 3})  # fmt: skip
    for prompt in tinystories_prompts(2):
        ids = dec.encode(prompt)
        assert dec.generate(ids, max_new_tokens=32).token_ids == greedy_reference(ids, 32)
