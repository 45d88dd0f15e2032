"""EAGLE-1 heads over a reduced draft vocabulary (plugins/draft_vocab.py, ``train eagle --draft-vocab``,
drafter option ``vocab=``): trained on stories260K with 128 of its 512 tokens, the head proposes only
those tokens, its distribution is the full-vocabulary softmax restricted to them, and decoding stays
token for token the target's greedy output."""

from __future__ import annotations

import functools
import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

import treespec
from conftest import EAGLE_TEST_SETTINGS, tinystories_prompts
from treespec.errors import ConfigError
from treespec.plugins import draft_vocab
from treespec.plugins.configs import EagleConfig
from treespec.plugins.eagle import EagleDrafter
from treespec.tree import DraftTree

N = 128


@functools.cache
def small_vocab_head() -> Path:
    from treespec.plugins.eagle_train import train

    out = Path(tempfile.mkdtemp(prefix="treespec-eagle-vocab-"))
    train(EAGLE_TEST_SETTINGS(out, draft_vocab=N), log=lambda _: None)
    return out


def test_rank_tokens_is_frequency_order_with_ties_by_id():
    seqs = [torch.tensor([5, 5, 3, 9, 9, 9]), torch.tensor([3, 7])]
    assert draft_vocab.rank_tokens(seqs, 10, 3).tolist() == [9, 3, 5]  # 3 and 5 tie at 2: lower id first
    assert draft_vocab.rank_tokens(seqs, 10, 6).tolist() == [9, 3, 5, 7, 0, 1]  # unseen ids fill up


def test_training_writes_the_most_frequent_generated_tokens_and_scores_against_all():
    out = small_vocab_head()
    ids = draft_vocab.load(out, 512, "head")
    assert ids is not None and ids.numel() == N
    data = torch.load(out / "data.pt", weights_only=True)
    summary = json.loads((out / "training.json").read_text())
    n_hold = max(1, round(len(data["seqs"]) * summary["settings"]["holdout"]))
    counts = Counter(t for x in data["seqs"][n_hold:] for t in x["ids"][x["prompt_len"] :].tolist())
    want = sorted(counts, key=lambda t: (-counts[t], t))[:N]
    assert ids.tolist() == want
    assert 0.2 < summary["top1"] < 1.0  # agreement with the target's greedy token over all 512 tokens


def test_proposals_and_distribution_live_in_the_draft_vocabulary(target64):
    out = small_vocab_head()
    d = EagleDrafter(EagleConfig(head=str(out)), target64)
    full = EagleDrafter(EagleConfig(head=str(out), vocab=0), target64)  # the same head over every token
    ids = set(draft_vocab.load(out, 512, "head").tolist())
    prompt = target64.tokenizer("Once upon a time, there was a little dog").input_ids
    for dr in (d, full):
        dr.prefill(treespec.interfaces.PrefillContext(input_ids=torch.tensor(prompt), hidden=_hidden(target64, prompt)))
        dr.begin_step(prompt[-1])
    tree = DraftTree(prompt[-1])
    props = d.expand(tree, torch.tensor([0]), 8)
    full.expand(tree, torch.tensor([0]), 8)  # feeds the root's feature: distribution() reads it
    assert set(props.tokens[0].tolist()) <= ids
    q = d.distribution(tree, torch.tensor([0]))[0]  # [V]
    q_full = full.distribution(tree, torch.tensor([0]))[0]
    inside = torch.tensor(sorted(ids))
    assert (
        float(q.sum()) == pytest.approx(1.0, abs=1e-9)
        and float(q[[i for i in range(512) if i not in ids]].abs().sum()) == 0
    )
    torch.testing.assert_close(q[inside], q_full[inside] / q_full[inside].sum())  # softmax restricted to the ids


def _hidden(target, prompt):
    with torch.inference_mode():
        return target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, :-1]


@pytest.mark.parametrize("builder,options", [("opt-tree", {"nodes": 30}), ("chain", {"k": 5}), ("eagle2", None)])
def test_lossless_with_a_draft_vocabulary(target64, greedy_reference, builder, options):
    dec = treespec.Decoder(
        target64,
        drafter="eagle",
        drafter_options={"head": str(small_vocab_head()), "vocab": 64},
        builder=builder,
        builder_options=options,
    )
    assert dec.drafter.ids.numel() == 64  # vocab= keeps the 64 most frequent
    accepted = []
    for prompt in tinystories_prompts(4):
        ids = dec.encode(prompt)
        out = dec.generate(ids, max_new_tokens=64)
        want = greedy_reference(ids, 64)
        assert out.token_ids == want, greedy_reference.explain(ids, out.token_ids, want)
        accepted += [s.accepted for s in out.stats.steps]
    assert sum(accepted) / len(accepted) > 0.1


def test_vocab_option_without_a_draft_vocabulary_is_one_line(target64):
    from conftest import eagle_head_dir

    with pytest.raises(ConfigError, match="--draft-vocab"):
        EagleDrafter(EagleConfig(head=str(eagle_head_dir()), vocab=100), target64)


