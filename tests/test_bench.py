"""The bench harness: dataset loaders, prompt formatting, configuration specs, rows, outputs."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import treespec
from conftest import SHARED, STORIES260K
from treespec.bench import datasets
from treespec.bench.baselines import default_baselines
from treespec.bench.runner import Bench, Config, Sample, parse_spec
from treespec.cli.app import app
from treespec.cli.common import RECORDED_ENV

PROMPTS = SHARED / "prompts"


# ------------------------------------------------------------------ datasets
@pytest.mark.parametrize(
    "name,count,turns,raw",
    [
        ("mt-bench", 80, 2, False),
        ("spec-bench", 480, 1, False),
        ("gsm8k", 1319, 1, False),
        ("humaneval", 164, 1, True),
        ("tinystories", None, 1, True),
    ],
)
def test_every_named_dataset_loads_from_shared(name, count, turns, raw):
    items = datasets.load_prompts(name, PROMPTS)
    if count:
        assert len(items) == count
    assert all(len(i.turns) >= turns and all(t.strip() for t in i.turns) for i in items)
    assert all(i.raw == raw for i in items)
    if name == "tinystories":
        assert all(len(i.turns[0].split()) <= datasets.STORY_PROMPT_WORDS for i in items) and len(items) > 1000
    if name == "humaneval":
        assert items[0].id == "HumanEval/0" and "def has_close_elements" in items[0].turns[0]
    if name == "mt-bench":
        assert items[0].id == "81" and items[0].category == "writing"


def test_categories_and_limit():
    items = datasets.load_prompts("spec-bench", PROMPTS, limit=5, category="summarization")
    assert len(items) == 5 and {i.category for i in items} == {"summarization"}
    with pytest.raises(treespec.ConfigError, match="no category 'poetry'; categories: .*rag"):
        datasets.load_prompts("spec-bench", PROMPTS, category="poetry")


def test_user_files_jsonl_gz_and_txt(tmp_path):
    rows = [{"prompt": "p0"}, {"text": "t1"}, {"question": "q2", "id": "x"}, {"turns": ["a", "b"], "category": "c"}]
    (tmp_path / "mine.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = datasets.load_prompts(str(tmp_path / "mine.jsonl"))
    assert [i.turns for i in items] == [["p0"], ["t1"], ["q2"], ["a", "b"]]
    assert items[2].id == "x" and items[3].category == "c" and items[1].raw
    with gzip.open(tmp_path / "mine.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"prompt": "zipped"}) + "\n")
    assert datasets.load_prompts(str(tmp_path / "mine.jsonl.gz"))[0].turns == ["zipped"]
    (tmp_path / "mine.txt").write_text("first block\nline two\n\n\nsecond\n")
    assert [i.turns[0] for i in datasets.load_prompts(str(tmp_path / "mine.txt"))] == [
        "first block\nline two",
        "second",
    ]
    (tmp_path / "bad.jsonl").write_text('{"answer": 1}\n')
    with pytest.raises(treespec.ConfigError, match="line 1: no 'turns'"):
        datasets.load_prompts(str(tmp_path / "bad.jsonl"))


def test_missing_files_are_clear(tmp_path, monkeypatch):
    with pytest.raises(treespec.ConfigError, match="mt_bench.jsonl not found; point --data-dir"):
        datasets.load_prompts("mt-bench", tmp_path)
    monkeypatch.setenv("TREESPEC_DATA_DIR", str(tmp_path))
    with pytest.raises(treespec.ConfigError, match=str(tmp_path)):
        datasets.load_prompts("gsm8k")
    with pytest.raises(treespec.ConfigError, match="neither a known name"):
        datasets.load_prompts("mt-bench2")


def test_format_raw_and_chat(target64, tmp_path):
    tok = target64.tokenizer
    item = datasets.PromptItem("1", ["Tell a story.", "Shorter."])
    raw = datasets.format_turns(tok, item, ["Once there was a cat."])
    assert tok.decode(raw, skip_special_tokens=True) == "Tell a story.Once there was a cat.\n\nShorter."
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    chat_tok = AutoTokenizer.from_pretrained(tmp_path)
    chat_tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    ids = datasets.format_turns(chat_tok, item, ["Once there was a cat."])
    text = chat_tok.decode(ids)
    assert "<user>Tell a story.<assistant>Once there was a cat.<user>Shorter.<assistant>" in text.replace(
        " ", ""
    ).replace("▁", "") or text.index("Tell") < text.index("cat") < text.index("Shorter")
    code = datasets.PromptItem("HumanEval/0", ["def f():"], raw=True)
    assert chat_tok.decode(datasets.format_turns(chat_tok, code, []), skip_special_tokens=True) == "def f():"


def test_a_prompt_longer_than_the_context_is_formatted_without_the_tokenizers_warning():
    """Training keeps a long prompt's tail and the Decoder refuses it in one line, so the tokenizer's
    "will result in indexing errors" warning is noise. A fresh tokenizer (it warns once per instance),
    and a handler on transformers' own logger (it does not propagate)."""
    import logging

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES260K)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    level = logger.level  # an earlier in-process CLI run may have set transformers' verbosity to errors
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        ids = datasets.format_turns(
            tok, datasets.PromptItem("long", ["def f(x):\n    return x + 1\n" * 400], raw=True), []
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert len(ids) > tok.model_max_length  # long enough that the tokenizer would warn
    assert not [m for m in said if "sequence length" in m]


# ------------------------------------------------------------------ specs
def test_parse_spec_sweeps_the_cartesian_product():
    assert parse_spec("opt-tree nodes=10,25 threshold=0.5,0") == [
        ("opt-tree", {"nodes": "10", "threshold": "0.5"}),
        ("opt-tree", {"nodes": "10", "threshold": "0"}),
        ("opt-tree", {"nodes": "25", "threshold": "0.5"}),
        ("opt-tree", {"nodes": "25", "threshold": "0"}),
    ]
    assert parse_spec("chain") == [("chain", {})]
    with pytest.raises(treespec.ConfigError, match="not key=value"):
        parse_spec("chain k")
    assert default_baselines(["chain k=4,8", "opt-tree"])[1:3] == [
        f"hf-assisted num_assistant_tokens={k} num_assistant_tokens_schedule=constant assistant_confidence_threshold=0"
        for k in (4, 8)
    ]


# ------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def small_bench():
    bench = Bench(
        str(STORIES260K),
        [f"{STORIES260K} layers=4"],
        ["opt-tree nodes=5,10", "chain k=2"],
        default_baselines(["chain k=2"]),
        max_new_tokens=24,
        dtype="float64",
    )
    return bench


def test_small_run_is_lossless_with_sane_rows(small_bench):
    items = datasets.load_prompts("tinystories", PROMPTS, limit=4)
    seen = []
    samples = small_bench.run(items, on_sample=lambda c, n, s, same: seen.append((c.label, n, same)), warmup=False)
    rows = {r["config"]: r for r in small_bench.rows(samples)}
    assert len(seen) == 4 * len(small_bench.configs) and all(same for *_, same in seen)
    assert set(rows) == {c.label for c in small_bench.configs}
    assert rows["hf-greedy"]["tau"] == 1.0  # generate makes one forward per new token
    assert rows["hf-greedy"]["speedup"] == 1.0 and rows["hf-greedy"]["builder"] is None
    for r in rows.values():
        assert r["lossless"] and r["mismatches"] == 0 and r["new_tokens"] == 4 * 24
        # per prompt, for the paired interval: the row's own samples, in prompt order
        assert r["per_prompt"] == [[len(s.token_ids), s.seconds] for s in samples[r["config"]]]
        lo, hi = r["speedup_interval"]
        assert lo <= r["speedup"] <= hi
    tree_rows = [r for r in rows.values() if r["builder"]]
    assert len(tree_rows) == 3 and all(r["tau"] > 1.0 for r in tree_rows)
    assert all(0 <= r["share_bookkeeping"] < 1 for r in tree_rows)
    chain = rows["chain k=2 | stories260K layers=4"]
    assert chain["assisted_config"].startswith("hf-assisted k=2 schedule=constant confidence=0")
    assert {
        "config",
        "builder",
        "drafter",
        "options",
        "tau",
        "tokens_per_s",
        "speedup",
        "lossless",
        "corr_ea_a",
        "steps",
        "new_tokens",
    } <= set(chain)


def test_a_corrupted_configuration_is_flagged_not_lossless(small_bench):
    """A deliberately wrong configuration, built here in the test: the real chain runner with one
    token of its output changed. The harness must report it as not lossless."""
    real = next(c for c in small_bench.configs if c.builder == "chain")

    def corrupted(ids, max_new, seed):
        sample = real.run(ids, max_new, seed)
        return Sample([sample.token_ids[0] ^ 1, *sample.token_ids[1:]], sample.seconds, sample.forwards, sample.steps)

    bad = Config("corrupted chain", "treespec", "chain", {"k": 2}, real.drafter, run=corrupted)
    small_bench.configs.append(bad)
    try:
        items = datasets.load_prompts("tinystories", PROMPTS, limit=2)
        rows = {r["config"]: r for r in small_bench.rows(small_bench.run(items, warmup=False))}
    finally:
        small_bench.configs.remove(bad)
    assert rows["corrupted chain"]["lossless"] is False and rows["corrupted chain"]["mismatches"] == 2
    assert rows[real.label]["lossless"] is True


def test_mt_bench_second_turn_follows_the_models_first_answer(small_bench):
    items = datasets.load_prompts("mt-bench", PROMPTS, limit=1)
    samples = small_bench.run(items, warmup=False)
    assert small_bench.n_prompts == 2 and len(samples["hf-greedy"]) == 2
    answer = small_bench.target.tokenizer.decode(samples["hf-greedy"][0].token_ids, skip_special_tokens=True)
    turn2 = datasets.format_turns(small_bench.target.tokenizer, items[0], [answer])
    text = small_bench.target.tokenizer.decode(turn2, skip_special_tokens=True)
    assert answer.strip()[:20] in text and text.endswith(items[0].turns[1])


def test_sampled_bench_rows_are_seeded_and_not_compared_token_for_token():
    bench = Bench(
        str(STORIES260K),
        [f"{STORIES260K} layers=4"],
        ["chain k=2 sample=true"],
        ["hf-assisted"],
        max_new_tokens=12,
        sampling={"temperature": 0.8, "top_p": 0.9, "top_k": 0},
        seed=3,
    )
    items = datasets.load_prompts("tinystories", PROMPTS, limit=2)
    first, second = bench.run(items, warmup=False), bench.run(items, warmup=False)
    assert [c.label for c in bench.configs][0] == "hf-sample"
    assert all([s.token_ids for s in first[k]] == [s.token_ids for s in second[k]] for k in first)  # seeded
    rows = bench.rows(first)
    assert all(r["lossless"] is None and r["mismatches"] is None for r in rows)
    assert rows[0]["speedup"] == 1.0 and all(r["new_tokens"] == 24 for r in rows)


def test_rule_sweep_runs_every_configuration_once_per_rule_with_the_same_seeds():
    """--sampling-rule a,b: one row per (configuration, rule), each told its rule; the same prompts and
    seeds, so the rows differ only by the rule (block and traversal on a chain are the same rule:
    the very same tokens)."""
    bench = Bench(
        str(STORIES260K),
        [f"{STORIES260K} layers=4"],
        ["chain k=3 sample=true"],
        [],
        max_new_tokens=12,
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0},
        seed=5,
        rules=["block", "traversal", "specinfer"],
    )
    labels = [c.label for c in bench.configs]
    assert labels[1:] == [
        f"chain k=3 sample=true | stories260K layers=4 | rule={r}" for r in ("block", "traversal", "specinfer")
    ]
    assert [c.options["rule"] for c in bench.configs[1:]] == ["block", "traversal", "specinfer"]
    runs = bench.run(datasets.load_prompts("tinystories", PROMPTS, limit=2), warmup=False)
    by_rule = {c.options["rule"]: [s.token_ids for s in runs[c.label]] for c in bench.configs[1:]}
    assert by_rule["block"] == by_rule["traversal"]


