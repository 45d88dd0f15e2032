"""`treespec train pair` on a tiny configuration: the corpus split, the tokenizer, training that learns
and resumes to the same weights, directories that load everywhere, lossless decoding with the new
pair, and the default sizes (draft ≤ a tenth of the target)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path, PurePosixPath

import pytest
import torch
from typer.testing import CliRunner

import treespec
from treespec.errors import ConfigError
from treespec.train.pair import WHICH, ModelSize, PairSettings, llama_config, parameter_count, train_pair
from treespec.train.pair_data import EOT_ID, included, is_held_out, load_corpus, train_tokenizer

TINY = dict(
    max_files=40,
    held_out=0.2,
    vocab_size=512,
    context=128,
    target=ModelSize(32, 2, 4, 2, 96),
    draft=ModelSize(16, 1, 2, 2, 48),
    steps=150,
    draft_steps=150,
    batch_size=4,
    lr=1e-2,
    eval_every=50,
    eval_windows=8,
    checkpoint_every=10,
    threads=1,
)
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if',
    "import os\nimport sys\n\n\nclass ",
    "    for i in range(len(items)):\n        if items[i]",
]


def tiny(out: Path, data_from: Path | None = None, **overrides) -> PairSettings:
    """Tiny settings writing to ``out``; ``data_from``: reuse that run's tokenizer and token streams."""
    if data_from is not None and not (out / "data").exists():
        shutil.copytree(data_from / "data", out / "data")
    return PairSettings(out=str(out), **(TINY | overrides))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("pair")
    return out, train_pair(tiny(out), log=lambda _: None)


def test_split_is_deterministic_disjoint_and_skips_tests_and_packages():
    a, b = load_corpus(0.2, max_files=40), load_corpus(0.2, max_files=40)
    names = lambda files: [f.rel for f in files]  # noqa: E731
    assert names(a.train) == names(b.train) and names(a.held_out) == names(b.held_out) and a.sha256 == b.sha256
    assert not set(names(a.train)) & set(names(a.held_out))
    assert names(a.train) == sorted(names(a.train))
    assert all(is_held_out(f.rel, 0.2) for f in a.held_out) and not any(is_held_out(f.rel, 0.2) for f in a.train)
    bigger = load_corpus(0.2, max_files=80)  # the split depends on the path alone
    assert set(names(a.held_out)) <= set(names(bigger.held_out))
    for rel in (
        "site-packages/numpy/core.py",
        "test/test_os.py",
        "unittest/test/test_case.py",
        "idlelib/run.py",
        "encodings/cp1252.py",
        "_sysconfigdata__linux_x86_64-linux-gnu.py",
        "config-3.11-x86_64-linux-gnu/python-config.py",
    ):
        assert not included(PurePosixPath(rel)), rel
    assert included(PurePosixPath("json/decoder.py")) and included(PurePosixPath("os.py"))


def test_tokenizer_round_trips_held_out_source_and_trains_deterministically(pair):
    from transformers import AutoTokenizer

    out, _ = pair
    tok = AutoTokenizer.from_pretrained(out / "target")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (EOT_ID, EOT_ID, 1) and len(tok) == 512
    for f in load_corpus(0.2, max_files=40).held_out:
        ids = tok(f.text).input_ids
        assert ids[0] == EOT_ID and EOT_ID not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == f.text, f.rel
    assert AutoTokenizer.from_pretrained(out / "draft").get_vocab() == tok.get_vocab()
    texts = [f.text for f in load_corpus(0.2, max_files=12).train]
    assert (
        train_tokenizer(texts, 400, 64).backend_tokenizer.to_str()
        == train_tokenizer(texts, 400, 64).backend_tokenizer.to_str()
    )


