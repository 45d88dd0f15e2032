"""Bad input, table-driven (issue 16): every command and the Python API, each case one line of error
that names the problem, exit code 2 (or the documented exception), and no traceback.

The CLI cases run in-process through typer's runner (no torch start-up per case); a few run as real
subprocesses where the process matters (an interrupt). Corrupted files are made here from the real
models in ../shared and the shipped default pair.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import treespec
from conftest import STORIES260K, ship_own_code
from treespec.cli.app import app

S260 = str(STORIES260K)
PAIR = ["--target", S260, "--drafter", S260, "-D", "layers=3"]
RUN = ["run", "--max-new-tokens", "4", "--prompt", "Once"]
runner = CliRunner()


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, str]:
    """Damaged copies of real files: model weights, configs, tokenizers, EAGLE heads, results."""
    root = tmp_path_factory.mktemp("bad-input")
    out: dict[str, str] = {}

    def model_copy(name: str) -> Path:
        path = root / name
        shutil.copytree(STORIES260K, path, ignore=shutil.ignore_patterns("llama2c"))
        out[name] = str(path)
        return path

    (model_copy("zero-weights") / "model.safetensors").write_bytes(b"")
    weights = (STORIES260K / "model.safetensors").read_bytes()
    (model_copy("cut-weights") / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (model_copy("bad-config") / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (model_copy("bad-tokenizer") / "tokenizer.json").write_text("{ not json")
    (model_copy("no-weights") / "model.safetensors").unlink()
    ship_own_code(model_copy("custom-code"))
    _shrink_vocabulary(model_copy("small-vocab"), 256)

    head = Path(treespec.__file__).parent / "default_pair" / "eagle"

    def head_copy(name: str) -> Path:
        path = root / name
        shutil.copytree(head, path)
        out[name] = str(path)
        return path

    hw = (head / "model.safetensors").read_bytes()
    (head_copy("head-cut") / "model.safetensors").write_bytes(hw[: len(hw) // 3])
    (head_copy("head-bad-config") / "config.json").write_text("[1, 2")
    pickled = head_copy("head-pickle")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(_pickle_bomb(root / "pwned"))
    out["pwned"] = str(root / "pwned")
    eagle3 = head_copy("head-eagle3")
    config = json.loads((eagle3 / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    (eagle3 / "config.json").write_text(json.dumps(config))
    _widen_fc(eagle3 / "model.safetensors")  # EAGLE-3 fuses three feature layers: fc is [H, 3H]

    (root / "results").mkdir()
    (root / "results" / "results.json").write_text('{"rows": [')
    out["results"] = str(root / "results" / "results.json")
    (root / "partial").mkdir()  # a results.json with rows but without the fields the page reads
    (root / "partial" / "results.json").write_text('{"rows": [], "dataset": "humaneval", "prompts": 1}')
    out["partial"] = str(root / "partial")
    (root / "latin1.txt").write_bytes("Il était une fois".encode("latin-1"))
    out["latin1"] = str(root / "latin1.txt")
    (root / "afile").write_text("x")
    out["afile"] = str(root / "afile")
    out["root"] = str(root)
    _issue27_files(root, out, model_copy, head_copy)
    return out


def _issue27_files(root: Path, out: dict[str, str], model_copy, head_copy) -> None:
    """Issue 27 (9-11): cost profiles that are not profiles, configs that ask for more than the weights
    hold or the machine has, a broken chat template, a pipe, a prompt file with a null prompt."""
    import os

    from treespec.cost import CostModel

    (root / "profile-list.json").write_text("[1, 2]")
    raw = json.loads(CostModel().to_json())
    raw["verify"]["ys"][0], raw["verify"]["counts"][0] = float("nan"), 1.0
    (root / "profile-nan.json").write_text(json.dumps(raw))
    for name in ("profile-list", "profile-nan"):
        out[name] = str(root / f"{name}.json")
    os.mkfifo(root / "fifo")
    out["fifo"] = str(root / "fifo")
    (root / "null-prompt.jsonl").write_text('{"prompt": "Once upon"}\n{"prompt": null}\n')
    out["null-prompt"] = str(root / "null-prompt.jsonl")
    (root / "bad-turns.jsonl").write_text('{"turns": ["Once", 5]}\n')
    out["bad-turns"] = str(root / "bad-turns.jsonl")
    for name, change in (("deep-config", {"num_hidden_layers": 100_000}), ("huge-config", {"vocab_size": 10**9})):
        path = model_copy(name)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **change}))
    deep_head = head_copy("head-deep")
    config = json.loads((deep_head / "config.json").read_text())
    (deep_head / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    template = model_copy("broken-template")
    tok_config = json.loads((template / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{% for m in messages %}{{ m['content'] | nosuchfilter }}{% endfor %}"
    (template / "tokenizer_config.json").write_text(json.dumps(tok_config))


def _pickle_bomb(marker: Path) -> bytes:
    """A pickle that would create ``marker`` when unpickled without weights_only."""
    import pickle

    class Bomb:
        def __reduce__(self):
            return (Path.touch, (marker,))

    return pickle.dumps({"fc.weight": Bomb()})


def _shrink_vocabulary(path: Path, rows: int) -> None:
    """Keep the tokenizer but only the first ``rows`` embeddings (a draft that cannot read every token)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if "embed_tokens" in n or "lm_head" in n]:
        tensors[name] = tensors[name][:rows].contiguous()
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = rows
    (path / "config.json").write_text(json.dumps(config))


