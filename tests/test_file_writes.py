"""Every file treespec writes is written atomically and a failed write is one line (issue 27, item 7).

``treespec.files`` writes to a temporary file beside the target, then renames it: a disk that fills up
half-way leaves the old file whole and no temporary file behind, and the ``OSError`` becomes one
``ConfigError`` line naming the file, the reason and the fix. The commands check their output paths
before the work, not after it. A full disk is simulated by making the write primitives the old code
and the new both use (``Path.write_text``, ``Figure.savefig``, ``safetensors``' ``save_file``,
``os.fsync``, ``os.replace``) write a little and then fail with ENOSPC, as a real full disk does;
stdout to ``/dev/full`` and an ``RLIMIT_FSIZE`` file-size limit are real. Unwritable folders are made
with a path under a file: the tests may run as root, which ignores permission bits.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import one_line_error
from typer.testing import CliRunner

from conftest import STORIES260K
from treespec.cli.app import app
from treespec.errors import ConfigError

S260 = str(STORIES260K)
PAIR = ["--target", S260, "--drafter", S260, "--layers", "2"]
MEASURE = ["--dataset", "tinystories", "--limit", "2", "--skip", "0", "--max-new-tokens", "8"]
OLD = '{"old": "a complete, valid file"}\n'
runner = CliRunner()


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_disk(monkeypatch) -> None:
    """From now on every write gets its first bytes onto the disk, then fails with ENOSPC."""
    import matplotlib.figure
    import safetensors.torch

    def write_text(self, data, encoding=None, errors=None, newline=None):
        with open(self, "w", encoding=encoding or "utf-8") as fh:
            fh.write(data[:16])
        raise enospc()

    def savefig(self, fname, *args, **kwargs):
        with open(fname, "wb") as fh:
            fh.write(b"\x89PNG half")
        raise enospc()

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"half")
        raise enospc()

    def fail(*args, **kwargs):
        raise enospc()

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(os, "fsync", fail)
    monkeypatch.setattr(os, "replace", fail)


# ---------------------------------------------------------------------------------------------------
# the helper


def test_a_failed_write_leaves_the_old_file_whole_and_no_temp_file(tmp_path, monkeypatch):
    from treespec.files import write_text_atomic

    path = tmp_path / "results.json"
    path.write_text(OLD)
    fill_disk(monkeypatch)
    with pytest.raises(ConfigError) as info:
        write_text_atomic(path, json.dumps({"new": "x" * 10_000}), "--out")
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    assert "No space left on device" in message and "free some space or pick another --out" in message, message
    assert path.read_text() == OLD and [p.name for p in tmp_path.iterdir()] == ["results.json"]


@pytest.mark.parametrize("writer", ["savefig", "safetensors", "torch"])
def test_every_atomic_writer_keeps_the_old_file_on_a_full_disk(tmp_path, monkeypatch, writer):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from treespec import files

    path = tmp_path / "out.png"
    path.write_bytes(b"old")
    fig = plt.figure()
    fill_disk(monkeypatch)
    try:
        with pytest.raises(ConfigError, match="No space left on device"):
            if writer == "savefig":
                files.savefig_atomic(fig, path)
            elif writer == "safetensors":
                files.save_safetensors_atomic({"w": torch.zeros(3)}, path)
            else:
                files.save_torch_atomic({"w": torch.zeros(3)}, path)
    finally:
        plt.close(fig)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.png"]


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path):
    from treespec.files import atomic

    path = tmp_path / "a.json"
    path.write_text(OLD)
    with pytest.raises(KeyboardInterrupt), atomic(path) as tmp:
        tmp.write_text("{half")
        raise KeyboardInterrupt
    assert path.read_text() == OLD and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_written_files_get_the_usual_permissions(tmp_path):
    from treespec.files import write_text_atomic

    umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
    finally:
        os.umask(umask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600


# ---------------------------------------------------------------------------------------------------
# the commands: a full disk after the work is one line, and the old output stays whole


def _tree(flag: str):
    return lambda t, out: [
        "tree",
        "show",
        "--target",
        S260,
        "--drafter",
        S260,
        "-D",
        "layers=2",
        "--builder",
        "chain",
        "-B",
        "k=3",
        "--prompt",
        "Once",
        flag,
        str(out),
    ]


def _report(t: Path, out: Path) -> list[str]:
    run = t / "runs" / "a"
    run.mkdir(parents=True)
    env = dict.fromkeys(("date", "cpu", "threads", "python", "torch", "transformers", "treespec"), "-")
    (run / "results.json").write_text(
        json.dumps(
            {
                "mode": "batch",
                "dataset": "x",
                "prompts": 0,
                "max_new_tokens": 8,
                "target": "t",
                "command": "treespec bench",
                "environment": env,
                "rows": [],
            }
        )
    )
    return ["bench-report", str(run), "--out", str(out)]


def _datastore(t: Path, out: Path) -> list[str]:
    corpus = t / "corpus.txt"
    corpus.write_text("Once upon a time there was a cat.\n\nThe cat sat on the mat.\n")
    return ["datastore", "build", str(corpus), "--target", S260, "--out", str(out)]


WRITERS = [
    ("calibrate", lambda t, out: ["calibrate", *PAIR, *MEASURE, "--out", str(out)], "out.json"),
    (
        "sequoia-measure",
        lambda t, out: ["sequoia-measure", *PAIR, *MEASURE, "--ranks", "4", "--out", str(out)],
        "out.json",
    ),
    (
        "profile",
        lambda t, out: [
            "profile",
            "--target",
            S260,
            "--drafter",
            "ngram",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        "out.json",
    ),
    ("tree-show-dot", _tree("--dot"), "out.dot"),
    ("tree-show-png", _tree("--png"), "out.png"),
    ("bench-report", _report, "out.md"),
    ("datastore-build", _datastore, "out.npz"),
]


@pytest.mark.parametrize("case, argv, name", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_full_disk_is_one_line_and_keeps_the_old_output(tmp_path, monkeypatch, case, argv, name):
    """Before: a traceback, and (Path.write_text, savefig) the old file cut to what fitted."""
    import matplotlib.figure  # noqa: F401  (imported before the disk fills)
    import safetensors.torch  # noqa: F401

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / name
    out.write_text(OLD)
    args = argv(tmp_path, out)
    before = sorted(p.name for p in tmp_path.iterdir())
    fill_disk(monkeypatch)
    result = runner.invoke(app, args)
    line = one_line_error(result)
    assert result.exit_code == 1, (result.exit_code, line)
    assert "No space left on device" in line and str(out) in line and "free some space" in line, line
    assert out.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp file left


def test_a_file_size_limit_keeps_the_old_output_and_prints_the_measurement(tmp_path):
    """A real limit (RLIMIT_FSIZE: writes past 64 bytes fail with EFBIG) on a real process: the old
    --out stays whole, the measurement goes to stdout, one line. Before: the old file was cut to 64
    bytes and the measurement lost in a traceback."""
    import resource

    out = tmp_path / "acceptance.json"
    out.write_text(OLD)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    cmd = [
        sys.executable,
        "-m",
        "treespec.cli.app",
        "sequoia-measure",
        *PAIR,
        *MEASURE,
        "--ranks",
        "4",
        "--out",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, preexec_fn=limit, check=False)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "File too large" in errors[0] and str(out) in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and out.read_text() == OLD
    assert json.loads(proc.stdout)["acceptance"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.json"]


def test_run_json_to_a_full_device_is_one_line(tmp_path):
    """stdout on a full device (/dev/full): one line on stderr, exit 1. Before: a traceback."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
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
        "--prompt",
        "Once",
        "--max-new-tokens",
        "4",
        "--json",
    ]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            cmd,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=False,
        )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        "error: cannot write the output to stdout (No space left on device)"
    ), proc.stderr


