"""The CLI through typer's runner, and one real `treespec run --json` subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import STORIES260K
from treespec.cli.app import app

runner = CliRunner()
PAIR = ["--target", str(STORIES260K), "--drafter", str(STORIES260K), "-D", "layers=4"]


def test_run_json_matches_target_greedy(greedy_reference):
    prompt = "Once upon a time, there was a little dog"
    res = runner.invoke(
        app,
        [
            "run",
            *PAIR,
            "--builder",
            "opt-tree",
            "-B",
            "nodes=25,threshold=0.3",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "48",
            "--json",
            "--dtype",
            "float64",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) >= {"text", "token_ids", "stats"}
    assert set(data["stats"]) >= {"steps", "new_tokens", "mean_accepted", "tokens_per_s"}
    ids = greedy_reference.target.tokenizer(prompt).input_ids
    assert data["token_ids"] == greedy_reference(ids, 48)
    assert data["stats"]["new_tokens"] == 48
    assert data["stats"]["mean_accepted"] == pytest.approx(48 / data["stats"]["steps"])


def test_run_plain_streams_text_and_ends_with_statistics():
    res = runner.invoke(
        app, ["run", *PAIR, "--builder", "chain", "-B", "k=3", "--prompt", "Once upon a time", "--max-new-tokens", "20"]
    )
    assert res.exit_code == 0, res.output
    assert "tokens/step" in res.stderr and "20 tokens" in res.stderr
    assert len(res.stdout.strip()) > 20


def test_echo_prints_the_prompt_before_the_same_completion():
    args = ["run", *PAIR, "--builder", "chain", "-B", "k=3", "--prompt", "Once upon a time", "--max-new-tokens", "12"]
    plain = runner.invoke(app, args)  # not a terminal: the completion alone
    echoed = runner.invoke(app, [*args, "--echo"])
    assert plain.exit_code == echoed.exit_code == 0, plain.output + echoed.output
    assert not plain.stdout.startswith("Once upon a time")
    assert echoed.stdout == "Once upon a time" + plain.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--builder", "opt-tre"], "did you mean 'opt-tree'"),
        (["--builder", "opt-tree", "-B", "nodes=0"], "nodes"),
        (["--builder", "opt-tree", "-B", "nodes=many"], "valid integer"),
        (["--builder", "opt-tree", "-B", "depth=3"], "unknown option 'depth'"),
        (["--builder", "chain", "-B", "k"], "not name=value"),
        (["--drafter", "moddel"], "did you mean"),
    ],
)
def test_bad_input_is_one_clear_line(args, needle):
    base = ["run", "--target", str(STORIES260K), "--prompt", "Hi", "--max-new-tokens", "4"]
    if "--drafter" not in args:
        base += ["--drafter", str(STORIES260K)]
    res = runner.invoke(app, base + args)
    assert res.exit_code == 2
    err = res.stderr.strip()
    assert needle in err and err.startswith("error:") and len(err.splitlines()) == 1, err
    assert "Traceback" not in res.output


def test_prompt_longer_than_the_context_is_refused(capfd):
    res = runner.invoke(app, ["run", *PAIR, "--prompt", "tree " * 600, "--max-new-tokens", "4"])
    assert res.exit_code == 2
    assert "context is 512" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert capfd.readouterr().err == ""  # nor a tokenizer warning on the real stderr


def test_plugins_lists_builtins_without_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from treespec.cli.app import app; "
        "r = CliRunner().invoke(app, ['plugins', '--json']); assert r.exit_code == 0, r.output; "
        "print(r.stdout); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    names = {(p["kind"], p["name"]): p for p in data["plugins"]}
    assert {("builder", "opt-tree"), ("builder", "chain"), ("drafter", "model")} <= set(names)
    opt = {o["name"]: o["default"] for o in names[("builder", "opt-tree")]["options"]}
    assert opt == {
        "nodes": "auto",
        "threshold": 0.5,
        "max_depth": None,
        "cap": 64,
        "calibrate": None,
        "profile": None,
        "refine": True,
        "sample": False,
    }
    assert names[("builder", "opt-tree")]["package"] == "treespec"


def test_help_does_not_import_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from treespec.cli.app import app; "
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0; assert 'run' in r.stdout; "
        "assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_real_subprocess_run_json(greedy_reference, tmp_path):
    exe = shutil.which("treespec", path=os.path.dirname(sys.executable)) or shutil.which("treespec")
    assert exe, "the treespec console script is not installed"
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("One day, a little girl named Lily found a needle in her room.")
    proc = subprocess.run(
        [
            exe,
            "run",
            *PAIR,
            "--builder",
            "opt-tree",
            "--prompt-file",
            str(prompt_file),
            "--max-new-tokens",
            "32",
            "--json",
            "--dtype",
            "float64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    ids = greedy_reference.target.tokenizer(prompt_file.read_text()).input_ids
    assert data["token_ids"] == greedy_reference(ids, 32)


# a chat template in the shape instruct models ship (Llama-2 chat's [INST] markers), for a local copy
# of stories260K: run --chat must give exactly what the target's own greedy generate gives on the
# templated prompt
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def test_run_chat_applies_the_targets_chat_template(greedy_reference, tmp_path):
    chat_model = tmp_path / "stories-chat"
    shutil.copytree(STORIES260K, chat_model)
    config = json.loads((chat_model / "tokenizer_config.json").read_text())
    (chat_model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    args = [
        "run",
        "--target",
        str(chat_model),
        "--drafter",
        "self",
        "-D",
        "layers=4",
        "--prompt",
        "Tell a story",
        "--system",
        "You are a storyteller.",
        "--max-new-tokens",
        "24",
        "--json",
        "--dtype",
        "float64",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)  # what a Hugging Face user would run
    messages = [{"role": "system", "content": "You are a storyteller."}, {"role": "user", "content": "Tell a story"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tok.decode(ids) == "<<SYS>>You are a storyteller.<</SYS>>[INST] Tell a story [/INST]"
    assert json.loads(res.stdout)["token_ids"] == greedy_reference(ids, 24)
    plain = runner.invoke(app, ["run", *PAIR, "--chat", "--prompt", "hi"])  # a base model: one line
    assert plain.exit_code == 2 and "has no chat template" in plain.stderr and "Traceback" not in plain.output


def test_the_headline_command_picks_the_drafts_target_and_runs_from_the_cache(tmp_path, monkeypatch):
    """`treespec run --builder opt-tree --drafter llama-68m`: no --target, so the draft's own target
    (LLaMA-2); offline with neither cached, one line names both; with both in the Hugging Face cache
    (here tiny stand-ins in the hub's layout), it runs and equals the target's greedy decoding."""
    import huggingface_hub.constants

    from conftest import hf_cache
    from treespec.catalog import default_target_for

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # huggingface_hub read HF_HOME and HF_HUB_OFFLINE when it was first imported (maybe by an earlier
    # test in this worker); without the second, the reference below asked the hub and waited out its
    # retries (two minutes here) before using the cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = [
        "run",
        "--builder",
        "opt-tree",
        "--drafter",
        "llama-68m",
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "16",
        "--json",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code != 0 and len(res.stderr.strip().splitlines()) == 1, res.output
    line = res.stderr.strip()
    target = default_target_for("llama-68m")
    assert target == "meta-llama/Llama-2-7b-hf" and target in line and "JackFram/llama-68m" in line
    assert f"hf download {target} && hf download JackFram/llama-68m" in line
    hf_cache(tmp_path / "hf", target, STORIES260K)
    hf_cache(tmp_path / "hf", "JackFram/llama-68m", STORIES260K)  # the same tokenizer, as the real pair shares
    res = runner.invoke(app, args + ["--dtype", "float64"])
    assert res.exit_code == 0, res.output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)  # from the cache, as a user would
    ids = AutoTokenizer.from_pretrained(target)("Once upon a time", return_tensors="pt").input_ids
    want = model.generate(ids, do_sample=False, max_new_tokens=16)[0, ids.shape[1] :].tolist()
    assert json.loads(res.stdout)["token_ids"] == want


def test_the_readme_eagle3_command_offline_names_the_target_and_the_head(tmp_path, monkeypatch):
    """Issue 29 (3): offline, the README's EAGLE-3 command named the missing target, not the missing head."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    target, head = "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    res = CliRunner().invoke(
        app, ["run", "--target", target, "--drafter", "eagle3", "-D", f"head={head}", "--chat", "--prompt", "hi"]
    )
    line = res.stderr.strip()
    assert res.exit_code != 0 and len(line.splitlines()) == 1, res.output
    assert f"EAGLE head {head!r}" in line and f"hf download {target} && hf download {head}" in line


