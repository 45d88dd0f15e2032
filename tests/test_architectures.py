"""The whole decode loop on other architectures: random-weight Llama, Qwen2, Mistral and GPT-2
targets (float64), each drafted by another random model of its family and by itself; the output
must equal the target's own greedy `generate`, token for token."""

from __future__ import annotations

import pytest
import torch

import treespec

VOCAB = 96


def _config(arch: str, seed: int):
    from transformers import Gemma2Config, Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    if arch in ("gemma2", "gemma3"):  # sliding-window and full-attention layers mixed: a mask per layer type
        cls = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
        return cls(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=6,
            max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    if arch == "qwen2-mixed":  # Qwen2's max_window_layers: the first layer slides, the second does not
        return Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            **common,
        )
    if arch == "mistral-window":  # every layer attends to the last 8 positions only
        return MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            sliding_window=8,
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **common)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    return cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **common,
    )


def _model(arch: str, seed: int, path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, seed)).to(torch.float64)
    # make the random model confident enough that drafts are sometimes right, and EOS rare
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    return model


@torch.inference_mode()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    """The model's own greedy ``generate``: the reference every decode here must equal."""
    ref = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=n, attention_mask=torch.ones(1, len(ids), dtype=torch.long)
    )
    return ref[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "mistral", "gpt2", "mistral-window", "gemma2", "gemma3", "qwen2-mixed"]
)
def test_decode_loop_is_lossless_on_architecture(arch, tmp_path):
    target_model = _model(arch, 0, tmp_path / "target")
    _model(arch, 1, tmp_path / "draft")
    target = treespec.TargetModel(target_model)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 5, 17)]
    for draft in ("draft", "target"):
        for builder, opts in (("opt-tree", {"nodes": 12, "threshold": 0.1}), ("chain", {"k": 3})):
            dec = treespec.Decoder(target, drafter=str(tmp_path / draft), builder=builder, builder_options=opts)
            for ids in prompts:
                out = dec.generate(ids, max_new_tokens=40)
                want = _greedy(target_model, ids, 40)
                assert out.token_ids == want, f"{arch} draft={draft} {builder} prompt={ids}"
                if draft == "target" and builder == "chain":  # the target's own chain is always accepted
                    assert all(s.accepted == s.depth for s in out.stats.steps)
                if draft == "target":  # the root's best child is the target's own next token
                    assert all(s.accepted >= 1 for s in out.stats.steps if s.depth >= 1)


def test_models_mixing_window_and_full_layers_get_a_mask_per_layer_type():
    from treespec.kv import attention_windows

    windows = attention_windows(_config("gemma2", 0))
    assert windows.by_type == {"sliding_attention": 6, "full_attention": None} and windows.smallest == 6
    assert attention_windows(_config("mistral-window", 0)).window == 8
    assert attention_windows(_config("llama", 0)).smallest is None


@pytest.mark.parametrize("arch", ["bloom", "mamba"])
def test_models_that_cannot_verify_a_tree_are_refused_at_load_in_one_line(arch, tmp_path):
    from transformers import AutoModelForCausalLM, BloomConfig, MambaConfig

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    cfg = (
        BloomConfig(hidden_size=32, n_layer=2, n_head=4, **common)
        if arch == "bloom"
        else MambaConfig(hidden_size=32, num_hidden_layers=2, state_size=8, **common)
    )
    model = AutoModelForCausalLM.from_config(cfg)
    why = "ALiBi" if arch == "bloom" else "recurrent"
    with pytest.raises(treespec.ConfigError, match=f"cannot verify draft trees: {arch} .*{why}") as err:
        treespec.TargetModel(model)
    assert "\n" not in str(err.value)
    model.save_pretrained(tmp_path / arch)
    target = _model("llama", 0, tmp_path / "llama")
    with pytest.raises(treespec.ConfigError, match="cannot draft trees"):  # as a draft model, too
        treespec.Decoder(treespec.TargetModel(target), drafter=str(tmp_path / arch), builder="chain")


