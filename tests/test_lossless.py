"""Lossless: every decoding path gives exactly the target's own greedy tokens.

Real target (stories260K, float64), real TinyStories prompts, 128 new tokens, runs that end a story
included. Drafters: the target's first 3 and first 4 layers, a random-weight tiny model sharing the
tokenizer, and the target itself. Builders: opt-tree at several n and δ, and chain.
"""

from __future__ import annotations

import pytest
import torch

import treespec
from conftest import REPO, STORIES260K, tinystories_prompts

N_PROMPTS = 20  # ≥ 20 (issue 2); with this cut, 4 of them (3, 5, 17, 18) end their story within 128 tokens
MAX_NEW = 128


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory, target64):
    """A random-weight 2-layer Llama with the target's tokenizer: a drafter that is nearly always wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("random-draft")
    LlamaForCausalLM(cfg).save_pretrained(path)
    target64.tokenizer.save_pretrained(path)
    return str(path)


DRAFTERS = {
    "layers3": lambda d: (str(STORIES260K), {"layers": 3}),
    "layers4": lambda d: (str(STORIES260K), {"layers": 4}),
    "random": lambda d: (d, {}),
    "self": lambda d: (str(STORIES260K), {}),
}
BUILDERS = {
    "opt-tree-n25": ("opt-tree", {"nodes": 25}),
    "chain-k4": ("chain", {"k": 4}),
}
SWEEP = {  # several n and δ, on the two real partial drafts
    "opt-tree-n10-d0": ("opt-tree", {"nodes": 10, "threshold": 0.0}),
    "opt-tree-n60-d0.2": ("opt-tree", {"nodes": 60, "threshold": 0.2, "max_depth": 12}),
    "opt-tree-n4-d1": ("opt-tree", {"nodes": 4, "threshold": 1.0}),
}
ACCEPTANCE = REPO / "docs" / "bench" / "acceptance-s260k-l{}.json"  # made by `treespec sequoia-measure`
OTHER_BUILDERS = {  # every other built-in builder, on the two real partial drafts
    "static-eagle-25": ("static", {"shape": "eagle-25"}),
    "static-kary-2-3": ("static", {"shape": "kary-2-3"}),
    "eagle2": ("eagle2", {"top_k": 8, "depth": 6, "total_tokens": 40}),
    "sequoia-n30": ("sequoia", {"nodes": 30, "max_depth": 8, "acceptance": "{layers}"}),
}
CASES = (
    [(d, b) for d in DRAFTERS for b in BUILDERS]
    + [(d, b) for d in ("layers3", "layers4") for b in SWEEP]
    + [(d, b) for d in ("layers3", "layers4") for b in OTHER_BUILDERS]
)


@pytest.fixture(scope="module")
def prompts(target64):
    return [target64.tokenizer(p).input_ids for p in tinystories_prompts(N_PROMPTS)]


@pytest.mark.parametrize("drafter_key,builder_key", CASES)
def test_greedy_equals_target_generate(drafter_key, builder_key, target64, greedy_reference, prompts, random_draft_dir):
    model, d_opts = DRAFTERS[drafter_key](random_draft_dir)
    builder, b_opts = {**BUILDERS, **SWEEP, **OTHER_BUILDERS}[builder_key]
    if b_opts.get("acceptance") == "{layers}":  # the vector measured for this draft
        b_opts = {**b_opts, "acceptance": str(ACCEPTANCE).format(d_opts["layers"])}
    dec = treespec.Decoder(target64, drafter=model, drafter_options=d_opts, builder=builder, builder_options=b_opts)
    failures, eos_runs, steps = [], 0, 0
    for ids in prompts:
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        if out.token_ids != want:
            failures.append(greedy_reference.explain(ids, out.token_ids, want))
        eos_runs += out.stats.stop_reason == "eos"
        steps += out.stats.n_steps
        assert sum(s.emitted for s in out.stats.steps) == len(out.token_ids)
    assert not failures, f"{len(failures)}/{len(prompts)} prompts differ:\n" + "\n".join(failures)
    assert eos_runs >= 3, "the prompt set must include runs that end at an end token"
    if drafter_key == "self":  # a drafter identical to the target is always right
        assert steps < len(prompts) * MAX_NEW / 3


def test_stops_at_the_context_limit(target64, greedy_reference):
    """A prompt close to the 512-token context: decoding stops at the limit, tokens still exact."""
    text = " ".join(tinystories_prompts(60, cut_words=0))
    ids = target64.tokenizer(text).input_ids[:500]
    dec = treespec.Decoder(target64, drafter=str(STORIES260K), drafter_options={"layers": 4}, builder="opt-tree")
    out = dec.generate(ids, max_new_tokens=MAX_NEW)
    limit = target64.max_positions
    assert out.stats.stop_reason == "context"
    assert len(ids) + len(out.token_ids) == limit
    assert out.token_ids == greedy_reference(ids, limit - len(ids))


def test_stream_callback_sees_every_token_once(target64, greedy_reference):
    ids = target64.tokenizer("Once upon a time, there was a little dog").input_ids
    dec = treespec.Decoder(target64, drafter=str(STORIES260K), drafter_options={"layers": 4}, builder="opt-tree")
    seen: list[int] = []
    out = dec.generate(ids, max_new_tokens=40, stream=seen.extend)
    assert seen == out.token_ids == greedy_reference(ids, 40)
    assert out.text.strip() == target64.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
    assert out.text.startswith(
        " named Max"
    )  # the continuation ../shared/README.md quotes, its space kept  # the README's known continuation of this prompt
