"""`treespec export`: heads exported for vLLM and SGLang load back into treespec with the same draft
distributions, their files match what each engine's loader reads (the layouts written down below from
the engines' own source, never from treespec's save), and the tree strings parse back to the same trees."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

import treespec
from conftest import STORIES260K, eagle3_head_dir, eagle_head_dir
from treespec.export import heads as export_heads
from treespec.export import sglang as export_sglang
from treespec.export import vllm as export_vllm
from treespec.plugins.configs import Eagle3Config, EagleConfig
from treespec.plugins.eagle import EagleDrafter
from treespec.plugins.eagle3 import Eagle3Drafter


def export(engine: str, head, tmp_path, dtype=torch.float64):
    info = export_heads.read_target(str(STORIES260K))
    files = export_heads.read_head(str(head), info)
    out = tmp_path / engine
    out.mkdir(parents=True)
    (
        export_vllm.write(files, info, out, 3, dtype)
        if engine == "vllm"
        else export_sglang.write(files, info, out, dtype)
    )
    return files, out


def causal(t: int) -> torch.Tensor:
    return torch.full((t, t), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]


def inputs(d, width: int, t: int = 9, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(3, 512, (t,), generator=gen)
    feats = torch.randn(t, width, generator=gen, dtype=torch.float64)
    return feats[None], torch.nn.functional.embedding(toks, d.embed.weight)[None], torch.arange(t)[None], toks


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle3_round_trip_gives_the_same_draft_distributions(target64, tmp_path, engine):
    head = eagle3_head_dir()
    files, out = export(engine, head, tmp_path)
    before = Eagle3Drafter(Eagle3Config(head=str(head)), target64)
    after = Eagle3Drafter(Eagle3Config(head=str(out)), target64)
    assert after.target_hidden_layers == before.target_hidden_layers == files.layers
    for width in (3 * 64, 64):  # the target's fused layers, then the head's own outputs
        feats, embeds, pos, _ = inputs(before, width)
        a = before.head(feats, embeds, pos, causal(9), DynamicCache())[0]
        b = after.head(feats, embeds, pos, causal(9), DynamicCache())[0]
        assert torch.allclose(before._q(a), after._q(b), atol=1e-6, rtol=0)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle1_round_trip_gives_the_same_draft_distributions(target64, tmp_path, engine):
    """vLLM's EAGLE-1 has no fc bias: the export moves it into the attention biases, exactly."""
    head = eagle_head_dir()
    files, out = export(engine, head, tmp_path)
    assert files.state["fc.bias"].abs().max() > 1e-3  # a bias worth moving
    before = EagleDrafter(EagleConfig(head=str(head), vocab=0, lean=False), target64)
    for lean in (False, True):
        after = EagleDrafter(EagleConfig(head=str(out), vocab=0, lean=lean), target64)
        feats, embeds, pos, _ = inputs(before, 64)
        with torch.inference_mode():
            a = before.forward(feats, embeds, pos, causal(9), DynamicCache())[0]
            b = after.forward(feats, embeds, pos, causal(9), DynamicCache())[0]
            assert torch.allclose(before._q(a), after._q(b), atol=1e-6, rtol=0)


def test_exported_heads_decode_with_the_same_steps(target64, greedy_reference, tmp_path):
    """Same drafts, step by step: the exported EAGLE-3 head accepts exactly what the original does."""
    head = eagle3_head_dir()
    _, out = export("vllm", head, tmp_path)
    ids = target64.tokenizer("Once upon a time, there was a little girl").input_ids
    runs = []
    for folder in (head, out):
        dec = treespec.Decoder(
            target64, drafter="eagle3", drafter_options={"head": str(folder)}, builder="chain", builder_options={"k": 4}
        )
        o = dec.generate(ids, max_new_tokens=40)
        runs.append((o.token_ids, [s.accepted for s in o.stats.steps]))
    assert runs[0] == runs[1]
    assert runs[0][0] == greedy_reference(ids, 40)


