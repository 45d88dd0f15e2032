"""Batches of prompts: ``Decoder.generate([...])`` verifies every row's tree in one target forward
(``treespec.batch``, ``treespec.batch_target``). Every row equals that prompt's own greedy
``generate``; rows take the same steps as when decoded alone (no state leaks between rows); the batched
forward equals each row's own tree forward (Llama, Qwen2, GPT-2); rows of different lengths, rows
ending at EOS at different steps, and a batch of one."""

from __future__ import annotations

import random
import re

import pytest
import torch
from test_tree_forward import VOCAB, make_model, random_tree

import treespec
from conftest import STORIES260K, block_head_dir, eagle3_head_dir, eagle_head_dir, tinystories_prompts
from treespec import TargetModel
from treespec.batch_target import BatchTarget

DRAFTERS = {
    "model": (str(STORIES260K), {"layers": 3}),
    "ngram": ("ngram", None),
    "eagle": ("eagle", "eagle"),
    "eagle3": ("eagle3", "eagle3"),
    "compose": (f"{STORIES260K}+ngram", {"model.layers": 2}),  # calibrated per part: learns across rows
    "compose-raw": (f"{STORIES260K}+ngram", {"model.layers": 2, "calibrate": False}),
    "block": ("block", "block"),
}


def _drafter(key):
    name, opts = DRAFTERS[key]
    if opts == "eagle":
        opts = {"head": str(eagle_head_dir())}
    elif opts == "eagle3":
        opts = {"head": str(eagle3_head_dir())}
    elif opts == "block":
        opts = {"head": str(block_head_dir())}
    return name, opts


@pytest.fixture(scope="module")
def prompts():
    """Five real stories of different lengths; with few words cut, some rows reach the story's end
    (EOS) long before the others."""
    return tinystories_prompts(5, cut_words=6)


@pytest.mark.parametrize(
    "key, builder, options",
    [
        ("model", "opt-tree", {"nodes": 12}),
        ("ngram", "chain", {"k": 4}),
        ("eagle", "opt-tree", {"nodes": 10}),
        ("eagle3", "eagle2", {}),
        ("compose", "opt-tree", {"nodes": 8}),
        ("compose-raw", "opt-tree", {"nodes": 8}),
        ("model", "opt-tree", {"nodes": "auto"}),
        ("eagle", "opt-tree", {"nodes": "auto"}),  # rows measure their costs through rows of a row
        ("block", "opt-tree", {"nodes": 10}),
        ("block", "opt-tree", {"nodes": "auto"}),
    ],
)
def test_every_row_is_lossless_and_takes_its_own_steps(target64, greedy_reference, prompts, key, builder, options):
    name, opts = _drafter(key)
    dec = treespec.Decoder(target64, drafter=name, drafter_options=opts, builder=builder, builder_options=options)
    outs = dec.generate(prompts, max_new_tokens=64)
    assert len(outs) == len(prompts)
    reasons = set()
    for prompt, out in zip(prompts, outs):
        ids = dec.encode(prompt)
        assert out.prompt_ids == ids and out.token_ids == greedy_reference(ids, 64), (key, prompt)
        reasons.add(out.stats.stop_reason)
        # fixed trees and q that learn nothing (nodes=auto plans from every row's costs, a calibrated
        # composition learns from every row's outcomes): the row's steps are the ones it takes alone
        if options.get("nodes") != "auto" and key != "compose":
            alone = dec.generate(ids, max_new_tokens=64)
            assert [s.accepted for s in out.stats.steps] == [s.accepted for s in alone.stats.steps], (key, prompt)
            assert [s.tree_size for s in out.stats.steps] == [s.tree_size for s in alone.stats.steps]
    assert reasons == {"eos", "max_new_tokens"}  # rows left the batch at different steps
    assert sum(s.accepted for o in outs for s in o.stats.steps) > 0


def test_a_batch_of_one_and_the_single_prompt_api(target64, greedy_reference, prompts):
    dec = treespec.Decoder(target64, drafter="ngram", builder="chain")
    ids = dec.encode(prompts[1])
    [out] = dec.generate([ids], max_new_tokens=40)
    assert out.token_ids == greedy_reference(ids, 40)
    single = dec.generate(ids, max_new_tokens=40)  # a list of ids is ONE prompt
    assert isinstance(single, treespec.Output) and single.token_ids == out.token_ids


