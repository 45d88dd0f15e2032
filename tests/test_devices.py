"""Targets placed by a device map (accelerate): split across devices or offloaded to disk, through
`TargetModel.load`, `Decoder` and `--device-map/--max-memory/--offload-folder` on the CLI. On this
CPU-only machine the map puts layers on "cpu" and "disk" (weights read back at every forward); the
output must equal the target's own greedy decoding in memory, token for token."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec.cli.app import app


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload")
    target = treespec.TargetModel.load(
        str(STORIES260K), dtype="float64", device_map="auto", max_memory={"cpu": "300KB"}, offload_folder=str(folder)
    )
    return target


def test_an_offloaded_target_is_lossless(offloaded, greedy_reference):
    placed = set(offloaded.model.hf_device_map.values())
    assert "disk" in placed and str(offloaded.device) == "cpu"  # inputs enter on the CPU, layers come from disk
    for drafter, options in ((str(STORIES260K), {"layers": 3}), ("ngram", None)):
        dec = treespec.Decoder(
            offloaded, drafter=drafter, drafter_options=options, builder="opt-tree", builder_options={"nodes": 12}
        )
        for prompt in tinystories_prompts(2):
            ids = dec.encode(prompt)
            out = dec.generate(ids, max_new_tokens=40)
            assert out.token_ids == greedy_reference(ids, 40), (drafter, prompt)


def test_self_drafting_an_offloaded_target_is_refused_in_one_line(offloaded):
    with pytest.raises(treespec.ConfigError, match="drafter 'self' shares the target's own layers"):
        treespec.Decoder(offloaded, drafter="self", drafter_options={"layers": 2}, builder="chain")


def test_cli_device_map_file_with_disk_offload_is_lossless(tmp_path, greedy_reference):
    mapping = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "disk",
        "model.layers.3": "cpu",
        "model.layers.4": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    (tmp_path / "map.json").write_text(json.dumps(mapping))
    prompt = tinystories_prompts(1)[0]
    res = CliRunner().invoke(
        app,
        [
            "run",
            "--target",
            str(STORIES260K),
            "--drafter",
            str(STORIES260K),
            "-D",
            "layers=2",
            "--device-map",
            str(tmp_path / "map.json"),
            "--offload-folder",
            str(tmp_path / "off"),
            "--dtype",
            "float64",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "32",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    ids = greedy_reference.target.tokenizer(prompt).input_ids
    assert json.loads(res.stdout)["token_ids"] == greedy_reference(ids, 32)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--max-memory", "cpu=1GiB"], "go with --device-map"),
        (["--device-map", "everywhere"], "use auto, balanced"),
        (["--device-map", "auto", "--max-memory", "lots"], "DEVICE=AMOUNT pairs"),
        (["--device-map", "auto", "--device", "cpu"], "not both"),
    ],
)
def test_cli_placement_bad_input_is_one_line(args, needle):
    res = CliRunner().invoke(app, ["run", "--target", str(STORIES260K), "--drafter", "ngram", "--prompt", "Hi", *args])
    assert res.exit_code == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output


def test_a_device_map_needs_accelerate(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(treespec.ConfigError, match=r"pip install 'treespec\[accelerate\]'"):
        treespec.TargetModel.load(str(STORIES260K), device_map="auto")


@pytest.mark.parametrize(
    "mapping, needle",
    [
        ({"model": "cuda:0", "lm_head": "cpu"}, "--device-map puts 'model' on 'cuda:0'"),
        ({"model": "gpu", "lm_head": "cpu"}, "--device-map puts 'model' on 'gpu'"),
        ({"modle": "cpu", "lm_head": "cpu"}, "names module(s) 'modle' that the model does not have"),
        ({"model.embed_tokns": "cpu", "": "cpu"}, "names module(s) 'model.embed_tokns'"),
    ],
)
def test_device_maps_naming_what_is_not_here_are_one_line(tmp_path, mapping, needle):
    """Issue 29 (3): a GPU in a device map on a CPU-only machine said the files were damaged; misspelt
    module names were silently ignored."""
    if any(v in ("cuda:0", "gpu") for v in mapping.values()) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = tmp_path / "map.json"
    path.write_text(json.dumps(mapping))
    res = CliRunner().invoke(
        app, ["run", "--target", str(STORIES260K), "--drafter", "ngram", "--prompt", "Hi", "--device-map", str(path)]
    )
    assert res.exit_code == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output
