"""Ctrl-C and SIGTERM in the batch modes keep what was finished (issue 27, item 6).

``Decoder.generate([...])`` raises ``Interrupted`` carrying every prompt's output (finished whole,
the rows in flight partial, the rest marked not started) instead of a bare ``KeyboardInterrupt``;
``treespec run --prompt-file --batch-size --json`` prints the interrupted chunk's finished and partial
outputs; SIGTERM during ``run`` is handled like Ctrl-C (what exists is printed, exit 143, one line);
``treespec bench --batch-size`` rewrites results.json after every batch size, so an interrupt or a
full disk keeps the finished batch sizes. The interrupts are raised from inside decoding (a patched
drafting step) or delivered as real signals to a real process, never by timing.
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

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec.cli.app import app

S260 = str(STORIES260K)
FINISHED = ("eos", "max_new_tokens", "context")
runner = CliRunner()


def interrupt_after_first_finish(monkeypatch, steps_after: int = 1, exc: type[BaseException] = KeyboardInterrupt):
    """Raise ``exc`` in the batch's drafting ``steps_after`` steps after the first row finished (a
    newcomer has taken its place by then): some rows are done, some in flight, some waiting."""
    from treespec import engine, lockstep

    real_draft, real_leave = lockstep.draft_rows, engine.Engine.leave
    left, after = [], []

    def leave(self, gone, reasons):
        left.append(len(gone))
        return real_leave(self, gone, reasons)

    def draft_rows(*args, **kwargs):
        if left:
            after.append(1)
            if len(after) > steps_after:
                raise exc
        return real_draft(*args, **kwargs)

    monkeypatch.setattr(engine.Engine, "leave", leave)
    monkeypatch.setattr(lockstep, "draft_rows", draft_rows)


def test_generate_batch_interrupted_returns_every_prompts_output(target64, monkeypatch):
    """Before: a bare KeyboardInterrupt, the finished rows lost with it."""
    prompts = tinystories_prompts(5, cut_words=6)
    dec = treespec.Decoder(target64, drafter="ngram", builder="chain", builder_options={"k": 2})
    full = dec.generate(prompts, max_new_tokens=12, batch_size=2)
    interrupt_after_first_finish(monkeypatch)
    with pytest.raises(treespec.Interrupted, match="interrupted") as info:
        dec.generate(prompts, max_new_tokens=12, batch_size=2)
    outs = info.value.outputs
    assert len(outs) == len(prompts) and info.value.output is outs[0]
    kinds = {"finished": 0, "interrupted": 0, "not started": 0}
    for out, whole in zip(outs, full):
        reason = out.stats.stop_reason
        if reason in FINISHED:
            kinds["finished"] += 1
            assert out.token_ids == whole.token_ids and out.text == whole.text
        elif reason == "interrupted":
            kinds["interrupted"] += 1
            assert (
                0 < len(out.token_ids) < len(whole.token_ids) and whole.token_ids[: len(out.token_ids)] == out.token_ids
            )
            assert out.text == dec.text_of(out.token_ids, out.prompt_ids)
        else:
            assert reason == "not started" and out.token_ids == [], reason
            kinds["not started"] += 1
    assert all(kinds.values()), kinds
    monkeypatch.undo()  # the Decoder decodes the same batch again, unchanged
    assert [o.token_ids for o in dec.generate(prompts, max_new_tokens=12, batch_size=2)] == [o.token_ids for o in full]


def _prompt_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n\n".join(tinystories_prompts(n, cut_words=6)) + "\n")
    return path


BATCH_RUN = [
    "run",
    "--target",
    S260,
    "--drafter",
    "ngram",
    "--builder",
    "chain",
    "-B",
    "k=2",
    "--max-new-tokens",
    "10",
    "--batch-size",
    "1",
    "--json",
]


def test_run_batch_json_interrupted_prints_the_chunks_finished_and_partial_outputs(tmp_path, monkeypatch):
    """Six prompts, one row: chunk 1 (prompts 1-4) completes, then Ctrl-C after prompt 5 finished and
    prompt 6 took its place. Before: prompts 5 and 6 were never printed."""
    prompt_file = _prompt_file(tmp_path, 6)
    whole = runner.invoke(app, [*BATCH_RUN, "--prompt-file", str(prompt_file)])
    assert whole.exit_code == 0, whole.output
    expected = {r["prompt"]: r for r in map(json.loads, whole.stdout.splitlines())}
    calls = []
    from treespec import batch

    real = batch.generate_batch

    def count_chunks(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second chunk
            interrupt_after_first_finish(monkeypatch)
        return real(*args, **kwargs)

    monkeypatch.setattr(batch, "generate_batch", count_chunks)
    result = runner.invoke(app, [*BATCH_RUN, "--prompt-file", str(prompt_file)])
    assert result.exit_code == 130, result.output
    line = one_line_error(result)
    assert line.startswith("error: interrupted") and "prompts 5-6 of 6" in line, line
    rows = {r["prompt"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for n in range(1, 6):
        assert rows[n]["token_ids"] == expected[n]["token_ids"] and rows[n]["stats"]["stop_reason"] in FINISHED
    assert rows[6]["stats"]["stop_reason"] == "interrupted" and rows[6]["token_ids"]
    assert expected[6]["token_ids"][: len(rows[6]["token_ids"])] == rows[6]["token_ids"]


SIGTERM_ON_THIRD = """
import os, signal, sys
from treespec import step
calls = []
def on_third(real):
    def hook(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real SIGTERM, delivered mid-decode
        return real(*args, **kwargs)
    return hook
step.step_rows = on_third(step.step_rows)  # the decode loop's step, one prompt or a batch
from treespec.cli.app import main
sys.argv[0] = "treespec"
main()
"""


@pytest.mark.parametrize("batch", [False, True], ids=["one-prompt", "batch"])
def test_sigterm_during_run_json_prints_what_exists_and_exits_143(tmp_path, batch):
    """A real SIGTERM in the third step of a real `treespec run --json`: the JSON of what was generated
    (stop_reason "interrupted"), one error line, exit 143. Before: killed, nothing printed."""
    args = [
        "run",
        "--target",
        S260,
        "--drafter",
        "ngram",
        "--builder",
        "chain",
        "-B",
        "k=1",
        "--max-new-tokens",
        "64",
        "--threads",
        "1",
        "--json",
    ]
    args += (
        ["--prompt-file", str(_prompt_file(tmp_path, 2)), "--batch-size", "2"]
        if batch
        else ["--prompt", "Once upon a time"]
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_ON_THIRD, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: terminated (SIGTERM)"), proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == (2 if batch else 1)
    for row in rows:
        assert row["stats"]["stop_reason"] == "interrupted" and row["token_ids"] and row["stats"]["steps"] == 2


BENCH = [
    "bench",
    "--dataset",
    "tinystories",
    "--limit",
    "2",
    "--max-new-tokens",
    "8",
    "--target",
    S260,
    "--drafter",
    "ngram",
    "--builder",
    "chain k=2",
    "--batch-size",
    "1,2",
]


def test_bench_batch_interrupted_keeps_the_finished_batch_sizes(tmp_path, monkeypatch):
    """Ctrl-C in the B=2 warm-up: results.json holds B=1's rows, marked partial; exit 130. Before:
    results.json was written only at the end, so nothing was kept."""
    from treespec.bench import batch_runner

    real = batch_runner.BatchBench._hf

    def interrupt_at_b2(self, prompts, max_new):
        if len(prompts) == 2:  # with two prompts, only B=2 runs a batch of two
            raise KeyboardInterrupt
        return real(self, prompts, max_new)

    monkeypatch.setattr(batch_runner.BatchBench, "_hf", interrupt_at_b2)
    out = tmp_path / "run"
    result = runner.invoke(app, [*BENCH, "--out", str(out)])
    assert result.exit_code == 130, result.output
    line = one_line_error(result)
    assert "interrupted" in line and "batch sizes 1 " in line and "marked partial" in line, line
    saved = json.loads((out / "results.json").read_text())
    assert saved["partial"] is True and {r["batch_size"] for r in saved["rows"]} == {1}
    assert {r["config"] for r in saved["rows"]} == {"hf-greedy", "chain k=2 | ngram", "chain k=2 | ngram | refill"}
    assert all(r["lossless"] for r in saved["rows"])


def test_bench_batch_disk_full_keeps_the_last_complete_results(tmp_path, monkeypatch):
    """The disk fills while B=2's rows are written: one line, exit 1, B=1's results.json whole."""
    real, calls = os.fsync, []

    def full_disk_on_second_file(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", full_disk_on_second_file)
    out = tmp_path / "run"
    result = runner.invoke(app, [*BENCH, "--out", str(out)])
    assert result.exit_code == 1, result.output
    line = one_line_error(result)
    assert "No space left on device" in line and "marked partial" in line, line
    saved = json.loads((out / "results.json").read_text())
    assert saved["partial"] is True and {r["batch_size"] for r in saved["rows"]} == {1}
    assert [p.name for p in out.iterdir()] == ["results.json"]  # no temp file left