def test_chunked_attention_decodes_within_one_chunk_and_stops_there():
    """Llama 4's chunked layers attend within chunks of ``attention_chunk_size`` (issue 29 (1): output
    differed from ``generate`` from the first token once the context passed the chunk). Inside a chunk
    they are causal, so treespec decodes there token for token and stops at the chunk's end."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from treespec.errors import ConfigError

    cfg = Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=256, attention_chunk_size=16, num_local_experts=1,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    assert "chunked_attention" in cfg.layer_types
    torch.manual_seed(0)
    model = Llama4ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    target = treespec.TargetModel(model)
    assert target.max_positions == 16
    gen = torch.Generator().manual_seed(3)
    for builder, opts in (("opt-tree", {"nodes": 8}), ("chain", {"k": 3})):
        dec = treespec.Decoder(target, drafter="ngram", builder=builder, builder_options=opts)
        for n in (1, 6, 12):
            ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
            out = dec.generate(ids, max_new_tokens=40)
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                                 max_new_tokens=40, do_sample=False)[0, n:].tolist()  # fmt: skip
            assert out.token_ids == ref[: len(out.token_ids)]
            assert out.stats.stop_reason == "eos" or n + len(out.token_ids) == 16
        with pytest.raises(ConfigError, match="context is 16"):
            dec.generate(list(range(3, 23)), max_new_tokens=5)


def test_a_draft_that_cannot_be_cut_to_k_layers_says_so(tmp_path):
    """Issue 29 (3): a Gemma 3n draft cut to 1 layer said its files were damaged (download them again)."""
    from transformers import AutoModelForCausalLM, Gemma3nTextConfig

    from treespec.errors import ModelLoadError

    cfg = Gemma3nTextConfig(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32,
                            hidden_size_per_layer_input=8, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                            sliding_window=8, num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"],
                            activation_sparsity_pattern=[0.0] * 4)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "g")
    with pytest.raises(ModelLoadError, match=r"cannot be cut to its first 1 layer\(s\)") as err:
        treespec.Decoder(str(tmp_path / "g"), drafter=str(tmp_path / "g"), drafter_options={"layers": 1})
    assert "damaged" not in str(err.value) and "\n" not in str(err.value)


SLIDING = ["mistral-window", "gemma2", "gemma3", "qwen2-mixed"]


@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_window_targets_batch_each_row_as_its_own_forward(arch, tmp_path):
    """Batches of sliding-window targets (every layer sliding, or sliding and full layers mixed): one
    batched tree forward over rows whose prefixes run past the window gives every row the logits of its
    own one-row forward, before and after per-row compaction. Gemma's eager attention takes its
    softmax in float32 whatever the model's dtype, so rows padded differently agree to ~1e-7, not
    1e-9; a key seen or missed by one window moves logits by far more than the 1e-5 allowed."""
    import random

    from test_tree_forward import random_tree

    from treespec.batch_target import BatchTarget

    model = _model(arch, 0, tmp_path / "target").eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 14, 1, 9)]
    batch = BatchTarget(treespec.TargetModel(model))
    batch.prefill(prompts)
    singles = [treespec.TargetModel(model) for _ in prompts]
    for single, p in zip(singles, prompts):
        single.prefill(torch.tensor(p[:-1]))
    roots = [p[-1] for p in prompts]
    for _ in range(4):
        trees = [random_tree(rng, root, n_layers=rng.randint(0, 3)) for root in roots]
        logits, _ = batch.forward_trees([t.tensors(n, dtype=torch.float64) for t, n in zip(trees, batch.row_lens())])
        keeps = []
        for b, (tree, single) in enumerate(zip(trees, singles)):
            want, _ = single.forward_tree(tree.tensors(single.past_len, dtype=torch.float64))
            assert torch.allclose(logits[b, : len(tree)], want, atol=1e-5), (arch, b)
            keep = tree.ancestors[rng.randrange(len(tree))].nonzero().flatten()
            single.commit(keep)
            keeps.append(keep)
            roots[b] = rng.randrange(3, VOCAB)
        batch.commit(keeps)
    assert max(s.past_len for s in singles) > 8  # past every window


@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_window_targets_decode_in_batches_losslessly(arch, tmp_path):
    """Decoding in batches (two rows, refilled as rows finish) on sliding-window targets, 40 new
    tokens past windows of 6-8 positions: every row equals the target's own greedy ``generate``."""
    target_model = _model(arch, 0, tmp_path / "target")
    _model(arch, 1, tmp_path / "draft")
    target = treespec.TargetModel(target_model)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 5, 17, 9)]
    for draft in ("draft", "target"):
        dec = treespec.Decoder(
            target, drafter=str(tmp_path / draft), builder="opt-tree", builder_options={"nodes": 8, "threshold": 0.1}
        )
        outs = dec.generate(prompts, max_new_tokens=40, batch_size=2)
        for ids, out in zip(prompts, outs):
            assert out.token_ids == _greedy(target_model, ids, 40), f"{arch} draft={draft} prompt={ids}"
        assert sum(s.accepted for o in outs for s in o.stats.steps) > 0