# ------------------------------------------------------------------- the layouts, as the engines read them
def vllm_names(state: dict[str, torch.Tensor], eagle3: bool) -> dict[str, tuple[int, ...]]:
    """The parameter each checkpoint tensor lands in, as vLLM 0.32.0 maps names:
    llama_eagle3.py ``Eagle3LlamaForCausalLM.load_weights``: t2d skipped, d2t -> draft_id_to_target_id,
    every name but lm_head prefixed ``model.``, then ``midlayer.`` -> ``layers.0.``; llama_eagle.py
    ``EagleLlamaForCausalLM.load_weights``: ``model.`` prefix; both stack q/k/v into ``qkv_proj`` and
    gate/up into ``gate_up_proj`` (``hf_to_vllm_mapper``)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, t in state.items():
        if name == "t2d" and eagle3:
            continue
        if name == "d2t" and eagle3:
            out["draft_id_to_target_id"] = tuple(t.shape)
            continue
        name = name if name.startswith("lm_head") else "model." + name
        name = name.replace("midlayer.", "layers.0.")
        name = re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", name)
        name = re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name)
        if name in out:  # a stacked parameter: its shards' rows add up
            out[name] = (out[name][0] + t.shape[0], *t.shape[1:])
        else:
            out[name] = tuple(t.shape)
    return out


H, HEADS, KV, V, D, I = (  # noqa: E741 - I: the MLP width, as the layouts name it
    64,
    8,
    4,
    512,
    8,
    172,
)  # stories260K: hidden 64, 8 / 4 KV heads, vocabulary 512, head_dim 8, MLP 172


def test_vllm_eagle3_layout(tmp_path):
    """Against vLLM 0.32.0: transformers_utils/configs/speculators/base.py (validate_speculators_config:
    speculators_config.proposal_methods[0].speculative_tokens, speculators_config.verifier.name_or_path,
    speculators_model_type, a transformer_layer_config dict), algos.py update_eagle3 (the top-level
    fields it lifts; norm_before_residual absent = True, so it must be written false), and the
    parameters of llama_eagle3.py's Eagle3LlamaForCausalLM (LlamaModel: fc [H, 3·Ht] without bias,
    layers.0.{self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj, input_layernorm,
    hidden_norm, post_attention_layernorm}, norm; lm_head [Vd, H]; draft_id_to_target_id [Vd])."""
    files, out = export("vllm", eagle3_head_dir(), tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and isinstance(cfg["transformer_layer_config"], dict)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"]
    layer = dict(cfg["transformer_layer_config"])  # what update_eagle3 builds the draft's config from
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert cfg["norm_before_residual"] is False and not cfg["norm_before_fc"]
    assert cfg["draft_vocab_size"] == 300 and cfg["target_hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(files.layers)  # vLLM's ids = hidden_states indices
    names = vllm_names(load_file(str(out / "model.safetensors")), eagle3=True)
    i = 2 * H  # q/k/v read [embedding; hidden]
    assert names == {
        "model.fc.weight": (H, 3 * H),
        "model.layers.0.self_attn.qkv_proj.weight": ((HEADS + 2 * KV) * D, i),
        "model.layers.0.self_attn.o_proj.weight": (H, HEADS * D),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * I, H),
        "model.layers.0.mlp.down_proj.weight": (H, I),
        "model.layers.0.input_layernorm.weight": (H,),
        "model.layers.0.hidden_norm.weight": (H,),
        "model.layers.0.post_attention_layernorm.weight": (H,),
        "model.norm.weight": (H,),
        "lm_head.weight": (300, H),
        "draft_id_to_target_id": (300,),
    }


def test_vllm_eagle1_layout(tmp_path):
    """Against vLLM 0.32.0 llama_eagle.py: EagleLlamaForCausalLM's LlamaModel has fc [H, 2H] WITHOUT a
    bias (an fc.bias would be skipped silently by AutoWeightsLoader), layer 0 without input_layernorm,
    attention biases only when the config says attention_bias or bias (llama.py LlamaAttention); no
    lm_head, no norm."""
    files, out = export("vllm", eagle_head_dir(), tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["attention_bias"] is True and cfg["bias"] is False
    names = vllm_names(load_file(str(out / "model.safetensors")), eagle3=False)
    assert "model.fc.bias" not in names and names["model.fc.weight"] == (H, 2 * H)
    assert not any("input_layernorm" in n or "lm_head" in n or n == "model.norm.weight" for n in names)
    assert names["model.layers.0.self_attn.qkv_proj.bias"] == (
        (HEADS + 2 * KV) * D,
    )  # q, k and v biases, stacked by vLLM
    assert names["model.layers.0.self_attn.o_proj.bias"] == (H,)


def test_sglang_layouts(tmp_path):
    """Against SGLang python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3: fc bias from
    config ``bias``, default none; midlayer.*; draft_vocab_size; d2t -> hot_token_id; t2d skipped),
    model_executor/model_runner.py + models/llama.py (eagle_config.eagle_aux_hidden_state_layer_ids,
    captured at id + 1), and models/llama_eagle.py (LlamaForCausalLMEagle: fc = nn.Linear(2H, H) with a
    bias; attention biases when ``attention_bias`` or ``bias``; speculative/eagle_utils.py load_token_map:
    torch.load(weights_only=True) of the hot ids)."""
    files3, out3 = export("sglang", eagle3_head_dir(), tmp_path / "three")
    cfg = json.loads((out3 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 300
    assert not cfg.get("bias") and cfg["tie_word_embeddings"] is False and cfg["target_hidden_size"] == H
    assert [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(files3.layers)
    keys = set(load_file(str(out3 / "model.safetensors")))
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
    } <= keys and not any(k.startswith("layers.") for k in keys)
    files1, out1 = export("sglang", eagle_head_dir(), tmp_path / "one")
    cfg = json.loads((out1 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and not cfg["bias"] and not cfg["attention_bias"]
    state = load_file(str(out1 / "model.safetensors"))
    assert torch.equal(state["fc.bias"], files1.state["fc.bias"].double())


def test_sglang_token_map_is_the_draft_vocabulary(tmp_path):
    from conftest import EAGLE_TEST_SETTINGS
    from treespec.plugins.eagle_train import train

    head = tmp_path / "head"
    train(EAGLE_TEST_SETTINGS(head, epochs=1, limit=40, draft_vocab=200), log=lambda _: None)
    files, out = export("sglang", head, tmp_path)
    hot = torch.load(out / export_sglang.TOKEN_MAP, weights_only=True)  # as load_token_map reads it
    assert hot.tolist() == files.draft_vocab.tolist() and len(hot) == 200


# ------------------------------------------------------------------------------ import: published for vLLM
@pytest.mark.parametrize("norm_before_residual", [None, True, False])
def test_a_head_published_in_the_speculators_layout_loads_as_vllm_computes_it(target64, tmp_path, norm_before_residual):
    from published_heads import speculators_forward, speculators_head

    emb = target64.model.get_input_embeddings().weight.detach()
    folder = speculators_head(tmp_path / "h", 64, 512, 200, emb, [1, 3, 4], norm_before_residual)
    d = Eagle3Drafter(Eagle3Config(head=str(folder)), target64)
    assert d.target_hidden_layers == (1, 3, 4)  # vLLM's top-level ids, as they are
    feats, embeds, pos, toks = inputs(d, 3 * 64, t=7)
    got = d._q(d.head(feats, embeds, pos, causal(7), DynamicCache())[0])
    want = torch.softmax(speculators_forward(folder, feats[0], toks, emb) / d.temperature, -1)
    assert got.shape == want.shape
    assert torch.allclose(got.double(), want, atol=1e-6)


# ------------------------------------------------------------------------------------------------ CLI
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treespec.cli.app", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_export_writes_the_launch_command_and_errors_are_one_line(tmp_path):
    acc = tmp_path / "acc.json"
    acc.write_text(
        json.dumps({"format": "treespec-depth-rank/1", "acceptance": [[0.7, 0.15, 0.05], [0.6, 0.1], [0.5]]})
    )
    out = tmp_path / "v"
    r = run_cli(
        "export",
        "vllm",
        "--target",
        str(STORIES260K),
        "--head",
        str(eagle3_head_dir()),
        "--out",
        str(out),
        "--acceptance",
        str(acc),
        "--nodes",
        "6",
    )
    assert r.returncode == 0, r.stderr
    assert "vllm serve" in r.stdout and (out / "launch.txt").read_text().strip() == r.stdout.strip()
    plan = json.loads((out / "plan.json").read_text())["plan"]
    from treespec.export.tree import parse_vllm_string, uniform_branching

    tree = parse_vllm_string(plan["vllm_tree"]["speculative_token_tree"])
    assert uniform_branching(tree) and len(tree) <= 6
    for bad, message in (
        (["--head", str(tmp_path / "none")], "error: "),
        (["--head", str(eagle3_head_dir()), "--acceptance", str(tmp_path / "none.json")], "error: acceptance file"),
        (["--head", str(eagle3_head_dir())], "error: --out .* is not empty"),
    ):
        r = run_cli("export", "sglang", "--target", str(STORIES260K), "--out", str(out), *bad)
        assert r.returncode == 2 and re.search(message, r.stderr) and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ------------------------------------------------------------------------------------------ measuring
def test_depth_rank_measurement_counts_what_a_chain_decodes(target64):
    """`export measure`: its chain accepts exactly what the chain builder accepts (same drafts, same
    greedy verification), depth 1 is tested at every step, and each depth's ranks sum to at most 1."""
    from conftest import tinystories_prompts
    from treespec.export.acceptance import measure_depth_rank

    dec = treespec.Decoder(
        target64,
        drafter="eagle3",
        drafter_options={"head": str(eagle3_head_dir())},
        builder="chain",
        builder_options={"k": 3},
    )
    prompts = [dec.encode(p) for p in tinystories_prompts(3)]
    got = measure_depth_rank(dec, prompts, 32, depth=3, ranks=4)
    steps = accepted = 0
    for ids in prompts:
        out = dec.generate(ids, max_new_tokens=32)
        steps += len(out.stats.steps)
        accepted += sum(s.accepted for s in out.stats.steps)
    assert got["steps"] == steps and got["chain_tau"] == pytest.approx(1 + accepted / steps)
    assert got["tests"][0] == steps and all(a >= b for a, b in zip(got["tests"], got["tests"][1:]))
    assert all(sum(row) <= 1 + 1e-9 for row in got["acceptance"]) and got["acceptance"][0][0] > 0