def _widen_fc(path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    fc = tensors["fc.weight"]  # [H, 2H]
    h = fc.shape[0]
    tensors["fc.weight"] = torch.cat([fc, fc[:, :h]], dim=1).contiguous()  # [H, 3H]
    save_file(tensors, path)


def one_line_error(result) -> str:
    """The one ``error: ...`` line of a failed command (and nothing else on stderr but warnings)."""
    text = result.stderr if hasattr(result, "stderr") else result.output
    assert "Traceback" not in text and "Traceback" not in result.output, text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [
        line for line in text.splitlines() if line.startswith(("error:", "Error:"))
    ]  # ours, or click's usage error
    assert len(errors) == 1, text
    return errors[0]


# (case id, argv builder given the `bad` files, a regex the error line must match)
CLI_CASES = [
    # --- run: names, options, models
    ("run-unknown-builder", lambda b: [*RUN, *PAIR, "--builder", "opt-tre"], "did you mean 'opt-tree'"),
    ("run-unknown-drafter", lambda b: [*RUN, "--target", S260, "--drafter", "eagel"], "did you mean 'eagle'"),
    ("run-budget-zero", lambda b: [*RUN, *PAIR, "-B", "nodes=0"], "nodes"),
    ("run-budget-text", lambda b: [*RUN, *PAIR, "-B", "nodes=many"], "valid integer"),
    ("run-budget-huge", lambda b: [*RUN, *PAIR, "-B", "nodes=100000"], "verifies at most 512"),
    ("run-unknown-option", lambda b: [*RUN, *PAIR, "-B", "depth=3"], "unknown option 'depth'"),
    ("run-option-twice", lambda b: [*RUN, *PAIR, "-B", "nodes=5", "-B", "nodes=7"], "'nodes' is given twice"),
    ("run-top-p-range-greedy", lambda b: [*RUN, *PAIR, "--top-p", "1.5"], "top_p must be in"),
    (
        "run-draft-temperature-zero",
        lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--draft-temperature", "0"],
        "draft_temperature",
    ),
    ("run-threads-zero", lambda b: [*RUN, *PAIR, "--threads", "0"], "threads"),
    ("run-prompt-and-file", lambda b: [*RUN, *PAIR, "--prompt-file", b["latin1"]], "not both"),
    (
        "bench-spec-twice",
        lambda b: [
            "bench",
            "--dataset",
            "tinystories",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--builder",
            "chain k=2 k=3",
            "--limit",
            "1",
            "--out",
            str(Path(b["root"]) / "b2"),
        ],
        "given twice",
    ),
    ("run-option-no-value", lambda b: [*RUN, *PAIR, "--builder", "chain", "-B", "k"], "name=value"),
    (
        "run-draft-layers-beyond",
        lambda b: [*RUN, "--target", S260, "--drafter", S260, "-D", "layers=99"],
        "has 5 decoder layers",
    ),
    ("run-self-layers-beyond", lambda b: [*RUN, "--target", S260, "--drafter", "self", "-D", "layers=9"], "layers"),
    ("run-target-zero-weights", lambda b: [*RUN, "--target", b["zero-weights"], "--drafter", "ngram"], "damaged"),
    ("run-target-cut-weights", lambda b: [*RUN, "--target", b["cut-weights"], "--drafter", "ngram"], "damaged"),
    ("run-draft-cut-weights", lambda b: [*RUN, "--target", S260, "--drafter", b["cut-weights"]], "damaged"),
    ("run-target-bad-config", lambda b: [*RUN, "--target", b["bad-config"], "--drafter", "ngram"], "bad-config"),
    (
        "run-target-bad-tokenizer",
        lambda b: [*RUN, "--target", b["bad-tokenizer"], "--drafter", "ngram"],
        "bad-tokenizer",
    ),
    ("run-target-no-weights", lambda b: [*RUN, "--target", b["no-weights"], "--drafter", "ngram"], "no-weights"),
    (
        "run-target-custom-code",
        lambda b: [*RUN, "--target", b["custom-code"], "--drafter", "ngram"],
        r"ships its own Python code.*--trust-remote-code to `treespec run`",
    ),
    (
        "run-draft-custom-code",
        lambda b: [*RUN, "--target", S260, "--drafter", b["custom-code"]],
        r"draft model .*ships its own Python code.*-D trust_remote_code=true",
    ),
    (
        "run-draft-small-vocab",
        lambda b: [*RUN, "--target", S260, "--drafter", b["small-vocab"]],
        "embeds 256 tokens but the target's tokenizer has 512",
    ),
    ("run-target-missing-dir", lambda b: [*RUN, "--target", "/nonexistent/model", "--drafter", "ngram"], "nonexistent"),
    ("run-target-not-a-dir", lambda b: [*RUN, "--target", b["afile"], "--drafter", "ngram"], "afile"),
    (
        "run-hub-offline",
        lambda b: [*RUN, "--target", "meta-llama/Llama-2-7b-hf", "--drafter", "llama-68m"],
        "cache|cannot be reached|HF_HUB_OFFLINE",
    ),
    ("run-dtype", lambda b: [*RUN, *PAIR, "--dtype", "float12"], "unknown dtype 'float12'"),
    ("run-device-cuda", lambda b: [*RUN, *PAIR, "--device", "cuda"], "not available"),
    ("run-device-foo", lambda b: [*RUN, *PAIR, "--device", "foo"], "unknown device 'foo'"),
    ("run-max-new-zero", lambda b: ["run", *PAIR, "--max-new-tokens", "0", "--prompt", "Once"], "max_new_tokens"),
    (
        "run-prompt-too-long",
        lambda b: ["run", *PAIR, "--max-new-tokens", "4", "--prompt", "Once upon a time " * 200],
        "context is 512",
    ),
    ("run-prompt-file-missing", lambda b: [*RUN[:3], *PAIR, "--prompt-file", "/nonexistent.txt"], "nonexistent"),
    ("run-prompt-file-latin1", lambda b: [*RUN[:3], *PAIR, "--prompt-file", b["latin1"]], "UTF-8"),
    ("run-prompt-file-dir", lambda b: [*RUN[:3], *PAIR, "--prompt-file", b["root"]], "directory"),
    ("run-temperature-negative", lambda b: [*RUN, *PAIR, "--temperature", "-1"], "temperature"),
    ("run-top-p-range", lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--top-p", "1.5"], "top.p"),
    ("run-top-k-negative", lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--top-k", "-3"], "top.k"),
    ("run-rule-unknown", lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--sampling-rule", "magic"], "rule"),
    ("run-eagle-needs-head", lambda b: [*RUN, "--target", S260, "--drafter", "eagle"], "head"),
    (
        "run-eagle-head-missing",
        lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", "head=/nonexistent/head"],
        "EAGLE head '/nonexistent/head': /nonexistent/head does not exist",
    ),
    (
        "run-eagle-head-cut",
        lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-cut']}"],
        "head",
    ),
    (
        "run-eagle-head-bad-config",
        lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-bad-config']}"],
        "config",
    ),
    (
        "run-eagle-head-pickle",
        lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-pickle']}"],
        "head",
    ),
    (
        "run-eagle3-head",
        lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-eagle3']}"],
        "EAGLE-3|eagle-3|3",
    ),
    (
        "run-compose-one-part",
        lambda b: [*RUN, "--target", S260, "--drafter", "compose", "-D", "parts=ngram"],
        "two or more parts",
    ),
    (
        "run-compose-bad-prefix",
        lambda b: [*RUN, "--target", S260, "--drafter", "ngram+ngram", "-D", "3.max_ngram=2"],
        "names no part",
    ),
    ("run-datastore-no-corpus", lambda b: [*RUN, "--target", S260, "--drafter", "datastore"], "corpus"),
    (
        "run-datastore-missing-corpus",
        lambda b: [*RUN, "--target", S260, "--drafter", "datastore", "-D", "corpus=/nonexistent.txt"],
        "nonexistent",
    ),
    ("run-static-bad-shape", lambda b: [*RUN, *PAIR, "--builder", "static", "-B", "shape=nope"], "shape"),
    ("run-sequoia-no-acceptance", lambda b: [*RUN, *PAIR, "--builder", "sequoia"], "acceptance"),
    # --- tree show
    (
        "tree-show-unknown-builder",
        lambda b: ["tree", "show", *PAIR, "--builder", "opt-tre", "--prompt", "Once"],
        "did you mean",
    ),
    (
        "tree-show-dot-missing-dir",
        lambda b: ["tree", "show", *PAIR, "--prompt", "Once", "--dot", "/nonexistent/d/t.dot"],
        "nonexistent",
    ),
    (
        "tree-show-png-missing-dir",
        lambda b: ["tree", "show", *PAIR, "--prompt", "Once", "--png", "/nonexistent/d/t.png"],
        "nonexistent",
    ),
    # --- bench and bench-report
    (
        "bench-dataset-unknown",
        lambda b: ["bench", "--dataset", "nope", *PAIR[:2], "--drafter", "ngram", "--limit", "1"],
        "nope",
    ),
    (
        "bench-dataset-passwd",
        lambda b: [
            "bench",
            "--dataset",
            "/etc/passwd",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--limit",
            "1",
            "--out",
            str(Path(b["root"]) / "b1"),
        ],
        "passwd",
    ),
    (
        "bench-out-is-a-file",
        lambda b: [
            "bench",
            "--dataset",
            "tinystories",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            b["afile"],
        ],
        "afile",
    ),
    (
        "bench-out-under-a-file",
        lambda b: [
            "bench",
            "--dataset",
            "tinystories",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            b["afile"] + "/x",
        ],
        "afile",
    ),
    (
        "bench-out-proc",
        lambda b: [
            "bench",
            "--dataset",
            "tinystories",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            "/proc/treespec-bench",
        ],
        "proc",
    ),
    (
        "bench-bad-spec",
        lambda b: [
            "bench",
            "--dataset",
            "tinystories",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--builder",
            "opt-tree nodes=x",
            "--limit",
            "1",
        ],
        "nodes",
    ),
    ("bench-report-corrupt", lambda b: ["bench-report", str(Path(b["results"]).parent.parent)], "results.json"),
    ("bench-report-missing-fields", lambda b: ["bench-report", b["partial"]], "has no"),  # a KeyError traceback before
    ("bench-out-empty", lambda b: ["bench", *PAIR[:2], "--drafter", "ngram", "--out", ""], "--out is empty"),
    # --- training, calibration, measurement, datastore
    (
        "train-eagle-no-data",
        lambda b: ["train", "eagle", "--target", S260, "--out", str(Path(b["root"]) / "h")],
        "data",
    ),
    (
        "train-eagle-bad-dataset",
        lambda b: ["train", "eagle", "--target", S260, "--data", "nope", "--out", str(Path(b["root"]) / "h2")],
        "nope",
    ),
    ("train-pair-bad-size", lambda b: ["train", "pair", "--out", str(Path(b["root"]) / "p"), "--steps", "0"], "steps"),
    (
        "train-prompts-not-chat",
        lambda b: ["train", "prompts", "--target", S260, "--out", str(Path(b["root"]) / "q.jsonl")],
        "no chat template",
    ),
    (
        "train-prompts-not-jsonl",
        lambda b: ["train", "prompts", "--target", S260, "--out", str(Path(b["root"]) / "q.txt")],
        "give a .jsonl file",
    ),
    (
        "train-prompts-bad-temperature",
        lambda b: ["train", "prompts", "--out", str(Path(b["root"]) / "q.jsonl"), "--temperature", "0"],
        "--temperature must be",
    ),
    (
        "train-eagle-init-eagle3",
        lambda b: ["train", "eagle", "--data", "x.jsonl", "--out", "h", "--version", "3", "--init", "smollm2-eagle"],
        "drop --init",
    ),
    ("calibrate-drafter-plugin", lambda b: ["calibrate", "--drafter", "eagle"], "not the drafter 'eagle'"),
    (
        "calibrate-bad-target",
        lambda b: ["calibrate", "--target", "/nonexistent/model", "--drafter", S260],
        "nonexistent",
    ),
    (
        "sequoia-measure-bad-dataset",
        lambda b: [
            "sequoia-measure",
            "--target",
            S260,
            "--drafter",
            S260,
            "--layers",
            "3",
            "--dataset",
            "nope",
            "--out",
            str(Path(b["root"]) / "a.json"),
        ],
        "nope",
    ),
    (
        "datastore-build-missing",
        lambda b: ["datastore", "build", "/nonexistent/corpus.txt", "--target", S260],
        "nonexistent",
    ),
    ("datastore-build-latin1", lambda b: ["datastore", "build", b["latin1"], "--target", S260], "UTF-8"),
]


# Issue 27 (9-11): each was a traceback, a crash, an allocation of gigabytes, a misleading message or
# input silently read as something else before.
def OUT(b: dict[str, str], name: str) -> list[str]:
    return ["--out", str(Path(b["root"]) / name)]


AUTO = ["-B", "nodes=auto"]
BENCH = ["bench", "--dataset", "tinystories", "--target", S260, "--limit", "1", "--max-new-tokens", "4"]
MEASURE = [
    "--target",
    S260,
    "--drafter",
    S260,
    "--layers",
    "3",
    "--dataset",
    "tinystories",
    "--limit",
    "1",
    "--max-new-tokens",
    "4",
]
TRAIN_EAGLE = [
    "train",
    "eagle",
    "--target",
    S260,
    "--data",
    "tinystories",
    "--limit",
    "4",
    "--max-new-tokens",
    "4",
    "--epochs",
    "1",
]
TRAIN_BLOCK = ["train", "block", *TRAIN_EAGLE[2:]]
TRAIN_PAIR = ["train", "pair", "--steps", "1", "--draft-steps", "1", "--max-files", "4"]
CLI_CASES += [
    # --- 9: cost profiles (-B profile=FILE): a traceback each, a pipe hung
    (
        "run-profile-missing",
        lambda b: [*RUN, *PAIR, *AUTO, "-B", "profile=/nonexistent/p.json"],
        r"opt-tree: profile /nonexistent/p.json: no such file; give a file written by `treespec profile --out FILE`",
    ),
    ("run-profile-list", lambda b: [*RUN, *PAIR, *AUTO, "-B", f"profile={b['profile-list']}"], "a JSON list"),
    ("run-profile-not-json", lambda b: [*RUN, *PAIR, *AUTO, "-B", f"profile={b['latin1']}"], "not UTF-8|not JSON"),
    ("run-profile-dir", lambda b: [*RUN, *PAIR, *AUTO, "-B", f"profile={b['root']}"], "is a directory"),
    ("run-profile-fifo", lambda b: [*RUN, *PAIR, *AUTO, "-B", f"profile={b['fifo']}"], "not a regular file"),
    (
        "run-profile-nan",
        lambda b: [*RUN, *PAIR, *AUTO, "-B", f"profile={b['profile-nan']}"],
        "curve 'verify': ys holds a negative or non-finite value",
    ),
    (
        "run-profile-fixed-budget",
        lambda b: [*RUN, *PAIR, "-B", "nodes=5", "-B", f"profile={b['profile-nan']}"],
        "profile= plans nodes=auto only",
    ),
    # --- 10: oversized requests, refused before allocating
    (
        "run-eagle2-top-k-200",
        lambda b: [*RUN, *PAIR, "--builder", "eagle2", "-B", "top_k=200"],
        r"drafts up to 200,200 nodes per step.*needs about 128.0 GiB.*lower its top_k or depth",
    ),
    (
        "run-config-layers-100000",
        lambda b: [*RUN, "--target", b["deep-config"], "--drafter", "ngram"],
        r"config.json says num_hidden_layers 100,000 but the weights in .* hold 5 layers",
    ),
    (
        "run-config-oversized",
        lambda b: [*RUN, "--target", b["huge-config"], "--drafter", "ngram"],
        r"parameters by its config.json\) needs about .* GiB, more than the .* available",
    ),
    (
        "run-eagle-head-layers-100000",
        lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-deep']}"],
        r"config.json says num_hidden_layers 100,000 but its weights hold 1",
    ),
    ("run-threads-100000", lambda b: [*RUN, *PAIR, "--threads", "100000"], r"more threads than .* use at most \d+"),
    (
        "bench-threads-100000",
        lambda b: [*BENCH, "--drafter", "ngram", "--threads", "100000", *OUT(b, "b-t")],
        "use at most",
    ),
    (
        "profile-threads-100000",
        lambda b: ["profile", "--target", S260, "--drafter", "ngram", "--threads", "100000"],
        "use at most",
    ),
    (
        "sequoia-measure-ranks-1e9",
        lambda b: ["sequoia-measure", *MEASURE, "--ranks", "1000000000", "--out", str(Path(b["root"]) / "acc.json")],
        r"--ranks 1000000000 is more ranks than the vocabulary has tokens \(512\)",
    ),
    (
        "train-pair-huge-model",
        lambda b: [*TRAIN_PAIR, "--target-layers", "10000000", *OUT(b, "p-huge")],
        r"training the target \(.* parameters.*\) needs about .* GiB",
    ),
    (
        "train-eagle-layers-100000",
        lambda b: [*TRAIN_EAGLE, "--layers", "100000", *OUT(b, "h-deep")],
        r"an EAGLE head of 100,000 layers .* needs about",
    ),
    # --- 11: tracebacks
    ("run-seed-2-64", lambda b: [*RUN, *PAIR, "--seed", str(2**64)], r"--seed 18446744073709551616 is out of range"),
    ("bench-seed-2-64", lambda b: [*BENCH, "--drafter", "ngram", "--seed", str(2**64), *OUT(b, "b-s")], "out of range"),
    ("train-pair-seed-2-63", lambda b: [*TRAIN_PAIR, "--seed", str(2**63), *OUT(b, "p-seed")], "out of range"),
    ("run-device-meta", lambda b: [*RUN, *PAIR, "--device", "meta"], "holds tensor shapes but no values"),
    ("tree-show-device-meta", lambda b: ["tree", "show", *PAIR, "--prompt", "Once", "--device", "meta"], "no values"),
    ("sequoia-measure-device-meta", lambda b: ["sequoia-measure", *MEASURE, "--device", "meta"], "no values"),
    (
        "run-chat-template-broken",
        lambda b: [*RUN, "--target", b["broken-template"], "--drafter", "ngram", "--chat"],
        r"chat template fails on this conversation .*fix chat_template in its tokenizer_config.json",
    ),
    (
        "train-eagle-lr-nan",
        lambda b: [*TRAIN_EAGLE, "--lr", "nan", *OUT(b, "h-lr")],
        "--lr must be a finite number > 0",
    ),
    (
        "train-eagle-max-new-zero",
        lambda b: [*TRAIN_EAGLE[:8], "--max-new-tokens", "0", *OUT(b, "h-m")],
        "--max-new-tokens must be > 0",
    ),
    ("train-pair-lr-nan", lambda b: [*TRAIN_PAIR, "--lr", "nan", *OUT(b, "p-lr")], "--lr must be a finite number > 0"),
    (
        "train-pair-vocab-1",
        lambda b: [*TRAIN_PAIR, "--vocab-size", "1", *OUT(b, "p-v")],
        "--vocab-size must be between",
    ),
    (
        "bench-baseline-k-text",
        lambda b: [
            *BENCH,
            "--drafter",
            f"{S260} layers=3",
            "--baseline",
            "hf-assisted num_assistant_tokens=x",
            *OUT(b, "b-k"),
        ],
        "num_assistant_tokens must be a whole number > 0, got 'x'",
    ),
    (
        "bench-baseline-confidence-nan",
        lambda b: [
            *BENCH,
            "--drafter",
            f"{S260} layers=3",
            "--baseline",
            "hf-assisted assistant_confidence_threshold=nan",
            *OUT(b, "b-c"),
        ],
        r"assistant_confidence_threshold must be a number in \[0, 1\]",
    ),
    (
        "bench-baseline-lookup-text",
        lambda b: [*BENCH, "--drafter", "ngram", "--baseline", "hf-lookup prompt_lookup_num_tokens=x", *OUT(b, "b-l")],
        "whole number > 0",
    ),
    (
        "bench-baseline-lookup-unknown",
        lambda b: [*BENCH, "--drafter", "ngram", "--baseline", "hf-lookup n=3", *OUT(b, "b-u")],
        r"hf-lookup: unknown setting\(s\) \['n'\]",
    ),
    ("sequoia-measure-out-dir", lambda b: ["sequoia-measure", *MEASURE, "--out", b["root"]], "is a directory"),
    ("calibrate-out-dir", lambda b: ["calibrate", *MEASURE, "--out", b["root"]], "is a directory"),
    (
        "datastore-build-out-dir",
        lambda b: ["datastore", "build", b["null-prompt"], "--target", S260, "--out", b["root"]],
        "is a directory",
    ),
    # --- 11: inputs silently misread
    (
        "run-batch-prompt-null",
        lambda b: ["run", *PAIR, "--max-new-tokens", "4", "--prompt-file", b["null-prompt"], "--batch-size", "2"],
        r"line 2: 'prompt' must be text, got null",
    ),
    (
        "run-batch-turns-not-text",
        lambda b: ["run", *PAIR, "--max-new-tokens", "4", "--prompt-file", b["bad-turns"], "--batch-size", "2"],
        r"'turns' must be a non-empty list of texts",
    ),
    ("sequoia-measure-skip-negative", lambda b: ["sequoia-measure", *MEASURE, "--skip", "-1"], "--skip must be >= 0"),
    ("calibrate-skip-negative", lambda b: ["calibrate", *MEASURE, "--skip", "-1"], "--skip must be >= 0"),
    (
        "train-eagle-offset-negative",
        lambda b: [*TRAIN_EAGLE, "--offset", "-1", *OUT(b, "h-o")],
        "--offset must be >= 0",
    ),
    ("train-eagle-noise-negative", lambda b: [*TRAIN_EAGLE, "--noise", "-1", *OUT(b, "h-n")], "--noise must be"),
    ("train-eagle-lr-inf", lambda b: [*TRAIN_EAGLE, "--lr", "inf", *OUT(b, "h-i")], "--lr must be a finite"),
    ("train-block-lr-inf", lambda b: [*TRAIN_BLOCK, "--lr", "inf", *OUT(b, "b-i")], "--lr must be a finite"),
    (
        "train-block-offset-negative",
        lambda b: [*TRAIN_BLOCK, "--offset", "-1", *OUT(b, "b-o")],
        "--offset must be >= 0",
    ),
    ("train-eagle-threads-zero", lambda b: [*TRAIN_EAGLE, "--threads", "0", *OUT(b, "h-t")], "--threads must be > 0"),
    # --device: one line, before the target loads or --out is made (cuda:7 is missing here and on most GPU hosts)
    (
        "train-eagle-device-bogus",
        lambda b: [*TRAIN_EAGLE, "--device", "bogus", *OUT(b, "h-dv")],
        "unknown device 'bogus'",
    ),
    ("train-eagle-device-cuda7", lambda b: [*TRAIN_EAGLE, "--device", "cuda:7", *OUT(b, "h-c7")], "is not available"),
    ("train-block-device-meta", lambda b: [*TRAIN_BLOCK, "--device", "meta", *OUT(b, "b-m")], "no values"),
    (
        "train-pair-device-bogus",
        lambda b: [*TRAIN_PAIR, "--device", "bogus", *OUT(b, "p-dv")],
        "unknown device 'bogus'",
    ),
    (
        "train-prompts-device-bogus",
        lambda b: ["train", "prompts", "--out", str(Path(b["root"]) / "d.jsonl"), "--device", "bogus"],
        "unknown device 'bogus'",
    ),
    (
        "train-eagle-gen-batch-zero",
        lambda b: [*TRAIN_EAGLE, "--gen-batch-size", "0", *OUT(b, "h-g")],
        "--gen-batch-size must be > 0",
    ),
    (
        "train-pair-max-files-negative",
        lambda b: [*TRAIN_PAIR[:-2], "--max-files", "-1", *OUT(b, "p-f")],
        "--max-files must be > 0",
    ),
    ("train-pair-minutes-nan", lambda b: [*TRAIN_PAIR, "--minutes", "nan", *OUT(b, "p-m")], "--minutes must be"),
    (
        "run-compose-weights-nan",
        lambda b: [*RUN, "--target", S260, "--drafter", "ngram+ngram", "-D", "merge=mix", "-D", "weights=nan,1"],
        "finite number",
    ),
    (
        "run-draft-temperature-inf",
        lambda b: [*RUN, "--target", S260, "--drafter", S260, "-D", "temperature=inf"],
        "finite number",
    ),
    (
        "tree-show-max-nodes-zero",
        lambda b: ["tree", "show", *PAIR, "--prompt", "Once", "--max-nodes", "0"],
        "--max-nodes must be > 0",
    ),
    (
        "bench-baseline-assisted-without-draft",
        lambda b: [*BENCH, "--drafter", "ngram", "--baseline", "hf-assisted", *OUT(b, "b-a")],
        "no --drafter names one",
    ),
    ("run-target-empty", lambda b: [*RUN, "--target", "", "--drafter", "ngram"], "--target is empty"),
    # --- 11: misleading messages
    (
        "run-prompt-file-fifo",
        lambda b: [*RUN[:3], *PAIR, "--prompt-file", b["fifo"]],
        "is not a regular file \\(a pipe or a device\\)",
    ),
    (
        "datastore-build-corpus-fifo",
        lambda b: ["datastore", "build", b["fifo"], "--target", S260],
        "not a regular file",
    ),
]


@pytest.mark.parametrize("case, argv, pattern", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line(bad, monkeypatch, case, argv, pattern):
    import re

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(app, argv(bad))
    line = one_line_error(result)
    assert result.exit_code == 2, (result.exit_code, line)
    assert re.search(pattern, line, re.IGNORECASE), line
    assert not Path(bad["pwned"]).exists(), "a pickle from disk ran code"


def test_refused_custom_code_prints_one_line_and_nothing_else(bad):
    """The refusal is the only line on stderr (transformers' config-type warning stays quiet)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "treespec.cli.app", *RUN, "--target", S260, "--drafter", bad["custom-code"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: draft model"), proc.stderr


def test_a_damaged_saved_profile_is_one_warning_line_and_the_run_goes_on(tmp_path, monkeypatch):
    """Issue 27 (9): a saved profile that is a JSON list made every default run fail until deleted by
    hand; now a real `treespec run` prints one warning line, measures again and decodes (exit 0)."""
    import os
    import subprocess
    import sys

    import torch

    from treespec.cost import profile_path
    from treespec.plugins.cost_aware import profile_key

    monkeypatch.setenv("TREESPEC_PROFILE_DIR", str(tmp_path))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the profile key of a run with --threads 1
    try:
        dec = treespec.Decoder(S260, "ngram", "opt-tree", builder_options={"profile": "none"})
        path = profile_path(profile_key(dec.target, dec.drafter))
    finally:
        torch.set_num_threads(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[1, 2]")
    cmd = [sys.executable, "-m", "treespec.cli.app", *RUN, "--target", S260, "--drafter", "ngram", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "profile" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: the saved cost profile {path} is not usable"), (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and "ProfileWarning" not in proc.stderr


def test_running_out_of_threads_while_loading_does_not_blame_the_files(monkeypatch):
    """Issue 27 (11): --threads 100000 crashed, and the error said a file was damaged (download again)."""
    from transformers import AutoModelForCausalLM

    def no_threads(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_threads)
    with pytest.raises(treespec.ModelLoadError, match="ran out of threads while loading") as err:
        treespec.TargetModel.load(S260)
    assert "damaged" not in str(err.value)


# ---------------------------------------------------------------------------------------------------
# interrupts: what was done survives


def test_run_json_interrupted_prints_the_partial_object_and_exits_130(monkeypatch):
    """Ctrl-C during `run --json`: the JSON object of what was generated, stop_reason "interrupted"."""
    from treespec import step

    real, calls = step.step_rows, []

    def interrupt_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(step, "step_rows", interrupt_on_third)  # the decode loop's step (treespec/engine.py)
    result = runner.invoke(app, ["run", *PAIR, "--prompt", "Once upon a time", "--max-new-tokens", "64", "--json"])
    assert result.exit_code == 130, result.output
    data = json.loads(result.stdout)
    assert data["stats"]["stop_reason"] == "interrupted" and data["token_ids"] and "interrupted" in data["error"]
    assert data["stats"]["steps"] == 2 and len(data["token_ids"]) == data["stats"]["new_tokens"]
    assert one_line_error(result).startswith("error: interrupted after")


def test_run_interrupted_by_sigint_keeps_the_streamed_text(tmp_path):
    """A real SIGINT to a real `treespec run`: the text so far, the statistics line, exit 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [
        sys.executable,
        "-m",
        "treespec.cli.app",
        "run",
        "--target",
        S260,
        "--drafter",
        "ngram",
        "--builder",
        "chain",
        "-B",
        "k=1",
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "500",
        "--threads",
        "1",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)  # decoding has started once text streams
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the run finished before the interrupt arrived")
    text, err = (first + rest).decode(), err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "stop: interrupted" in err, err
    assert len(text.strip()) > 0


def test_bench_interrupted_keeps_the_finished_prompts(tmp_path, monkeypatch):
    from treespec.bench import runner as bench_runner

    real, seen = bench_runner.Bench.prompts_fit, []

    def stop_at_third_prompt(self, ids):
        seen.append(1)
        if len(seen) == 4:  # the warm-up, then prompts 0 and 1 finish; Ctrl-C during prompt 2
            raise KeyboardInterrupt
        return real(self, ids)

    monkeypatch.setattr(bench_runner.Bench, "prompts_fit", stop_at_third_prompt)
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "bench",
            "--dataset",
            "tinystories",
            "--limit",
            "4",
            "--max-new-tokens",
            "8",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--builder",
            "chain k=2",
            "--baseline",
            "none",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 130, result.output
    assert "marked partial" in one_line_error(result)
    saved = json.loads((out / "results.json").read_text())
    assert saved["partial"] is True and saved["prompts"] == 2
    assert {r["config"] for r in saved["rows"]} >= {"hf-greedy"} and len(saved["rows"]) == 2
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in steps} == {0, 1}


def test_bench_disk_full_keeps_the_last_complete_files(tmp_path, monkeypatch):
    """The disk fills while the second prompt's results are written: one line, exit 1, and the first
    prompt's results.json and steps.jsonl are whole (written to a temp file, then renamed)."""
    import errno
    import os

    real, calls = os.fsync, []

    def full_disk_on_third_file(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", full_disk_on_third_file)
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "bench",
            "--dataset",
            "tinystories",
            "--limit",
            "3",
            "--max-new-tokens",
            "8",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--builder",
            "chain k=2",
            "--baseline",
            "none",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 1, result.output
    line = one_line_error(result)
    assert "No space left on device" in line and "marked partial" in line, line
    saved = json.loads((out / "results.json").read_text())
    assert saved["partial"] is True and saved["prompts"] == 1
    steps = [json.loads(row) for row in (out / "steps.jsonl").read_text().splitlines()]
    assert steps and {s["prompt"] for s in steps} == {0}
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "steps.jsonl"]  # no temp file left


@pytest.mark.parametrize(
    "extra, ignored",
    [
        (["--top-k", "5"], "top_k=5"),
        (["--draft-temperature", "0.5"], "draft_temperature=0.5"),
        (["--sampling-rule", "specinfer"], "rule=specinfer"),
        (["--builder", "chain", "-B", "sample=true"], "sample=true"),
    ],
)
def test_options_greedy_decoding_ignores_are_one_warning_line(extra, ignored):
    """Valid sampling options under greedy decoding change nothing: said once, then decoding goes on."""
    result = runner.invoke(app, [*RUN, *PAIR, *extra])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and ignored in warnings[0] and "temperature > 0" in warnings[0], result.stderr


def test_plugins_lists_everything_and_shows_a_name_conflict(monkeypatch):
    """Two plugins claiming one name: `treespec plugins` still works and names the conflict."""
    from treespec import registry

    reg = registry.discover()
    twin = reg.builders["chain"]
    reg.add(registry.Entry("builder", twin.spec, "dupe", "fake-dup", "0.1"))
    monkeypatch.setattr(registry, "_registry", reg)
    result = runner.invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "conflict" in result.stdout and "'chain' is registered twice" in result.stdout.replace("\n", " ")
    data = json.loads(runner.invoke(app, ["plugins", "--json"]).stdout)
    assert any("TREESPEC_BLOCK_PLUGINS=dupe" in c for c in data["conflicts"])
    used = runner.invoke(app, [*RUN, *PAIR, "--builder", "chain"])
    assert used.exit_code == 2 and "registered twice" in one_line_error(used)


@pytest.mark.parametrize("command", [TRAIN_EAGLE, TRAIN_BLOCK, TRAIN_PAIR])
def test_a_missing_training_device_writes_nothing(tmp_path, command):
    """``--device`` is checked before the target loads: a device this machine lacks leaves no --out."""
    out = tmp_path / "never"
    result = runner.invoke(app, [*command, "--device", "cuda:7", "--out", str(out)])
    assert result.exit_code == 2 and "is not available" in one_line_error(result)
    assert not out.exists()