def test_a_damaged_draft_vocabulary_is_refused(target64, tmp_path):
    import shutil

    from safetensors.torch import save_file

    head = tmp_path / "head"
    shutil.copytree(small_vocab_head(), head)
    save_file({"ids": torch.tensor([1, 1, 2])}, str(head / draft_vocab.FILE))
    with pytest.raises(ConfigError, match="distinct token ids"):
        EagleDrafter(EagleConfig(head=str(head)), target64)
    (head / draft_vocab.FILE).write_bytes(b"junk")
    with pytest.raises(ConfigError, match="not a draft vocabulary"):
        EagleDrafter(EagleConfig(head=str(head)), target64)


def test_the_shipped_smollm2_head_is_complete_and_fits_its_target():
    """The head in the package (docs/smollm2.md): SmolLM2-135M's sizes, fp16 weights, 8,192 draft ids,
    and the records of its two training stages."""
    from safetensors import safe_open

    from treespec.catalog import PACKAGED_MODELS
    from treespec.plugins.eagle_head import load_head

    folder = PACKAGED_MODELS["smollm2-eagle"]
    head, meta = load_head(str(folder), hidden=576, vocab=49152)
    assert sum(p.numel() for p in head.parameters()) == 4_203_648 and meta["target"] == "smollm2"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    ids = draft_vocab.load(folder, 49152, "smollm2-eagle")
    assert ids is not None and ids.numel() == 8192
    assert meta["vocab"] == 4096  # the cut drafting uses unless vocab= says otherwise (docs/smollm2.md)
    base = json.loads((folder / "training-base.json").read_text())  # stage 1: instruct-mix, a new head
    assert base["settings"]["draft_vocab"] == 8192 and base["settings"]["data"] == "instruct-mix"
    tuned = json.loads((folder / "training.json").read_text())  # stage 2: SmolLM2's own chat requests
    assert Path(tuned["settings"]["data"]).name == "smollm2-magpie.jsonl" and tuned["settings"]["init"]
    assert tuned["top1_before"] < tuned["top1"]


def test_fine_tuning_starts_from_the_init_head_and_keeps_its_draft_vocabulary(tmp_path):
    """`train eagle --init HEAD`: before its first step the run's held-out agreement is the init head's,
    far above a new head's on the same prompts, and the saved head drafts over the init's vocabulary."""
    from treespec.plugins.eagle_train import train

    init = small_vocab_head()
    again = dict(offset=500, limit=60, epochs=1)  # other prompts than the init head's
    tuned = train(EAGLE_TEST_SETTINGS(tmp_path / "tuned", init=str(init), **again), log=lambda _: None)
    fresh = train(EAGLE_TEST_SETTINGS(tmp_path / "fresh", draft_vocab=N, **again), log=lambda _: None)
    assert tuned["top1_before"] > 0.2 > fresh["top1_before"] + 0.1
    assert torch.equal(draft_vocab.load(tmp_path / "tuned", 512, "t"), draft_vocab.load(init, 512, "i"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"draft_vocab": 64}, r"--draft-vocab 64: --init .* drafts over its own vocabulary \(128 tokens\); drop"),
        ({"layers": 2}, r"--init .* has 1 decoder layer\(s\): pass --layers 1"),
    ],
)
def test_fine_tuning_refuses_settings_the_init_head_cannot_take(tmp_path, overrides, message):
    from treespec.plugins.eagle_train import train

    s = EAGLE_TEST_SETTINGS(tmp_path / "x", init=str(small_vocab_head()), offset=500, limit=20, **overrides)
    with pytest.raises(ConfigError, match=message):
        train(s, log=lambda _: None)


def test_a_head_names_its_default_cut_and_vocab_overrides_it(target64, tmp_path):
    """``treespec.vocab`` in a head's config.json is the draft vocabulary used when the drafter is given
    no ``vocab=``: the first N of its ranked ids; ``vocab=`` still picks any other cut, 0 every token."""
    import shutil

    head = tmp_path / "head"
    shutil.copytree(small_vocab_head(), head)
    cfg = json.loads((head / "config.json").read_text())
    cfg.setdefault("treespec", {})["vocab"] = 32
    (head / "config.json").write_text(json.dumps(cfg))
    ranked = draft_vocab.load(head, 512, "head")
    assert EagleDrafter(EagleConfig(head=str(head)), target64).ids.tolist() == ranked[:32].tolist()
    assert EagleDrafter(EagleConfig(head=str(head), vocab=100), target64).ids.tolist() == ranked[:100].tolist()
    assert EagleDrafter(EagleConfig(head=str(head), vocab=0), target64).ids is None
    cfg["treespec"]["vocab"] = "many"
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="treespec.vocab is 'many'"):
        EagleDrafter(EagleConfig(head=str(head)), target64)


def test_the_draft_vocabulary_is_part_of_the_cost_profile_key(target64):
    """A cut changes what a draft call costs, so profiles measured over one are not read for another,
    including the cut a head names by default (no option says it)."""
    from treespec.plugins.cost_aware import drafter_key

    out = small_vocab_head()
    whole, cut = (EagleDrafter(EagleConfig(head=str(out), vocab=v), target64) for v in (None, 64))
    assert f"vocab={N}" in drafter_key(whole) and "vocab=64" in drafter_key(cut)