def test_a_chat_template_that_rejects_the_system_role_is_one_line(tmp_path):
    """Issue 29 (2): Gemma-style templates raise_exception('System role not supported'): with --system
    that was a 58-line jinja traceback."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES260K)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    AutoModelForCausalLM.from_pretrained(STORIES260K).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    base = ["run", "--target", str(tmp_path / "m"), "--drafter", "ngram", "--prompt", "Once upon a time"]
    res = runner.invoke(app, [*base, "--system", "Be brief.", "--max-new-tokens", "4"])
    line = res.stderr.strip()
    assert res.exit_code == 2 and len(line.splitlines()) == 1 and "Traceback" not in res.output, res.output
    assert "System role not supported" in line and "chat template" in line
    ok = runner.invoke(app, [*base, "--chat", "--max-new-tokens", "4"])  # no system turn: the template works
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("fails", [False, True])
def test_hf_errors_only_quiets_transformers_while_a_command_runs_then_gives_the_setting_back(fails, hf_logging_info):
    from treespec.cli.common import hf_errors_only

    hf_logging, seen = hf_logging_info, []

    @hf_errors_only
    def command(x: int) -> int:
        seen.append(hf_logging.get_verbosity())
        if fails:
            raise RuntimeError("boom")
        return x + 1

    if fails:
        with pytest.raises(RuntimeError):
            command(1)
    else:
        assert command(1) == 2
    assert seen == [hf_logging.ERROR] and hf_logging.get_verbosity() == hf_logging.INFO