@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_window_draft_models_draft_rows_together_as_each_alone(arch, tmp_path):
    """A batch's draft-model rows in one forward per round (``plugins/model_rows.py``) on draft models
    with sliding windows: every row gets the proposals its own drafter alone gives it, over steps whose
    prefixes and trees run past the window, a long prompt joining mid-batch (fed alone) included
    (tokens equal; q to 1e-5 under Gemma's float32 softmax)."""
    import random

    from treespec.interfaces import Commit, Expansion, PrefillContext
    from treespec.tree import DraftTree

    target = treespec.TargetModel(_model(arch, 0, tmp_path / "target"))
    _model(arch, 1, tmp_path / "draft")
    base = treespec.Decoder(target, drafter=str(tmp_path / "draft"), builder="chain").drafter
    rng = random.Random(9)
    ids = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 13, 7)]
    group, singles = base.rows(len(ids)), [base.fork() for _ in ids]
    assert type(group).__name__ == "ModelRows"
    for row, single, p in zip(group.drafters, singles, ids):
        row.prefill(PrefillContext(input_ids=torch.tensor(p)))
        single.prefill(PrefillContext(input_ids=torch.tensor(p)))
    roots = [p[-1] for p in ids]
    for _ in range(4):
        trees = [DraftTree(r) for r in roots]
        for i, root in enumerate(roots):
            group.drafters[i].begin_step(root)
            singles[i].begin_step(root)
        frontier = {i: torch.zeros(1, dtype=torch.long) for i in range(len(trees))}
        for _level in range(3):
            requests = {i: Expansion(trees[i], nodes, 2) for i, nodes in frontier.items()}
            got = group.expand_together(requests)
            for i, req in requests.items():
                want = singles[i].expand(trees[i], req.nodes, 2)
                assert torch.equal(got[i].tokens, want.tokens), (arch, i)
                assert torch.allclose(got[i].q, want.q, atol=1e-5), (arch, i)
                width = rng.randint(1, 2)
                frontier[i] = trees[i].add_children(
                    req.nodes.repeat_interleave(width),
                    got[i].tokens[:, :width].flatten(),
                    got[i].q[:, :width].flatten().clamp(min=1e-6),
                )
        for i, tree in enumerate(trees):  # accept a random path and a bonus token
            path = tree.ancestors[rng.randrange(len(tree))].nonzero().flatten()
            tokens = tree.tokens[path[1:]].tolist() + [rng.randrange(3, VOCAB)]
            group.drafters[i].commit(Commit(tokens=tokens))
            singles[i].commit(Commit(tokens=tokens))
            roots[i] = tokens[-1]
        if len(singles) == 3:  # a long prompt joins the running batch: its prompt is fed alone (past the window)
            (row,), single = group.add(1), base.fork()
            prompt = [rng.randrange(3, VOCAB) for _ in range(40)]
            row.prefill(PrefillContext(input_ids=torch.tensor(prompt)))
            single.prefill(PrefillContext(input_ids=torch.tensor(prompt)))
            singles.append(single)
            roots.append(prompt[-1])
    assert min(s.cache_len for s in singles) > 8  # every row past the window