def test_deep_depths_with_few_tests_lean_on_the_shallower_depth():
    from treespec.export.acceptance import PRIOR_TESTS, smooth

    p = smooth([[60, 20], [3, 0], [0, 0]], [100, 4, 0])
    assert p[0] == [0.6, 0.2]
    assert p[1][0] == pytest.approx((3 + PRIOR_TESTS * 0.6) / (4 + PRIOR_TESTS)) and p[1][1] > 0  # not "impossible"
    assert p[2] == p[1]  # no test at all: the shallower depth's vector


def test_a_speculators_head_re_exports_its_residual_variant(target64, tmp_path):
    """A head published in vLLM's layout with norm_before_residual (vLLM's default when absent) keeps
    it when exported for vLLM, and is refused in one line for SGLang, whose layer has no such variant."""
    from published_heads import speculators_head

    from treespec.errors import ConfigError

    emb = target64.model.get_input_embeddings().weight.detach()
    folder = speculators_head(tmp_path / "h", 64, 512, 200, emb, [1, 3, 4], None)
    files, out = export("vllm", folder, tmp_path)
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is True
    assert files.layers == (1, 3, 4)
    with pytest.raises(ConfigError, match="normalises before its residual.*serve it with vLLM$"):
        export("sglang", folder, tmp_path)


