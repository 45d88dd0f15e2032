"""`treespec bench --background-load N`: busy processes beside the measurement, started and stopped by the bench."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from conftest import STORIES260K
from treespec.bench.load import MAX_LOAD, background_load, check_load
from treespec.cli.app import app
from treespec.errors import ConfigError


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads CPU time from /proc")
def test_the_processes_are_busy_while_inside_and_gone_after():
    import time

    with background_load(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        deadline = time.monotonic() + 60  # a loaded machine may take a while to schedule them
        while not all(_cpu_seconds(p.pid) > 0.2 for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_cpu_seconds(p.pid) > 0.2 for p in procs)  # they burn CPU, not sleep
    assert all(p.poll() is not None for p in procs)
    with background_load(0) as procs:
        assert procs == []


def test_the_processes_stop_when_the_block_fails():
    with pytest.raises(KeyboardInterrupt):
        with background_load(1) as procs:
            raise KeyboardInterrupt
    assert procs[0].poll() is not None


@pytest.mark.parametrize("n", [-1, MAX_LOAD + 1])
def test_out_of_range_is_one_line(n):
    with pytest.raises(ConfigError, match="--background-load must be between 0"):
        check_load(n)
    r = CliRunner().invoke(
        app, ["bench", "--background-load", str(n), "--target", str(STORIES260K), "--drafter", "ngram"]
    )
    assert r.exit_code != 0 and "Traceback" not in r.output and "--background-load must be between 0" in r.output


def test_bench_records_the_load_it_ran_under(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "--dataset",
            "tinystories",
            "--limit",
            "1",
            "--max-new-tokens",
            "8",
            "--target",
            str(STORIES260K),
            "--drafter",
            "ngram",
            "--builder",
            "chain k=2",
            "--baseline",
            "none",
            "--background-load",
            "1",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    result = json.loads((out / "results.json").read_text())
    assert result["background_load"] == 1 and "--background-load 1" in result["command"]
    assert all(row["lossless"] for row in result["rows"])
