"""`treespec train prompts` (treespec/train/magpie.py): chat prompts sampled from the target's own
template. A copy of the real stories260K model gets a chat template whose user turn ends with a full
stop, so its first sentences are the "requests" (it ends a sentence as an instruct model ends a turn)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from conftest import SHARED, STORIES260K
from treespec.errors import ConfigError
from treespec.train import magpie
from treespec.train.magpie import Filter, MagpieSettings, write_prompts

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}.{% endfor %}"


@pytest.fixture
def chat_stories(tmp_path):
    folder = tmp_path / "stories-chat"
    shutil.copytree(STORIES260K, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return folder


def test_the_prefix_is_the_template_before_the_user_message(chat_stories):
    tok = AutoTokenizer.from_pretrained(chat_stories)
    assert magpie.query_prefix(tok) == [tok.bos_token_id]
    full_stop = tok.convert_tokens_to_ids(".")
    assert magpie.end_of_turn(tok) == sorted([full_stop, tok.eos_token_id])


def test_a_tokenizer_without_a_template_is_one_line():
    tok = AutoTokenizer.from_pretrained(STORIES260K)
    with pytest.raises(ConfigError, match="no chat template"):
        magpie.query_prefix(tok)


def test_the_filter_drops_unfinished_short_repeated_and_benchmark_queries():
    mt = [json.loads(line) for line in (SHARED / "prompts" / "mt_bench.jsonl").read_text().splitlines()]
    quoted = " ".join(mt[3]["turns"][0].split()[:12])  # a real MT-Bench prompt's first 12 words
    keep = Filter(MagpieSettings(target="t", out="o.jsonl"), magpie.evaluation_shingles())
    assert keep.keep("How do I bake bread at home?", True)
    assert not keep.keep("How do I bake a cake at home?", False)  # the model did not end its turn
    assert not keep.keep("Hi there", True)  # two words
    assert not keep.keep("how do I   BAKE bread at home", True)  # a repeat, case and spacing aside
    assert not keep.keep(f"Please help: {quoted} and more", True)
    assert keep.keep(" ".join(quoted.split()[:7]) + " zebra", True)  # 7 words in common: kept
    assert keep.dropped == {"unfinished": 1, "length": 1, "repeat": 1, "overlap": 1}


def test_queries_are_written_and_a_resumed_run_writes_what_one_run_would(chat_stories, tmp_path):
    def run(path, count):
        s = MagpieSettings(target=str(chat_stories), out=str(path), count=count, batch_size=4, max_tokens=40)
        return write_prompts(s, lambda *a: None, lambda m: None)

    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    run(whole, 6)
    run(part, 2)
    run(part, 6)
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert len(rows) == 6 and all(r["turns"][0] and r["category"] == "magpie" for r in rows)
    assert part.read_text() == whole.read_text()
    assert len({r["turns"][0] for r in rows}) == 6


def test_a_model_that_never_ends_its_turn_stops_with_one_line(chat_stories, tmp_path, monkeypatch):
    monkeypatch.setattr(magpie, "GIVE_UP", 2)
    s = MagpieSettings(target=str(chat_stories), out=str(tmp_path / "p.jsonl"), count=3, batch_size=2, max_tokens=2)
    with pytest.raises(ConfigError, match="2 batches in a row kept no query .* instruct model"):
        write_prompts(s, lambda *a: None, lambda m: None)


def test_growing_a_file_it_did_not_write_is_one_line(tmp_path):
    other = tmp_path / "mine.jsonl"
    other.write_text('{"question": "what is 2 + 2?"}\n')
    s = MagpieSettings(target=str(STORIES260K), out=str(other))
    with pytest.raises(ConfigError, match="did not write: pass a new --out"):
        write_prompts(s, lambda *a: None, lambda m: None)