def test_sampling_rows_draw_from_their_own_seeded_generators(target64, prompts):
    """Row i of a sampled batch with seed s is token for token the single prompt sampled with seed s+i
    (the same draws in the same order): rows are independent and reproducible."""
    dec = treespec.Decoder(
        target64,
        drafter=str(STORIES260K),
        drafter_options={"layers": 3},
        builder="static",
        builder_options={"shape": "kary-2-3", "sample": True},
    )
    outs = dec.generate(prompts[:3], max_new_tokens=32, temperature=0.8, seed=11)
    for i, (prompt, out) in enumerate(zip(prompts[:3], outs)):
        alone = dec.generate(prompt, max_new_tokens=32, temperature=0.8, seed=11 + i)
        assert out.token_ids == alone.token_ids, i
    again = dec.generate(prompts[:3], max_new_tokens=32, temperature=0.8, seed=11)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_the_batched_forward_equals_each_rows_own_tree_forward(arch):
    """Random prefixes of different lengths and random trees of different sizes: one BatchTarget
    forward gives every row the logits its own TargetModel forward gives, and after per-row
    compaction the next batched forward still does (1e-9, float64)."""
    model = make_model(arch, "sdpa")
    rng = random.Random(7)
    batch, singles = BatchTarget(TargetModel(model)), []
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 11, 1, 7)]
    batch.prefill(prompts)
    for p in prompts:
        single = TargetModel(model)
        single.prefill(torch.tensor(p[:-1]))
        singles.append(single)
    roots = [p[-1] for p in prompts]
    for _ in range(3):
        trees = [random_tree(rng, root, n_layers=rng.randint(0, 3)) for root in roots]
        logits, _ = batch.forward_trees(
            [t.tensors(int(batch.lens[b]), dtype=torch.float64) for b, t in enumerate(trees)]
        )
        keeps = []
        for b, (tree, single) in enumerate(zip(trees, singles)):
            want, _ = single.forward_tree(tree.tensors(single.past_len, dtype=torch.float64))
            assert torch.allclose(logits[b, : len(tree)], want, atol=1e-9), (arch, b)
            leaf = rng.randrange(len(tree))  # accept the path to a random node
            keep = tree.ancestors[leaf].nonzero().flatten()
            keeps.append(keep)
            single.commit(keep)
            roots[b] = rng.randrange(VOCAB)
        batch.commit(keeps)
        assert batch.lens.tolist() == [s.past_len for s in singles]


def test_a_batch_prefill_asks_the_model_for_no_prompt_logits():
    """Rows' prompts are cached, never scored (each last token is its first tree's root): the batched
    prefill asks the model for one position's logits, not [B, S, V], and the cache it leaves verifies
    trees as before (the logits equal a single row's)."""
    model = make_model("llama", "sdpa")
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("logits_to_keep")), with_kwargs=True
    )
    try:
        batch = BatchTarget(TargetModel(model))
        prompts = [[5, 9, 13, 2, 7], [3, 8, 1]]
        batch.prefill(prompts)
    finally:
        hook.remove()
    assert seen == [1]
    single = TargetModel(model)
    single.prefill(torch.tensor(prompts[0][:-1]))
    tree = random_tree(random.Random(0), prompts[0][-1], n_layers=2)
    logits, _ = batch.forward_trees([tree.tensors(n, dtype=torch.float64) for n in batch.row_lens()])
    want, _ = single.forward_tree(tree.tensors(single.past_len, dtype=torch.float64))
    assert torch.allclose(logits[0, : len(tree)], want, atol=1e-9)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_row_on_the_targets_own_cache_then_rows_join(arch):
    """A batch of one row runs on the TargetModel's own cache (its fast path); when rows join, that
    cache becomes row 0 of the batched cache: every row's logits stay its own TargetModel's (1e-9)."""
    model = make_model(arch, "sdpa")
    rng = random.Random(3)
    target = TargetModel(model)
    batch = BatchTarget(target)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 2, 9)]
    singles = [TargetModel(model) for _ in prompts]
    for single, p in zip(singles, prompts):
        single.prefill(torch.tensor(p[:-1]))
    batch.prefill(prompts[:1])
    assert batch.single and batch.cache is None and target.past_len == 5  # the target's own sequence
    roots = [p[-1] for p in prompts]

    def step(rows: list[int]) -> None:
        trees = [random_tree(rng, roots[b], n_layers=rng.randint(0, 3)) for b in rows]
        lens = batch.row_lens()
        logits, _ = batch.forward_trees([t.tensors(n, dtype=torch.float64) for t, n in zip(trees, lens)])
        keeps = []
        for i, (b, tree) in enumerate(zip(rows, trees)):
            want, _ = singles[b].forward_tree(trees[i].tensors(singles[b].past_len, dtype=torch.float64))
            assert torch.allclose(logits[i, : len(tree)], want, atol=1e-9), (arch, b)
            keep = tree.ancestors[rng.randrange(len(tree))].nonzero().flatten()
            singles[b].commit(keep)
            keeps.append(keep)
            roots[b] = rng.randrange(VOCAB)
        batch.commit(keeps)
        assert batch.row_lens() == [singles[b].past_len for b in rows]

    step([0])
    step([0])
    batch.add(prompts[1:])
    assert not batch.single and batch.rows == 3
    for _ in range(3):
        step([0, 1, 2])