def test_cli_export_with_profiles_of_several_batch_sizes_writes_a_shape_per_batch_size(tmp_path):
    """`--profile` repeated with profiles of batch sizes 1 and 4: plan.json plans per batch size, SGLang gets
    its adaptive-mode file (topk 1, draft tokens = steps + 1, the start step among the candidates), vLLM a
    chain length per batch size; two profiles of one batch size, or profiles without --acceptance, are one
    line each."""
    from treespec.cost import CostModel

    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"format": "treespec-depth-rank/1", "acceptance": [[0.8, 0.1], [0.75, 0.1], [0.7]]}))
    files = []
    for batch, per_node in ((1, 0.0002), (4, 0.01)):
        cost = CostModel(key={"batch": batch} if batch > 1 else {})
        for n in (0, 1, 2, 4, 8, 16):
            cost.verify.observe(n, 0.02 + per_node * n)
            cost.bookkeeping.observe(n, 0.0003)
        for m in (1, 2, 4, 8):
            cost.expand.observe(m, 0.001)
        cost.first.observe(1, 0.001)
        files.append(tmp_path / f"p{batch}.json")
        files[-1].write_text(cost.to_json())
    common = ["--target", str(STORIES260K), "--head", str(eagle_head_dir()), "--acceptance", str(acc), "--nodes", "6"]
    profiles = ["--profile", str(files[1]), "--profile", str(files[0])]
    r = run_cli("export", "sglang", *common, *profiles, "--out", str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    record = json.loads((tmp_path / "s" / "plan.json").read_text())
    by = record["by_batch_size"]
    assert [b["batch_size"] for b in by] == [1, 4] and by[0]["chain"]["nodes"] > by[1]["chain"]["nodes"]
    assert record["plan"] == {k: v for k, v in by[0].items() if k in record["plan"]}  # the plan is batch 1's
    adaptive = json.loads((tmp_path / "s" / "sglang-adaptive.json").read_text())
    assert {k: v["candidate_steps"] for k, v in adaptive.items()} == {
        str(b["batch_size"]): b["adaptive_steps"] for b in by
    }
    shapes = next(x for x in r.stdout.splitlines() if x.startswith("# the static shape by the batch size"))
    for b in by:  # plain where the bucket predicts plain decoding faster, else its SGLang shape
        plain = b["predicted_tokens_per_second"]["plain"] >= b["predicted_tokens_per_second"]["sglang"]
        want = "no speculation" if plain else f"steps {b['sglang']['steps']}, topk {b['sglang']['topk']}"
        assert f"batch {b['batch_size']}: {want}" in shapes, shapes
    line = next(x for x in r.stdout.splitlines() if "--speculative-adaptive" in x).split()
    steps = int(line[line.index("--speculative-num-steps") + 1])
    assert line[line.index("--speculative-eagle-topk") + 1] == "1"
    assert int(line[line.index("--speculative-num-draft-tokens") + 1]) == steps + 1
    assert steps in {s for v in adaptive.values() for s in v["candidate_steps"]}
    r = run_cli("export", "vllm", *common, *profiles, "--out", str(tmp_path / "v"))
    assert r.returncode == 0 and "num_speculative_tokens by the batch size you expect (batch 1: " in r.stdout
    for bad, message in (
        (["--profile", str(files[0]), "--profile", str(files[0])], "two --profile files for one batch size"),
        (["--profile", str(tmp_path / "acc.json")], "is not a `treespec profile` file"),
    ):
        r = run_cli("export", "sglang", *common, *bad, "--out", str(tmp_path / "x"), "--force")
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli(
        "export",
        "sglang",
        "--target",
        str(STORIES260K),
        "--head",
        str(eagle_head_dir()),
        *profiles,
        "--out",
        str(tmp_path / "y"),
    )
    assert r.returncode == 2 and "give --acceptance FILE" in r.stderr
