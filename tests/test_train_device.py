"""`treespec train ... --device`: the target runs, and the drafter trains, on the device asked for.

On a CPU-only machine only ``cpu`` runs; the accelerator case (``cuda``, ``mps``) runs wherever one is
present and compares the device's run with the CPU's. The checkpoint and the data are device-free: a
run interrupted on one device resumes on another.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import STORIES260K

BASE = dict(target=str(STORIES260K), data="tinystories", offset=200, limit=24, max_new_tokens=32, batch_size=8)
EXTRA = {
    "eagle": {},
    "eagle3": {"ttt_steps": 2, "draft_vocab": 300},
    "block": {"block_size": 3, "draft_vocab": 300, "lr": 1e-2},
}


def _fit(trainer: str, out, progress=None, log=None, **kw) -> dict:
    """Train with ``trainer``'s own function (``train``, ``train3``, ``train_block``) on ``BASE``."""
    import treespec.plugins.block_train as bt
    import treespec.plugins.eagle3_train as e3
    import treespec.plugins.eagle_train as e1

    cls, run = {"eagle": (e1.TrainSettings, e1.train), "eagle3": (e3.Train3Settings, e3.train3)}.get(
        trainer, (bt.BlockSettings, bt.train_block)
    )
    s = cls(**BASE, out=str(out), **EXTRA[trainer], **kw)
    return run(s, progress=progress or e1.quiet, log=log or (lambda _: None))


def _losses(summary: dict) -> list[float]:
    return [h["train_loss"] for h in summary["history"]]


class Stop(Exception):
    pass


def _stop_in_epoch_2(task: str, done: int, total: int, info: str) -> None:
    if task.startswith("epoch 2"):
        raise Stop


@pytest.mark.parametrize("trainer", list(EXTRA))
def test_a_run_interrupted_on_one_device_resumes_on_another(tmp_path, trainer):
    """Two epochs with the default device, uninterrupted; the same run interrupted in its second epoch
    and resumed with ``device="cpu"``: no "written with other settings" refusal (the device is not a
    setting a checkpoint must match), it resumes after epoch 1 and ends with the same losses."""
    whole = _fit(trainer, tmp_path / "whole", epochs=2)
    with pytest.raises(Stop):
        _fit(trainer, tmp_path / "cut", epochs=2, progress=_stop_in_epoch_2)
    logs: list[str] = []
    resumed = _fit(trainer, tmp_path / "cut", epochs=2, device="cpu", log=logs.append)
    assert any("resuming" in m and "after epoch 1" in m for m in logs), logs
    assert resumed["settings"]["device"] == "cpu"
    assert _losses(resumed) == pytest.approx(_losses(whole), rel=1e-6)


def _accelerators() -> list[str]:
    return (["cuda"] if torch.cuda.is_available() else []) + (["mps"] if torch.backends.mps.is_available() else [])


@pytest.mark.skipif(not _accelerators(), reason="no CUDA or MPS device on this machine")
@pytest.mark.parametrize("trainer", list(EXTRA))
def test_an_accelerator_trains_what_the_cpu_trains(tmp_path, trainer):
    """The same run on each accelerator and on the CPU (the accelerator's target generates its own
    answers): both learn, and the accelerator's held-out loss after two epochs is the CPU's to within
    a few percent (float32 kernels differ; greedy answers may differ where two logits nearly tie)."""
    cpu = _fit(trainer, tmp_path / "cpu", epochs=2, device="cpu")
    for device in _accelerators():
        acc = _fit(trainer, tmp_path / device, epochs=2, device=device)
        first, last = acc["history"][0]["held_out"]["loss"], acc["history"][-1]["held_out"]["loss"]
        assert last < first, (device, first, last)
        assert math.isclose(last, cpu["history"][-1]["held_out"]["loss"], rel_tol=0.05), (device, acc, cpu)
        assert (tmp_path / device / "model.safetensors").is_file()


@pytest.mark.skipif(not _accelerators(), reason="no CUDA or MPS device on this machine")
def test_an_accelerator_trains_the_pair_the_cpu_trains(tmp_path):
    """`treespec train pair --device`: the tiny pair of ``tests/test_train_pair.py`` on each accelerator
    and on the CPU (one tokenizer and token streams): both models learn on the accelerator, and their
    held-out losses are the CPU run's to within a few percent."""
    from test_train_pair import tiny

    from treespec.train.pair import train_pair

    quiet = lambda _: None  # noqa: E731
    cpu = train_pair(tiny(tmp_path / "cpu", device="cpu"), log=quiet)
    for device in _accelerators():
        acc = train_pair(tiny(tmp_path / device, tmp_path / "cpu", device=device), log=quiet)
        for which in ("target", "draft"):
            a, c = acc["models"][which], cpu["models"][which]
            assert a["held_out_loss"] < a["held_out_loss_initial"] - 0.3, (device, which, a)
            assert math.isclose(a["held_out_loss"], c["held_out_loss"], rel_tol=0.05), (device, which, a, c)
        assert (tmp_path / device / "target" / "model.safetensors").is_file()
