"""The Python API's boundary (issue 16): concurrent calls on one Decoder are serialised and stay
lossless; misuse is one ConfigError line before anything runs."""

from __future__ import annotations

import threading

import pytest
import torch

import treespec
from conftest import STORIES260K, tinystories_prompts


@pytest.fixture(scope="module")
def decoder(target64):
    return treespec.Decoder(
        target64,
        drafter=str(STORIES260K),
        drafter_options={"layers": 3},
        builder="opt-tree",
        builder_options={"nodes": 12},
    )


def _generate_in_threads(decoders, prompts, n: int) -> dict[int, list[int]]:
    """Thread i decodes prompts[i] twice with decoders[i % len(decoders)], all starting together."""
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(2):
                results[i] = decoders[i % len(decoders)].generate(prompts[i], max_new_tokens=n).token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_concurrent_generate_on_one_decoder_is_lossless(decoder, greedy_reference):
    """Two threads share one Decoder (one target cache, one draft cache): each output must still be
    the target's own greedy continuation of its own prompt."""
    prompts = [decoder.encode(p) for p in tinystories_prompts(4)]
    results = _generate_in_threads([decoder], prompts, 48)
    for i, prompt in enumerate(prompts):
        want = greedy_reference(prompt, 48)
        assert results[i] == want, greedy_reference.explain(prompt, results[i], want)


def test_concurrent_decoders_sharing_one_target_are_lossless(decoder, target64, greedy_reference):
    """Two Decoders on ONE TargetModel (one KV cache) in parallel threads: the target's lock
    serialises them."""
    other = treespec.Decoder(target64, drafter="ngram", builder="chain", builder_options={"k": 2})
    prompts = [decoder.encode(p) for p in tinystories_prompts(4)]
    results = _generate_in_threads([decoder, other], prompts, 32)
    for i, prompt in enumerate(prompts):
        want = greedy_reference(prompt, 32)
        assert results[i] == want, greedy_reference.explain(prompt, results[i], want)


def test_generate_from_its_own_stream_callback_is_refused(decoder):
    def again(_tokens):
        decoder.generate([1, 500], max_new_tokens=2)

    with pytest.raises(treespec.DecodingError, match="already decoding on this thread"):
        decoder.generate([1, 500], max_new_tokens=4, stream=again)
    assert decoder.generate([1, 500], max_new_tokens=3).token_ids  # and the Decoder still works


@pytest.mark.parametrize(
    "prompt, message",
    [
        (torch.zeros(2, 1, 3, dtype=torch.long), r"shape \[2, 1, 3\]"),  # ([2, 3] is two rows: test_hf.py)
        (torch.tensor([1.0, 500.0]), "dtype torch.float32: token ids must be integers"),
        (torch.zeros(1, 1, 3, dtype=torch.long), r"shape \[1, 1, 3\]"),
        ([1, -5], r"token id -5 is outside the target's vocabulary \[0, 512\)"),
        ([1, 512], r"token id 512 is outside"),
        ([1, 2.5], r"holds 2.5 \(float\): token ids must be integers"),
        ([1, True], r"holds True \(bool\)"),
        ({"ids": [1]}, "the prompt is a dict"),
        (None, "generate\\(\\) needs a prompt"),
        ([], "the prompt is empty"),
    ],
)
def test_bad_prompts_are_one_line(decoder, prompt, message):
    with pytest.raises(treespec.ConfigError, match=message) as err:
        decoder.generate(prompt, max_new_tokens=4)
    assert "\n" not in str(err.value)


def test_a_one_row_batch_tensor_is_the_same_prompt(decoder):
    ids = [1, 403, 407, 261]
    a = decoder.generate(torch.tensor([ids]), max_new_tokens=8).token_ids
    assert a == decoder.generate(ids, max_new_tokens=8).token_ids


@pytest.mark.parametrize(
    "value, message",
    [
        (2.5, "whole number > 0, got 2.5"),
        (0, "must be > 0, got 0"),
        (True, "whole number > 0, got True"),
        ("8", "whole number"),
    ],
)
def test_bad_max_new_tokens(decoder, value, message):
    with pytest.raises(treespec.ConfigError, match=message):
        decoder.generate([1, 500], max_new_tokens=value)


def test_unknown_keyword_and_bad_stream_are_config_errors(decoder):
    with pytest.raises(treespec.ConfigError, match="unknown argument.*'num_beams'"):
        decoder.generate([1, 500], max_new_tokens=4, num_beams=2)
    with pytest.raises(treespec.ConfigError, match="stream must be a callable"):
        decoder.generate([1, 500], max_new_tokens=4, stream=3)


def test_model_drafter_layers_beyond_the_checkpoint_are_refused(target64):
    """-D layers=K on a K'-layer draft with K > K' would build K - K' random layers silently."""
    with pytest.raises(treespec.ModelLoadError, match=r"has 5 decoder layers, so layers=99 would add 94 randomly"):
        treespec.Decoder(target64, drafter=str(STORIES260K), drafter_options={"layers": 99})
    dec = treespec.Decoder(target64, drafter=str(STORIES260K), drafter_options={"layers": 5})  # all of them: fine
    assert dec.generate([1, 500], max_new_tokens=2).token_ids


