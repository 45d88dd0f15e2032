"""Files on disk are data, never code (issue 16): training state is read with weights_only=True, and a
crafted pickle where treespec reads one is refused in one line without running anything."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from conftest import EAGLE_TEST_SETTINGS, REPO
from treespec.errors import ConfigError
from treespec.files import save_torch_atomic
from treespec.train.checkpoint import load_data


class Bomb:
    """Unpickling it creates ``marker``: proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def crafted(path: Path, marker: Path) -> Path:
    path.write_bytes(pickle.dumps({"key": Bomb(marker), "seqs": [Bomb(marker)]}))
    return path


def test_load_data_refuses_a_crafted_pickle_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(ConfigError, match=r"cannot be read safely .* delete it") as err:
        load_data(crafted(tmp_path / "checkpoint.pt", marker))
    assert not marker.exists() and "\n" not in str(err.value)


def test_checkpoints_round_trip_as_data(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "history": [{"epoch": 1, "loss": 0.5}],
        "key": {"lr": 1e-3, "name": "x", "sizes": (1, 2)},
    }
    save_torch_atomic(state, tmp_path / "c.pt")
    back = load_data(tmp_path / "c.pt")
    assert (
        torch.equal(back["rng"], state["rng"]) and back["history"] == state["history"] and back["key"] == state["key"]
    )
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind


def test_train_eagle_refuses_a_crafted_data_file(tmp_path):
    from treespec.plugins.eagle_train import train

    marker = tmp_path / "pwned"
    crafted(tmp_path / "data.pt", marker)
    with pytest.raises(ConfigError, match="data.pt cannot be read safely"):
        train(EAGLE_TEST_SETTINGS(tmp_path), log=lambda _: None)
    assert not marker.exists()


def test_no_product_code_unpickles_with_weights_only_false():
    offenders = []
    for folder in ("treespec", "plugins", "cli"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            if re.search(r"weights_only\s*=\s*False", text):
                offenders.append(str(path.relative_to(REPO)))
            for line in text.splitlines():
                if "torch.load(" in line and "weights_only=True" not in line:
                    offenders.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert not offenders, offenders
