"""Draft calibration (treespec/train/calibration.py): the temperature fit recovers a known temperature, the
``model`` drafter's ``temperature`` reshapes q exactly as softmax(logits / T), and `treespec calibrate`
fits T for the default pair on real HumanEval prompts. Decoding with a calibrated draft stays
lossless: tests/test_default_pair.py ("draft T=0.5")."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import treespec
from conftest import SHARED
from treespec.cli.app import app
from treespec.factory import make_drafter
from treespec.interfaces import PrefillContext
from treespec.train.calibration import fit_temperature, nll
from treespec.tree import DraftTree


@pytest.mark.parametrize("true_t", [0.3, 0.7, 1.0, 2.5])
def test_fit_recovers_the_temperature_the_labels_were_drawn_at(true_t):
    g = torch.Generator().manual_seed(0)
    z = 3.0 * torch.randn(20_000, 40, generator=g)  # [n, V] logits
    y = torch.multinomial(torch.softmax(z / true_t, dim=-1), 1, generator=g)[:, 0]  # [n] labels drawn at T
    t = fit_temperature(z, y)
    assert abs(t - true_t) / true_t < 0.05, t
    # a minimum of the NLL: both neighbours are worse, and so is T = 1 unless T is 1
    assert nll(z, y, t) <= min(nll(z, y, t * 1.05), nll(z, y, t / 1.05))
    assert nll(z, y, t) <= nll(z, y, 1.0)


def test_fit_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \[n, V\] and labels \[n\]"):
        fit_temperature(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))


@pytest.fixture(scope="module")
def target():
    return treespec.TargetModel.load("treespec-py")


def _root_distribution(target, name, options, prompt_ids):
    drafter = make_drafter(name, options, target)
    drafter.prefill(PrefillContext(torch.tensor(prompt_ids)))
    tree = DraftTree(prompt_ids[-1])
    q = drafter.expand(tree, torch.tensor([0]), 4).q[0]  # [4] top-4 q after the root
    return drafter.distribution(tree, torch.tensor([0]))[0], q  # [V], [4]


@pytest.mark.parametrize("name,options", [("treespec-py-draft", {}), ("self", {"layers": 2})])
def test_the_draft_temperature_is_softmax_of_logits_over_t(target, name, options):
    ids = target.tokenizer('def mean(xs):\n    """Return the mean of xs."""\n').input_ids
    p1, q1 = _root_distribution(target, name, options, ids)
    pt, qt = _root_distribution(target, name, {**options, "temperature": 0.5}, ids)
    want = torch.softmax(torch.log(p1) / 0.5, dim=-1)  # softmax(z / T) = softmax(log softmax(z) / T)
    torch.testing.assert_close(pt, want, atol=1e-6, rtol=1e-4)
    assert torch.allclose(pt.sum(), torch.tensor(1.0)) and qt[0] > q1[0]  # sharper, same ranking
    torch.testing.assert_close(qt, pt.topk(4).values)


def test_calibrate_fits_t_for_the_default_pair(tmp_path):
    out = tmp_path / "cal.json"
    res = CliRunner().invoke(
        app,
        [
            "calibrate",
            "--dataset",
            "humaneval",
            "--data-dir",
            str(SHARED / "prompts"),
            "--skip",
            "40",
            "--limit",
            "3",
            "--max-new-tokens",
            "32",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["drafter"] == "treespec-py-draft" and rec["target"] == "treespec-py"
    assert 0 < rec["positions"] <= 3 * 32 and 0 < rec["temperature"] < 20
    assert rec["nll"] <= rec["nll_t1"]  # T = 1 is inside the search range: the fit cannot be worse
    # the raw draft under-states how often its top-1 is the target's token; the fitted q moves towards it
    assert abs(rec["mean_q_top1"] - rec["top1"]) < abs(rec["mean_q_top1_t1"] - rec["top1"])
    assert f"-D temperature={rec['temperature']:.3g}" in res.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--limit", "0"], "--limit must be > 0"),
        (["--dataset", "nope"], "neither a known name"),
        (["--target", "treespec-py"], "no draft model"),
        (["--skip", "1000"], "leaves no prompts"),
        (["--drafter", "eagle"], "not the drafter 'eagle'"),
        (["--max-positions", "0"], "--max-positions must be > 0"),
    ],
)
def test_calibrate_bad_input_is_one_clear_line(args, needle):
    res = CliRunner().invoke(app, ["calibrate", "--data-dir", str(SHARED / "prompts"), *args])
    assert res.exit_code == 2 and needle in res.stderr, res.output
    assert "Traceback" not in res.output


def test_a_spec_given_as_a_drafter_name_says_where_options_go():
    res = CliRunner().invoke(
        app, ["run", "--target", "treespec-py", "--drafter", "treespec-py-draft temperature=0.5", "--no-echo"]
    )
    assert res.exit_code != 0
    assert "pass --drafter treespec-py-draft -D key=value" in res.output, res.output