# ---------------------------------------------------------------------------------------------------
# output paths are checked before the work


@pytest.mark.parametrize("case", ["calibrate", "sequoia-measure", "datastore-build", "profile"])
def test_an_unwritable_output_is_refused_before_the_work(tmp_path, monkeypatch, case):
    """An output under a file (unwritable even for root) is one line, exit 2, and nothing is loaded or
    measured. Before: calibrate, sequoia-measure and datastore build did their work, then a
    traceback; profile measured, then failed writing where runs look for profiles."""
    from treespec import decoder
    from treespec.cli import measure
    from treespec.plugins import datastore_index

    def never(*args, **kwargs):
        raise AssertionError("the work started before the output was checked")

    monkeypatch.setattr(measure, "load", never)
    monkeypatch.setattr(datastore_index.Index, "build", never)
    monkeypatch.setattr(decoder, "Decoder", never)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    out = str(blocker / "sub" / "out.json")
    if case == "datastore-build":
        corpus = tmp_path / "c.txt"
        corpus.write_text("Once upon a time.\n")
        args = ["datastore", "build", str(corpus), "--target", S260, "--out", out]
    elif case == "profile":
        monkeypatch.setenv("TREESPEC_PROFILE_DIR", str(blocker / "profiles"))  # where runs look for profiles
        args = ["profile", "--target", S260, "--drafter", "ngram"]
    else:
        args = [case, *PAIR, *MEASURE, "--out", out]
    result = runner.invoke(app, args)
    line = one_line_error(result)
    assert result.exit_code == 2 and "is a file, not a folder" in line and str(blocker) in line, line


def test_train_eagle_on_a_full_disk_is_one_line_and_the_same_command_finishes_it(tmp_path, monkeypatch):
    """The disk fills as the trained head is saved: one line, no half head (weights are written first,
    each file atomically); the epochs are checkpointed, so the same command, run again with space,
    only saves the head. Before: a traceback after the training, and a config.json without weights."""
    import safetensors.torch

    out = tmp_path / "head"
    args = [
        "train",
        "eagle",
        "--target",
        S260,
        "--data",
        "tinystories",
        "--offset",
        "200",
        "--limit",
        "12",
        "--max-new-tokens",
        "8",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--out",
        str(out),
    ]
    real = safetensors.torch.save_file

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"half")
        raise enospc()

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    result = runner.invoke(app, args)
    line = one_line_error(result)
    assert result.exit_code == 2 and "No space left on device" in line and "model.safetensors" in line, line
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert (out / "checkpoint.pt").is_file() and not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