def test_training_lowers_the_held_out_loss_and_logs_it(pair):
    out, summary = pair
    for which in WHICH:
        m = summary["models"][which]
        assert m["finished"] and m["steps"] == 150 and m["tokens_seen"] == 150 * 4 * 128
        assert m["held_out_loss"] < m["held_out_loss_initial"] - 0.3, m["held_out_history"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [(e["which"], e["step"]) for e in log] == [(w, s) for w in WHICH for s in (0, 50, 100, 150)]
    facts = summary["corpus"]
    assert facts["train_files"] + facts["held_out_files"] == 40 and facts["corpus_sha256"] and facts["python"]


def test_an_interrupted_run_resumes_to_the_same_weights(pair, tmp_path):
    """Stopped at a step, then by --minutes, then resumed with ``device="cpu"`` (the device is not part
    of what a checkpoint must match): the weights are the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    b = tmp_path / "b"
    train_pair(tiny(b, pair[0]), which="target", stop_at=7, log=lambda _: None)
    assert not (b / "target").exists() and (b / "checkpoint-target.pt").is_file()
    summary = train_pair(tiny(b, pair[0], minutes=0.0005), which="target", log=lambda _: None)  # 30 ms: stops early
    assert not summary["models"]["target"]["finished"] and not (b / "target").exists()
    lines: list[str] = []
    resumed = train_pair(tiny(b, pair[0], device="cpu"), which="target", log=lines.append)  # the device: no setting
    assert any("resuming" in line for line in lines), lines
    assert resumed["settings"]["device"] == "cpu"
    wa, wb = load_file(pair[0] / "target" / "model.safetensors"), load_file(b / "target" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # = the uninterrupted run
    with pytest.raises(ConfigError, match="other settings"):
        train_pair(tiny(b, pair[0], lr=5e-3), which="target", log=lambda _: None)


def test_the_pair_loads_and_decodes_losslessly(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = pair
    for which in WHICH:
        model = AutoModelForCausalLM.from_pretrained(out / which)
        assert model.config.model_type == "llama" and model.generation_config.eos_token_id == EOT_ID
        assert AutoTokenizer.from_pretrained(out / which)(PROMPTS[0]).input_ids[0] == EOT_ID
    target = treespec.TargetModel.load(str(out / "target"), dtype="float64")  # float64: no near-tie flips
    dec = treespec.Decoder(target, drafter=str(out / "draft"), builder="opt-tree", builder_options={"nodes": 10})
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        got = dec.generate(ids, max_new_tokens=48).token_ids
        with torch.inference_mode():
            want = target.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=48,
            )[0, len(ids) :].tolist()
        assert got == want, prompt


def test_the_default_draft_has_at_most_a_tenth_of_the_targets_parameters():
    s = PairSettings(out="unused")
    target, draft = (parameter_count(llama_config(s, w)) for w in WHICH)
    assert draft * 10 <= target
    assert (target + draft) * 4 < 40e6 * 0.9  # float32 files, leaving room for an EAGLE head (≈ one layer)


def test_cli_trains_the_draft_and_refuses_bad_sizes_in_one_line(pair, tmp_path):
    from treespec.cli.app import app

    out = tmp_path / "c"
    shutil.copytree(pair[0] / "data", out / "data")
    args = [
        "train",
        "pair",
        "--out",
        str(out),
        "--max-files",
        "40",
        "--held-out",
        "0.2",
        "--vocab-size",
        "512",
        "--context",
        "128",
        "--target-hidden",
        "32",
        "--target-layers",
        "2",
        "--target-heads",
        "4",
        "--target-kv-heads",
        "2",
        "--target-intermediate",
        "96",
        "--draft-hidden",
        "16",
        "--draft-layers",
        "1",
        "--draft-heads",
        "2",
        "--draft-kv-heads",
        "2",
        "--draft-intermediate",
        "48",
        "--threads",
        "1",
    ]
    res = CliRunner().invoke(app, [*args, "--which", "draft", "--draft-steps", "6", "--eval-every", "3"])
    assert res.exit_code == 0, res.output
    assert "draft: " in res.stdout and "6 steps" in res.stdout and (out / "draft" / "model.safetensors").is_file()
    bad = CliRunner().invoke(app, [*args, "--target-heads", "5"])
    assert bad.exit_code == 2 and "must divide" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.output


def test_a_crafted_checkpoint_is_refused_and_never_run(pair, tmp_path):
    """A pickle placed where `train pair` resumes from: one line, and its code never runs."""
    import pickle

    class Bomb:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    c = tmp_path / "c"
    c.mkdir()
    (c / "checkpoint-target.pt").write_bytes(pickle.dumps({"key": Bomb()}))
    with pytest.raises(ConfigError, match="checkpoint-target.pt cannot be read safely"):
        train_pair(tiny(c, pair[0]), which="target", log=lambda _: None)
    assert not (tmp_path / "pwned").exists()
