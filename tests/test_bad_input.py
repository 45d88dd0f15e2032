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
    (root / "latin1.txt").write_bytes("Il était une fois".encode("latin-1"))
    out["latin1"] = str(root / "latin1.txt")
    (root / "afile").write_text("x")
    out["afile"] = str(root / "afile")
    out["root"] = str(root)
    return out


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
    errors = [line for line in text.splitlines() if line.startswith(("error:", "Error:"))]  # ours, or click's usage error
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
    ("run-draft-temperature-zero", lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--draft-temperature", "0"],
     "draft_temperature"),
    ("run-threads-zero", lambda b: [*RUN, *PAIR, "--threads", "0"], "threads"),
    ("run-prompt-and-file", lambda b: [*RUN, *PAIR, "--prompt-file", b["latin1"]], "not both"),
    ("bench-spec-twice", lambda b: ["bench", "--dataset", "tinystories", "--target", S260, "--drafter", "ngram",
                                    "--builder", "chain k=2 k=3", "--limit", "1", "--out", str(Path(b["root"]) / "b2")],
     "given twice"),
    ("run-option-no-value", lambda b: [*RUN, *PAIR, "--builder", "chain", "-B", "k"], "name=value"),
    ("run-draft-layers-beyond", lambda b: [*RUN, "--target", S260, "--drafter", S260, "-D", "layers=99"],
     "has 5 decoder layers"),
    ("run-self-layers-beyond", lambda b: [*RUN, "--target", S260, "--drafter", "self", "-D", "layers=9"], "layers"),
    ("run-target-zero-weights", lambda b: [*RUN, "--target", b["zero-weights"], "--drafter", "ngram"], "damaged"),
    ("run-target-cut-weights", lambda b: [*RUN, "--target", b["cut-weights"], "--drafter", "ngram"], "damaged"),
    ("run-draft-cut-weights", lambda b: [*RUN, "--target", S260, "--drafter", b["cut-weights"]], "damaged"),
    ("run-target-bad-config", lambda b: [*RUN, "--target", b["bad-config"], "--drafter", "ngram"], "bad-config"),
    ("run-target-bad-tokenizer", lambda b: [*RUN, "--target", b["bad-tokenizer"], "--drafter", "ngram"],
     "bad-tokenizer"),
    ("run-target-no-weights", lambda b: [*RUN, "--target", b["no-weights"], "--drafter", "ngram"], "no-weights"),
    ("run-target-custom-code", lambda b: [*RUN, "--target", b["custom-code"], "--drafter", "ngram"],
     r"ships its own Python code.*--trust-remote-code to `treespec run`"),
    ("run-draft-custom-code", lambda b: [*RUN, "--target", S260, "--drafter", b["custom-code"]],
     r"draft model .*ships its own Python code.*-D trust_remote_code=true"),
    ("run-draft-small-vocab", lambda b: [*RUN, "--target", S260, "--drafter", b["small-vocab"]],
     "embeds 256 tokens but the target's tokenizer has 512"),
    ("run-target-missing-dir", lambda b: [*RUN, "--target", "/nonexistent/model", "--drafter", "ngram"],
     "nonexistent"),
    ("run-target-not-a-dir", lambda b: [*RUN, "--target", b["afile"], "--drafter", "ngram"], "afile"),
    ("run-hub-offline", lambda b: [*RUN, "--target", "meta-llama/Llama-2-7b-hf", "--drafter", "llama-68m"],
     "cache|cannot be reached|HF_HUB_OFFLINE"),
    ("run-dtype", lambda b: [*RUN, *PAIR, "--dtype", "float12"], "unknown dtype 'float12'"),
    ("run-device-cuda", lambda b: [*RUN, *PAIR, "--device", "cuda"], "not available"),
    ("run-device-foo", lambda b: [*RUN, *PAIR, "--device", "foo"], "unknown device 'foo'"),
    ("run-max-new-zero", lambda b: ["run", *PAIR, "--max-new-tokens", "0", "--prompt", "Once"], "max_new_tokens"),
    ("run-prompt-too-long", lambda b: ["run", *PAIR, "--max-new-tokens", "4", "--prompt", "Once upon a time " * 200],
     "context is 512"),
    ("run-prompt-file-missing", lambda b: [*RUN[:3], *PAIR, "--prompt-file", "/nonexistent.txt"], "nonexistent"),
    ("run-prompt-file-latin1", lambda b: [*RUN[:3], *PAIR, "--prompt-file", b["latin1"]], "UTF-8"),
    ("run-prompt-file-dir", lambda b: [*RUN[:3], *PAIR, "--prompt-file", b["root"]], "directory"),
    ("run-temperature-negative", lambda b: [*RUN, *PAIR, "--temperature", "-1"], "temperature"),
    ("run-top-p-range", lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--top-p", "1.5"], "top.p"),
    ("run-top-k-negative", lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--top-k", "-3"], "top.k"),
    ("run-rule-unknown", lambda b: [*RUN, *PAIR, "--temperature", "0.7", "--sampling-rule", "magic"], "rule"),
    ("run-eagle-needs-head", lambda b: [*RUN, "--target", S260, "--drafter", "eagle"], "head"),
    ("run-eagle-head-missing", lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", "head=/nonexistent/head"], "EAGLE head '/nonexistent/head': /nonexistent/head does not exist"),
    ("run-eagle-head-cut", lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-cut']}"], "head"),
    ("run-eagle-head-bad-config", lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-bad-config']}"],
     "config"),
    ("run-eagle-head-pickle", lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-pickle']}"], "head"),
    ("run-eagle3-head", lambda b: [*RUN, "--target", "treespec-py", "--drafter", "eagle", "-D", f"head={b['head-eagle3']}"], "EAGLE-3|eagle-3|3"),
    ("run-compose-one-part", lambda b: [*RUN, "--target", S260, "--drafter", "compose", "-D", "parts=ngram"],
     "two or more parts"),
    ("run-compose-bad-prefix", lambda b: [*RUN, "--target", S260, "--drafter", "ngram+ngram", "-D", "3.max_ngram=2"],
     "names no part"),
    ("run-datastore-no-corpus", lambda b: [*RUN, "--target", S260, "--drafter", "datastore"], "corpus"),
    ("run-datastore-missing-corpus", lambda b: [*RUN, "--target", S260, "--drafter", "datastore",
                                                "-D", "corpus=/nonexistent.txt"], "nonexistent"),
    ("run-static-bad-shape", lambda b: [*RUN, *PAIR, "--builder", "static", "-B", "shape=nope"], "shape"),
    ("run-sequoia-no-acceptance", lambda b: [*RUN, *PAIR, "--builder", "sequoia"], "acceptance"),
    # --- tree show
    ("tree-show-unknown-builder", lambda b: ["tree", "show", *PAIR, "--builder", "opt-tre", "--prompt", "Once"],
     "did you mean"),
    ("tree-show-dot-missing-dir", lambda b: ["tree", "show", *PAIR, "--prompt", "Once", "--dot", "/nonexistent/d/t.dot"],
     "nonexistent"),
    ("tree-show-png-missing-dir", lambda b: ["tree", "show", *PAIR, "--prompt", "Once", "--png", "/nonexistent/d/t.png"],
     "nonexistent"),
    # --- bench and bench-report
    ("bench-dataset-unknown", lambda b: ["bench", "--dataset", "nope", *PAIR[:2], "--drafter", "ngram", "--limit", "1"],
     "nope"),
    ("bench-dataset-passwd", lambda b: ["bench", "--dataset", "/etc/passwd", "--target", S260, "--drafter", "ngram",
                                        "--limit", "1", "--out", str(Path(b["root"]) / "b1")], "passwd"),
    ("bench-out-is-a-file", lambda b: ["bench", "--dataset", "tinystories", "--target", S260, "--drafter", "ngram",
                                       "--limit", "1", "--max-new-tokens", "4", "--out", b["afile"]], "afile"),
    ("bench-out-under-a-file", lambda b: ["bench", "--dataset", "tinystories", "--target", S260, "--drafter", "ngram",
                                          "--limit", "1", "--max-new-tokens", "4", "--out", b["afile"] + "/x"], "afile"),
    ("bench-out-proc", lambda b: ["bench", "--dataset", "tinystories", "--target", S260, "--drafter", "ngram",
                                  "--limit", "1", "--max-new-tokens", "4", "--out", "/proc/treespec-bench"], "proc"),
    ("bench-bad-spec", lambda b: ["bench", "--dataset", "tinystories", "--target", S260, "--drafter", "ngram",
                                  "--builder", "opt-tree nodes=x", "--limit", "1"], "nodes"),
    ("bench-report-corrupt", lambda b: ["bench-report", str(Path(b["results"]).parent.parent)], "results.json"),
    # --- training, calibration, measurement, datastore
    ("train-eagle-no-data", lambda b: ["train", "eagle", "--target", S260, "--out", str(Path(b["root"]) / "h")],
     "data"),
    ("train-eagle-bad-dataset", lambda b: ["train", "eagle", "--target", S260, "--data", "nope",
                                           "--out", str(Path(b["root"]) / "h2")], "nope"),
    ("train-pair-bad-size", lambda b: ["train", "pair", "--out", str(Path(b["root"]) / "p"), "--steps", "0"], "steps"),
    ("calibrate-drafter-plugin", lambda b: ["calibrate", "--drafter", "eagle"], "not the drafter 'eagle'"),
    ("calibrate-bad-target", lambda b: ["calibrate", "--target", "/nonexistent/model", "--drafter", S260], "nonexistent"),
    ("sequoia-measure-bad-dataset", lambda b: ["sequoia-measure", "--target", S260, "--drafter", S260, "--layers", "3",
                                               "--dataset", "nope", "--out", str(Path(b["root"]) / "a.json")], "nope"),
    ("datastore-build-missing", lambda b: ["datastore", "build", "/nonexistent/corpus.txt", "--target", S260],
     "nonexistent"),
    ("datastore-build-latin1", lambda b: ["datastore", "build", b["latin1"], "--target", S260], "UTF-8"),
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


# ---------------------------------------------------------------------------------------------------
# interrupts: what was done survives


def test_run_json_interrupted_prints_the_partial_object_and_exits_130(monkeypatch):
    """Ctrl-C during `run --json`: the JSON object of what was generated, stop_reason "interrupted"."""
    from treespec import step

    real, calls = step.step, []

    def interrupt_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(step, "step", interrupt_on_third)
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

    cmd = [sys.executable, "-m", "treespec.cli.app", "run", "--target", S260, "--drafter", "ngram", "--builder", "chain",
           "-B", "k=1", "--prompt", "Once upon a time", "--max-new-tokens", "500", "--threads", "1"]
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
    result = runner.invoke(app, ["bench", "--dataset", "tinystories", "--limit", "4", "--max-new-tokens", "8",
                                 "--target", S260, "--drafter", "ngram", "--builder", "chain k=2", "--baseline", "none",
                                 "--out", str(out)])
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
    result = runner.invoke(app, ["bench", "--dataset", "tinystories", "--limit", "3", "--max-new-tokens", "8",
                                 "--target", S260, "--drafter", "ngram", "--builder", "chain k=2", "--baseline", "none",
                                 "--out", str(out)])
    assert result.exit_code == 1, result.output
    line = one_line_error(result)
    assert "No space left on device" in line and "marked partial" in line, line
    saved = json.loads((out / "results.json").read_text())
    assert saved["partial"] is True and saved["prompts"] == 1
    steps = [json.loads(row) for row in (out / "steps.jsonl").read_text().splitlines()]
    assert steps and {s["prompt"] for s in steps} == {0}
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "steps.jsonl"]  # no temp file left


@pytest.mark.parametrize("extra, ignored", [
    (["--top-k", "5"], "top_k=5"), (["--draft-temperature", "0.5"], "draft_temperature=0.5"),
    (["--sampling-rule", "specinfer"], "rule=specinfer"), (["--builder", "chain", "-B", "sample=true"], "sample=true"),
])
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