def test_batch_errors_are_one_line(target64, prompts):
    dec = treespec.Decoder(target64, drafter="ngram", builder="chain")
    with pytest.raises(treespec.ConfigError, match="stream is for one prompt"):
        dec.generate(prompts[:2], stream=print)
    with pytest.raises(treespec.ConfigError, match="prompt 2 of 2: the prompt is empty"):
        dec.generate([prompts[0], []])


def test_bench_batch_mode_writes_the_throughput_table(tmp_path):
    """`treespec bench --batch-size 1,2`: every configuration at every batch size, in batches and with
    rows refilled, rows checked against each prompt's own greedy generate, results.json, the plot and a
    report section."""
    import json

    from typer.testing import CliRunner

    from treespec.cli.app import app

    out = tmp_path / "batch"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--dataset",
            "tinystories",
            "--limit",
            "4",
            "--max-new-tokens",
            "12",
            "--target",
            str(STORIES260K),
            "--drafter",
            f"{STORIES260K} layers=3",
            "--builder",
            "opt-tree nodes=6",
            "--batch-size",
            "1,2",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    result = json.loads((out / "results.json").read_text())
    assert result["mode"] == "batch" and re.sub(r"^(\w+=\S* )*", "", result["command"]).startswith("treespec bench --")
    rows = result["rows"]
    assert {(r["kind"], r["batch_size"]) for r in rows} == {
        (k, b) for k in ("hf-greedy", "treespec", "treespec-refill") for b in (1, 2)
    }
    assert all(r["lossless"] for r in rows if r["kind"].startswith("treespec"))
    assert all(r["new_tokens"] == rows[0]["new_tokens"] for r in rows if r["kind"].startswith("treespec"))
    # paired by batch (each batch's rows run back to back): B = 1 has 4 batches, B = 2 two, refill one run
    for r in rows:
        assert len(r["per_batch"]) == (1 if r["kind"] == "treespec-refill" else 4 // r["batch_size"])
        assert sum(t for t, _ in r["per_batch"]) == r["new_tokens"]
        has = r["kind"] != "treespec-refill" and r["batch_size"] == 1  # at least 4 pairs
        assert (r["vs_hf_interval"] is not None) == has
        if has:
            assert r["vs_hf_interval"][0] <= r["vs_hf"] <= r["vs_hf_interval"][1]
    assert (out / "throughput_vs_batch.png").read_bytes()[:4] == b"\x89PNG"
    md = tmp_path / "b.md"
    res = CliRunner().invoke(app, ["bench-report", str(out), "--out", str(md)])
    assert res.exit_code == 0, res.output
    assert "× HF batched greedy" in md.read_text()


def test_batch_targets_read_auto_against_the_best_fixed_row_of_its_kind():
    from treespec.bench.batch_runner import target_lines

    def row(config, kind, rate, batches):
        per = [[100, 100 / rate]] * batches
        return {"config": config, "kind": kind, "batch_size": 4, "tokens_per_s": rate, "per_batch": per}

    rows = [
        row("hf-greedy", "hf-greedy", 50.0, 6),
        row("opt-tree nodes=auto | eagle", "treespec", 90.0, 6),
        row("chain k=4 | eagle", "treespec", 100.0, 6),
        row("chain k=3 | eagle", "treespec", 80.0, 6),
        row("opt-tree nodes=auto | eagle | refill", "treespec-refill", 99.0, 1),
        row("chain k=4 | eagle | refill", "treespec-refill", 60.0, 1),
    ]
    static, refill = target_lines(rows)
    assert static.startswith("- B=4 opt-tree nodes=auto | eagle: 0.90× chain k=4 | eagle (95% interval 0.90–0.90)")
    assert static.endswith("within 5%: MISSED")
    assert refill == "- B=4 opt-tree nodes=auto | eagle | refill: 1.65× chain k=4 | eagle | refill"


def test_cli_run_decodes_a_prompt_file_in_batches(tmp_path, greedy_reference, prompts):
    import json

    from typer.testing import CliRunner

    from treespec.cli.app import app

    f = tmp_path / "p.txt"
    f.write_text("\n\n".join(prompts[:3]) + "\n")
    res = CliRunner().invoke(
        app,
        [
            "run",
            "--target",
            str(STORIES260K),
            "--dtype",
            "float64",
            "--drafter",
            "ngram",
            "--builder",
            "chain",
            "--prompt-file",
            str(f),
            "--batch-size",
            "2",
            "--max-new-tokens",
            "20",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == [1, 2, 3]
    for p, x in zip(prompts[:3], lines):
        ids = greedy_reference.target.tokenizer(p).input_ids
        assert x["token_ids"] == greedy_reference(ids, 20)
    assert res.stderr.count("(2 rows)") == 1  # one chunk of up to 4 x 2 prompts, rows refilled


@pytest.mark.parametrize(
    "key, builder, options",
    [
        ("eagle", "opt-tree", {"nodes": 10}),
        ("model", "chain", {"k": 3}),
        ("ngram", "chain", {"k": 4}),
    ],
)
def test_continuous_batching_rows_join_as_others_finish_and_stay_lossless(
    target64, greedy_reference, key, builder, options
):
    """Six prompts (one of a single token) through two rows: each finished row's place goes to the next
    prompt, whose cache joins the batch mid-run; every output equals its prompt's greedy generate
    and takes the steps it takes alone."""
    name, opts = _drafter(key)
    dec = treespec.Decoder(target64, drafter=name, drafter_options=opts, builder=builder, builder_options=options)
    prompts = tinystories_prompts(5, cut_words=4)
    ids = [dec.encode(p) for p in prompts]
    ids.insert(2, ids[0][:1])
    outs = dec.generate(ids, max_new_tokens=40, batch_size=2)
    assert len(outs) == 6
    for p, out in zip(ids, outs):
        assert out.prompt_ids == p and out.token_ids == greedy_reference(p, 40), key
        alone = dec.generate(p, max_new_tokens=40)
        assert [s.tree_size for s in out.stats.steps] == [s.tree_size for s in alone.stats.steps]
        assert out.stats.stop_reason in ("eos", "max_new_tokens")
    wide = dec.generate(ids, max_new_tokens=40, batch_size=100)  # more rows than prompts: all at once
    assert [o.token_ids for o in wide] == [o.token_ids for o in outs]


def test_continuous_batching_sampled_rows_keep_their_seeds(target64, prompts):
    dec = treespec.Decoder(
        target64,
        drafter=str(STORIES260K),
        drafter_options={"layers": 3},
        builder="static",
        builder_options={"shape": "kary-2-3", "sample": True},
    )
    outs = dec.generate(prompts[:4], max_new_tokens=24, temperature=0.9, seed=5, batch_size=2)
    for i, (prompt, out) in enumerate(zip(prompts[:4], outs)):
        assert out.token_ids == dec.generate(prompt, max_new_tokens=24, temperature=0.9, seed=5 + i).token_ids, i
    with pytest.raises(treespec.ConfigError, match="batch_size must be"):
        dec.generate(prompts[:2], batch_size=0)
    with pytest.raises(treespec.ConfigError, match="batch_size is for a list of prompts"):
        dec.generate(prompts[0], batch_size=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_every_row_is_lossless_on_llama_qwen2_and_gpt2(arch):
    """Decoding, not just the forward: seeded random-weight float64 models of the three families (the
    only real checkpoint here is a Llama), a self-draft of the target's first layer batched in one
    draft forward, five prompts of 2-23 tokens through two rows refilled as rows finish: every row equals
    Hugging Face's own greedy ``generate`` of its prompt."""
    model = make_model(arch, "sdpa")
    target = TargetModel(model)
    dec = treespec.Decoder(
        target, drafter="self", drafter_options={"layers": 1}, builder="opt-tree", builder_options={"nodes": 6}
    )
    assert dec.drafter.rows(2).batched
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (9, 2, 23, 5, 14)]
    outs = dec.generate(prompts, max_new_tokens=24, batch_size=2)
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=24,
                pad_token_id=VOCAB - 1,
            )[0, len(p) :].tolist()
        eos = target.eos_token_ids
        cut = next((i for i, t in enumerate(ref) if t in eos), None)
        assert out.token_ids == (ref[: cut + 1] if cut is not None else ref), arch
    assert sum(s.accepted for o in outs for s in o.stats.steps) > 0


def test_repeated_batches_leave_nothing_behind(target64, prompts):
    """No growth across repeated batches: after a warm-up, decoding the same batch again leaves the same
    number of live tensors (the batched caches, draft rows and trees of a call are all freed; what
    stays is the Decoder's own state: models, builders, calibration)."""
    import gc

    dec = treespec.Decoder(
        target64,
        drafter="eagle",
        drafter_options={"head": str(eagle_head_dir())},
        builder="opt-tree",
        builder_options={"nodes": 8},
    )

    def live() -> int:
        import warnings

        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated objects warns
            warnings.simplefilter("ignore")
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    dec.generate(prompts, max_new_tokens=24, batch_size=3)
    counts = []
    for _ in range(3):
        dec.generate(prompts, max_new_tokens=24, batch_size=3)
        counts.append(live())
    assert counts[0] == counts[1] == counts[2], counts


def test_rows_of_a_builder_instance_share_no_state(target64):
    """Review leftover: ``Decoder(builder=<instance>)`` gave batch rows shallow copies of it, so every row
    shared one cost planner, and the rows' calibration map was the user's builder's. Rows have planners
    of their own; they share one calibration map by design (``OptTreeBuilder.join_batch``: one drafter,
    one map), a fresh one, never the single-sequence builder's."""
    from treespec.plugins.opt_tree import OptTreeBuilder

    builder = OptTreeBuilder(OptTreeBuilder.Config(nodes="auto"))
    dec = treespec.Decoder(target64, drafter="ngram", builder=builder)
    rows = dec.row_builders([dec.drafter.rows(2).drafters[i] for i in range(2)])
    assert rows[0] is not rows[1] and rows[0].planner is not rows[1].planner
    assert rows[0].planner is not builder.planner and rows[0].planner.cost is not rows[1].planner.cost
    assert rows[0].calibration is rows[1].calibration is rows[1].planner.calibration
    assert rows[0].calibration is not builder.calibration


@pytest.mark.parametrize("key", ["model", "eagle"])
def test_batch_rows_carry_the_batch_state_and_the_users_drafter_none(target64, prompts, key):
    """A batch row is a fork with a row class mixed in (group, index, the shared cache's columns); the
    drafter the Decoder holds for one sequence has none of it, before and after a batch, and a row's
    cost profile is keyed by its drafter's own class."""
    from treespec.plugins.cost_aware import profile_key
    from treespec.rows_cache import CacheRow

    name, opts = _drafter(key)
    dec = treespec.Decoder(target64, drafter=name, drafter_options=opts, builder="chain", builder_options={"k": 3})
    dec.generate(prompts[:3], max_new_tokens=8)
    own = dec.drafter
    assert not isinstance(own, CacheRow)
    assert not any(hasattr(own, a) for a in ("group", "index", "cols", "_group", "_index"))
    rows = own.rows(3)
    assert [r.index for r in rows.drafters] == [0, 1, 2] and all(r.group is rows for r in rows.drafters)
    assert all(isinstance(r, CacheRow) and isinstance(r, type(own)) for r in rows.drafters)
    rows.keep([2, 0])
    assert [r.index for r in rows.drafters] == [0, 1]
    assert profile_key(dec.target, rows.drafters[0]) == profile_key(dec.target, own)