@pytest.mark.parametrize(
    "builder, options",
    [
        ("opt-tree", {"nodes": 100000}),
        ("eagle2", {"total_tokens": 513}),
        ("chain", {"k": 600}),
        ("static", {"shape": "kary-8-4"}),
    ],
)
def test_node_budgets_the_target_cannot_verify_are_refused_at_once(target64, builder, options):
    """stories260K's context is 512: no tree forward can hold more nodes (and a huge budget drafted
    for minutes before failing to allocate tens of GB)."""
    assert target64.max_tree_nodes == 512
    with pytest.raises(treespec.ConfigError, match=r"verifies at most 512 in one forward.*at most 512 nodes") as err:
        treespec.Decoder(
            target64, drafter=str(STORIES260K), drafter_options={"layers": 3}, builder=builder, builder_options=options
        )
    assert "\n" not in str(err.value)
    treespec.Decoder(
        target64, drafter="ngram", builder="opt-tree", builder_options={"nodes": 512}
    )  # the limit itself is fine


def test_building_a_decoder_while_another_thread_decodes_waits_its_turn(
    decoder, target64, greedy_reference, monkeypatch
):
    """`opt-tree nodes=auto` measures its costs with target forwards when a Decoder is built. Built while
    another thread decoded on the same target, it broke that decode (every generate failed): the
    measurement now holds the target like a decode does."""
    from treespec import cost_measure

    monkeypatch.setattr("treespec.plugins.cost_aware.load_profile", lambda key: None)  # measure, never a saved profile
    prompts = [decoder.encode(p) for p in tinystories_prompts(3)]
    results: list[list[int]] = []
    errors: list[BaseException] = []
    decoding = threading.Event()
    stop = threading.Event()

    def decode() -> None:
        try:
            while not stop.is_set():
                for prompt in prompts:
                    decoding.set()
                    results.append(decoder.generate(prompt, max_new_tokens=24).token_ids)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=decode)
    worker.start()
    try:
        decoding.wait()
        for _ in range(3):
            cost_measure._QUICK.clear()  # each Decoder measures again
            treespec.Decoder(target64, drafter="ngram", builder="opt-tree", builder_options={"nodes": "auto"})
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    wants = [greedy_reference(p, 24) for p in prompts]
    for i, got in enumerate(results):
        assert got == wants[i % len(prompts)], greedy_reference.explain(
            prompts[i % len(prompts)], got, wants[i % len(prompts)]
        )


# ---------------------------------------------------------------------------------------------------
# issue 27 (10, 11): wrong types and values are one ConfigError line, never a TypeError or ValueError
# from deep inside, an allocation of gigabytes, or a value silently read as another
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": 2**64, "temperature": 0.7}, r"seed 18446744073709551616 is out of range"),  # was ValueError: Overflow
        ({"seed": 1.5, "temperature": 0.7}, r"seed must be a whole number, got 1.5"),  # was truncated to 1
        ({"seed": "1", "temperature": 0.7}, r"seed must be a whole number, got '1'"),
        ({"temperature": "0.7"}, r"temperature must be a number, got '0.7'"),  # was TypeError
        ({"temperature": [1]}, r"temperature must be a number"),
        ({"temperature": 0.7, "top_p": "0.9"}, r"top_p must be a number, got '0.9'"),  # was read as 0.9
        ({"temperature": 0.7, "draft_temperature": "x"}, r"draft_temperature must be a number"),  # was TypeError
    ],
)
def test_bad_sampling_arguments_are_config_errors(decoder, kwargs, message):
    with pytest.raises(treespec.ConfigError, match=message) as err:
        decoder.generate([1, 500], max_new_tokens=4, **kwargs)
    assert "\n" not in str(err.value)


def test_a_batch_seed_out_of_range_is_a_config_error(decoder):
    with pytest.raises(treespec.ConfigError, match="seed"):
        decoder.generate([[1, 500], [1, 501]], max_new_tokens=4, temperature=0.7, seed=2**64)


T = "<target64>"  # the module's float64 target, put in by the test


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((3,), {}, r"target must be a model name or path \(str\), a loaded transformers model or a TargetModel, got 3"),
        ((None,), {}, r"target must be"),
        ((T, 3), {}, r"drafter must be a drafter name"),
        ((T, None, "chain"), {}, r"drafter must be"),
        ((T, "ngram", None), {}, r"builder must be a builder name"),
        ((T, "ngram", "chain"), {"builder_options": "k=3"}, r"builder_options must be a dict"),
        ((T, "ngram", "chain"), {"drafter_options": [1]}, r"drafter_options must be a dict"),
        ((str(STORIES260K), "ngram", "chain"), {"device": "meta"}, r"holds tensor shapes but no values"),
        (
            (str(STORIES260K), "ngram", "chain"),
            {"device_map": "auto", "offload_folder": 3},
            r"offload_folder must be a folder path",
        ),
        ((T, "ngram+ngram", "chain"), {"drafter_options": {"merge": "mix", "weights": "nan,1"}}, r"finite number"),
        (
            (T, "ngram+ngram", "chain"),
            {"drafter_options": {"merge": "mix", "weights": [float("inf"), 1]}},
            r"finite number",
        ),
        ((T, str(STORIES260K), "chain"), {"drafter_options": {"temperature": float("inf")}}, r"finite number"),
        ((T, "ngram", "eagle2"), {"builder_options": {"top_k": 200}}, r"drafts up to 200,200 nodes per step"),
        ((T, "ngram", "opt-tree"), {"builder_options": {"nodes": True}}, r"option 'nodes' is not a yes/no option"),
    ],
)
def test_bad_decoder_arguments_are_config_errors(target64, args, kwargs, message):
    args = tuple(target64 if a is T else a for a in args)
    with pytest.raises(treespec.ConfigError, match=message) as err:
        treespec.Decoder(*args, **kwargs).generate([1, 500], max_new_tokens=2)
    assert "\n" not in str(err.value)


def test_a_path_object_names_a_model():
    assert treespec.Decoder(STORIES260K, "ngram", "chain").target.name == str(STORIES260K)