# ------------------------------------------------------------------ the command
def test_bench_command_writes_table_json_steps_plots_and_report(tmp_path, hf_logging_info):
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--dataset",
            "tinystories",
            "--limit",
            "2",
            "--max-new-tokens",
            "16",
            "--target",
            str(STORIES260K),
            "--drafter",
            f"{STORIES260K} layers=4",
            "--builder",
            "opt-tree nodes=4,auto",
            "--builder",
            "chain k=3",
            "--out",
            str(out),
        ],
    )
    assert hf_logging_info.get_verbosity() == hf_logging_info.INFO  # an in-process caller keeps its setting
    assert res.exit_code == 0, res.output
    assert "hf-greedy" in res.stdout and "lossless" in res.stdout
    result = json.loads((out / "results.json").read_text())
    # the environment switches the tests run under come first (conftest: TREESPEC_ROW_MATMUL=native), then the command
    env = "".join(f"{n}={os.environ[n].strip()} " for n in RECORDED_ENV if os.environ.get(n, "").strip())
    assert env.startswith("TREESPEC_ROW_MATMUL=") and result["command"].startswith(
        env + "treespec bench --dataset tinystories"
    )
    assert {"python", "torch", "transformers", "cpu", "threads"} <= set(result["environment"])
    labels = [r["config"] for r in result["rows"]]
    assert labels[0] == "hf-greedy" and any(lbl.startswith("hf-lookup") for lbl in labels)
    assert all(r["lossless"] for r in result["rows"])
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps and {
        "config",
        "prompt",
        "tree_size",
        "depth",
        "expected_accepted",
        "accepted",
        "t_draft",
        "t_verify",
        "t_bookkeeping",
    } <= set(steps[0])
    for png in ("tau_vs_budget.png", "ea_vs_accepted.png", "accepted_hist.png", "tokens_vs_budget.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    auto = next(r for r in result["rows"] if r["config"].startswith("opt-tree nodes=auto"))
    plan = auto["plan"]  # the planning row reports its budgets, the cost model's fit and its calibration
    auto_steps = [s for s in steps if s["config"] == auto["config"]]
    assert plan["mean_nodes"] == pytest.approx(sum(s["tree_size"] for s in auto_steps) / len(auto_steps))
    assert sum(plan["nodes_hist"].values()) == pytest.approx(1.0) and plan["predicted_ms"] > 0
    assert all(r.get("plan") is None for r in result["rows"] if r is not auto)
    md = tmp_path / "benchmarks.md"
    res = CliRunner().invoke(app, ["bench-report", str(out), "--out", str(md)])
    assert res.exit_code == 0, res.output
    text = md.read_text()
    assert result["command"] in text and "| chain k=3 \\| stories260K layers=4 |" in text and "Targets:" in text
    assert "Planning rows" in text and "tokens_vs_budget.png" in text
    assert (
        f"--out {os.path.relpath(md)}`" in text and "--out docs/benchmarks.md" not in text
    )  # the hint names its own --out


def test_bench_bad_input(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--dataset", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "neither a known name" in res.stderr
    res = runner.invoke(app, ["bench", "--temperature", "-0.7"])
    assert res.exit_code == 2 and "temperature" in res.stderr
    res = runner.invoke(app, ["bench", "--temperature", "0.7", "--top-p", "2"])
    assert res.exit_code == 2 and "top_p" in res.stderr
    res = runner.invoke(app, ["bench", "--limit", "1", "--builder", "opt-tree nodes=0", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "greater than 0" in res.stderr
    res = runner.invoke(app, ["bench", "--sampling-rule", "specinfer", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "needs sampling" in res.stderr
    res = runner.invoke(
        app, ["bench", "--temperature", "1", "--sampling-rule", "specinfer,best", "--out", str(tmp_path)]
    )
    assert res.exit_code == 2 and "rules are" in res.stderr
    res = runner.invoke(
        app, ["bench", "--temperature", "1", "--sampling-rule", "auto", "--batch-size", "2", "--out", str(tmp_path)]
    )
    assert res.exit_code == 2 and "one or the other" in res.stderr
    res = runner.invoke(app, ["bench-report", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "missing not found; run `treespec bench --out DIR` first" in res.stderr


def test_report_targets_call_a_loss_a_miss_only_at_equal_budget():
    from treespec.bench.report import targets

    def row(builder, opts, tau):
        return {
            "config": f"{builder} {opts}",
            "builder": builder,
            "drafter": "d",
            "options": opts,
            "tau": tau,
            "lossless": True,
        }

    def verdicts(*rows):
        return [line.split(":")[0] for line in targets({"rows": list(rows)}) if "τ" in line]

    opt6 = row("opt-tree", {"nodes": 6}, 3.0)
    assert verdicts(opt6, row("chain", {"k": 6}, 3.5)) == ["- MISSED"]
    assert verdicts(opt6, row("chain", {"k": 6}, 2.5)) == ["- met"]
    assert verdicts(opt6, row("chain", {"k": 8}, 2.5)) == ["- met"]  # fewer nodes and still ahead
    assert verdicts(opt6, row("chain", {"k": 8}, 3.5)) == ["- not at equal budget"]
    assert verdicts(opt6, row("opt-tree", {"nodes": 8}, 3.4), row("chain", {"k": 8}, 3.5)) == ["- MISSED"]


def test_planning_summary_of_known_steps():
    from treespec.bench.planning import summary

    def step(size, depth, accepted, wall, predicted, expected, own):
        return {
            "tree_size": size,
            "depth": depth,
            "accepted": accepted,
            "t_wall": wall,
            "predicted_seconds": predicted,
            "planned_expected": expected,
            "plan_seconds": own,
        }

    steps = [
        step(0, 0, 0, 0.010, 0.010, 0.0, 0.0),
        step(6, 3, 2, 0.020, 0.018, 1.5, 0.001),
        step(20, 9, 4, 0.030, 0.033, 4.5, 0.002),
    ]
    got = summary(steps)
    assert got["mean_nodes"] == pytest.approx(26 / 3) and got["mean_nodes_speculative"] == 13
    assert got["nodes_hist"]["0"] == pytest.approx(1 / 3) and got["nodes_hist"]["4-7"] == pytest.approx(1 / 3)
    assert got["nodes_hist"]["16-31"] == pytest.approx(1 / 3) and got["depth_hist"]["6-9"] == pytest.approx(1 / 3)
    assert got["plain_share"] == pytest.approx(1 / 3)
    assert got["calibration"] == pytest.approx(6.0 / 6.0)  # mean E(A) 2.0 vs mean accepted 2.0
    assert got["fit_error"] == pytest.approx((0 + 0.1 + 0.1) / 3)
    assert got["planner_share"] == pytest.approx(0.003 / 0.060)
    assert summary([{"tree_size": 3, "predicted_seconds": None}]) is None  # a builder that does not plan


def test_category_lines_give_each_category_its_own_paired_ratio():
    from treespec.bench.report import category_lines

    cats = ["rag"] * 4 + ["math"] * 4
    greedy = [[100, 1.0]] * 8
    auto = [[100, 0.5]] * 4 + [[100, 1.0]] * 4  # twice as fast on rag, even on math
    chain = [[100, 0.8]] * 8
    rows = [
        {"config": "hf-greedy", "per_prompt": greedy},
        {"config": "opt-tree nodes=auto | eagle", "per_prompt": auto, "plan": {"mean_nodes": 1}},
        {"config": "chain k=1 | eagle", "per_prompt": chain},
    ]
    rag, math = category_lines({"prompt_categories": cats, "rows": rows})
    assert rag == "- rag (4 prompts), × hf-greedy: opt-tree nodes=auto | eagle 2.00 (2.00–2.00)"  # also the best
    assert math == (
        "- math (4 prompts), × hf-greedy: opt-tree nodes=auto | eagle 1.00 (1.00–1.00); chain k=1 | eagle 1.25 (1.25–1.25)"
    )
    assert category_lines({"prompt_categories": ["a"] * 8, "rows": rows}) == []  # one category: nothing to split
    assert category_lines({"rows": rows}) == []  # older results


def test_row_defaults_follow_the_target():
    """No --target: the small pair's rows; a target that ships a head (SmolLM2) alone: its default drafter
    (head + lookup) under the default builder, its head alone under it and the chains; another target
    alone: one line asking for a drafter."""
    from treespec import defaults
    from treespec.cli.bench_inputs import rows_for

    assert rows_for(None, None, None, None) == (
        defaults.TARGET,
        defaults.bench_drafters(),
        defaults.bench_builders(),
        [],
    )
    main_rows = [("opt-tree nodes=auto", "eagle+ngram")] + [
        (b, "eagle") for b in ("opt-tree nodes=auto", "chain k=1", "chain k=2")
    ]
    assert rows_for("smollm2", None, None, None) == ("smollm2", [], [], main_rows)
    assert rows_for("smollm2", None, ["chain k=3"], None) == ("smollm2", ["eagle+ngram"], ["chain k=3"], [])
    assert rows_for("treespec-py", None, ["chain k=3"], None)[1] == ["eagle"]  # the small pair: the head alone
    assert rows_for("smollm2", None, None, None, sampling=True)[3][0] == ("opt-tree nodes=auto", "eagle")  # sampling
    hub = rows_for("HuggingFaceTB/SmolLM2-135M-Instruct", None, ["chain k=3"], None)
    assert hub[1:3] == (["eagle+ngram"], ["chain k=3"])  # the model by its hub id: the main job's drafter
    assert rows_for("smollm2", ["ngram"], None, None)[1:3] == (["ngram"], ["opt-tree", "chain k=4"])
    import typer

    with pytest.raises(typer.Exit):
        rows_for(str(STORIES260K), None, None, None)


def test_configs_first_turns_chat_requests_and_per_category(tmp_path, monkeypatch):
    """--config adds exactly one builder|drafter row each; --turns 1 keeps first turns; --chat makes
    completion prompts user requests; --per-category keeps the first N of every category."""
    from treespec.cli.bench_inputs import load_items as _prompts

    mt = _prompts("mt-bench", None, None, None, 1, False, 2)
    cats = [i.category for i in mt]
    assert len(mt) == 2 * len(set(cats)) == 16 and all(cats.count(c) == 2 for c in cats)
    assert all(len(i.turns) == 1 for i in mt)
    he = _prompts("humaneval", None, 1, None, None, True, None)[0]
    raw = datasets.load_prompts("humaneval", limit=1)[0]
    assert not he.raw and raw.turns[0] in he.turns[0] and he.turns[0].startswith("Complete the following Python")
    captured = {}
    real = Bench.__init__

    def spy(self, *args, **kwargs):
        captured["pairs"] = kwargs.get("pairs")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Bench, "__init__", spy)
    out = tmp_path / "run"
    res = CliRunner().invoke(
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
            "--config",
            "chain k=2 | ngram",
            "--config",
            f"opt-tree nodes=3 | {STORIES260K} layers=3",
            "--baseline",
            "none",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    rows = [r["config"] for r in json.loads((out / "results.json").read_text())["rows"]]
    assert rows == ["hf-greedy", "chain k=2 | ngram", "opt-tree nodes=3 | stories260K layers=3"]
    assert captured["pairs"] == [("chain k=2", "ngram"), ("opt-tree nodes=3", f"{STORIES260K} layers=3")]
    bad = CliRunner().invoke(
        app, ["bench", "--target", str(STORIES260K), "--config", "chain k=2", "--out", str(tmp_path / "x")]
    )
    assert bad.exit_code != 0 and "BUILDER-SPEC | DRAFTER-SPEC" in bad.output
    batch = CliRunner().invoke(
        app,
        [
            "bench",
            "--target",
            str(STORIES260K),
            "--config",
            "chain k=2 | ngram",
            "--batch-size",
            "2",
            "--out",
            str(tmp_path / "y"),
        ],
    )
    assert batch.exit_code != 0 and "not measured in batches" in batch.output  # refused, not silently dropped


@pytest.mark.parametrize("extra", [[], ["--batch-size", "1,2"]])
def test_max_new_tokens_filling_the_context_is_one_line(tmp_path, extra):
    spec = (
        ["--config", "chain k=2 | ngram", "--baseline", "none"]
        if not extra
        else ["--drafter", "ngram", "--builder", "chain k=2"]
    )
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--dataset",
            "tinystories",
            "--limit",
            "1",
            "--max-new-tokens",
            "512",
            "--target",
            str(STORIES260K),
            *spec,
            *extra,
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "leaves no room for a prompt" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_the_default_prompts_are_looked_for_beside_the_checkout_not_inside(tmp_path, monkeypatch):
    """Issue 29 (3): from any other working directory, the default was <checkout>/shared/prompts."""
    from treespec.bench.datasets import default_data_dir

    checkout = Path(__file__).resolve().parents[1]
    monkeypatch.delenv("TREESPEC_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # no ../shared/prompts from here
    found = default_data_dir()
    assert checkout not in found.parents and found == checkout.parent / "shared" / "prompts"
