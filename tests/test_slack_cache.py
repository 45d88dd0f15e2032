"""``treespec.slack_cache``: a cache that appends in place behaves exactly as transformers' ``DynamicCache``
under every operation treespec performs on caches (append, crop, copy rows into place, move rows
between columns, drop batch rows, concatenate two caches), and a real model's forwards through it give
the same logits. ``kv.grouped_sdpa`` (grouped KV heads passed to SDPA as they are) changes no logit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import STORIES260K
from treespec import kv
from treespec import slack_cache as slack_cache_module
from treespec.slack_cache import SLACK_FROM_BYTES, SlackLayer, slack_cache


def _kv(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 2, t, 4, generator=gen), torch.randn(b, 2, t, 4, generator=gen)  # [B, H_kv, T, D]


def _same(a: DynamicCache, b: DynamicCache) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        assert la.get_seq_length() == lb.get_seq_length()


#: where SlackLayer stops appending with ``cat``: always room (0), switching both ways as these small test
#: caches grow and shrink (700 bytes: about 7 rows of [3, 2, T, 4]), and the default (every test cache is small)
THRESHOLDS = [0, 700, SLACK_FROM_BYTES]


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_every_cache_operation_matches_dynamic_cache(threshold, monkeypatch):
    monkeypatch.setattr(slack_cache_module, "SLACK_FROM_BYTES", threshold)
    gen = torch.Generator().manual_seed(0)
    ref, slack = DynamicCache(), slack_cache()
    ops = []  # (name, function of a cache), applied to both
    for step in range(40):
        kind = ["append", "append", "crop", "keep_rows", "move", "keep_batch", "concat"][step % 7]
        if kind == "append":
            k, v = _kv(3, int(torch.randint(1, 9, (1,), generator=gen)), gen)
            ops.append(lambda c, k=k, v=v: [c.update(k, v, i) for i in range(2)])
        elif kind == "crop":
            ops.append(lambda c: kv.crop_cache(c, max(1, c.get_seq_length() - 3)))
        elif kind == "keep_rows":
            ops.append(lambda c: kv.keep_rows(c, 1, [2, 4]) if c.get_seq_length() > 4 else None)
        elif kind == "move":
            ops.append(
                lambda c: (
                    kv.move_cache_rows(c, torch.tensor([0, 2]), torch.tensor([2, 3]), torch.tensor([0, 1]))
                    if c.get_seq_length() > 3
                    else None
                )
            )
        elif kind == "keep_batch":  # rows leaving the batch, as BatchTarget.keep does it

            def keep(c):
                for layer in c.layers:
                    layer.keys = layer.keys.index_select(0, torch.tensor([0, 1, 2]))
                    layer.values = layer.values.index_select(0, torch.tensor([0, 1, 2]))

            ops.append(keep)
        else:  # rows joining, as BatchTarget.add does it: then keep three of them again
            k, v = _kv(2, 3, gen)

            def join(c, k=k, v=v):
                other = DynamicCache() if type(c.layers[0]) is not SlackLayer else slack_cache()
                for i in range(2):
                    other.update(k, v, i)
                w = c.get_seq_length()
                kv.concat_caches(c, w, other, 3, 3, 2)
                for layer in c.layers:
                    layer.keys, layer.values = layer.keys[[0, 3, 4]], layer.values[[0, 3, 4]]

            ops.append(join)
    for op in ops:
        op(ref)
        op(slack)
        _same(ref, slack)
    assert all(type(layer) is SlackLayer for layer in slack.layers)


def test_appends_reuse_the_buffer(monkeypatch):
    """The point of it: after the first append, appends and crops do not reallocate."""
    monkeypatch.setattr(slack_cache_module, "SLACK_FROM_BYTES", 0)
    cache = slack_cache()
    gen = torch.Generator().manual_seed(1)
    cache.update(*_kv(2, 10, gen), 0)
    buf = cache.layers[0]._kbuf
    for _ in range(5):
        cache.update(*_kv(2, 4, gen), 0)
        kv.crop_cache(cache, cache.get_seq_length() - 2)
    assert cache.layers[0]._kbuf is buf and cache.layers[0].keys.data_ptr() == buf.data_ptr()
    cache.layers[0].keys = cache.layers[0].keys.clone()  # replaced from outside: the next append starts anew
    cache.layers[0].values = cache.layers[0].values.clone()
    before = cache.layers[0].keys.clone()
    cache.update(*_kv(2, 4, gen), 0)
    assert cache.layers[0]._kbuf is not buf and torch.equal(cache.layers[0].keys[:, :, : before.shape[2]], before)


def test_small_caches_append_with_cat_and_large_ones_into_room():
    """Below SLACK_FROM_BYTES of keys a layer appends as DynamicLayer does (a new tensor each time, no
    buffer); past it, into room (the same buffer across appends); cropped back below, ``cat`` again."""
    cache = slack_cache()
    gen = torch.Generator().manual_seed(2)
    row = 2 * 4 * 4  # bytes of keys per position in [1, 2, T, 4] float32
    small = SLACK_FROM_BYTES // row // 2
    cache.update(*_kv(1, small, gen), 0)
    first = cache.layers[0]
    assert first._kbuf is None and first.keys.is_contiguous()
    cache.update(*_kv(1, small + 8, gen), 0)  # past the threshold: a buffer with room
    buf = first._kbuf
    assert buf is not None and first.keys.data_ptr() == buf.data_ptr()
    cache.update(*_kv(1, 3, gen), 0)
    assert first._kbuf is buf  # appended into the room
    kv.crop_cache(cache, 4)  # far below the threshold again
    cache.update(*_kv(1, 1, gen), 0)
    assert first._kbuf is None and first.get_seq_length() == 5


@pytest.fixture(scope="module")
def stories64():
    return AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float64).eval()


@torch.inference_mode()
@pytest.mark.parametrize("threshold", [0, SLACK_FROM_BYTES])
def test_model_forwards_through_the_slack_cache_equal_dynamic_cache(stories64, threshold, monkeypatch):
    """Prefill, a masked tree-like block, a crop, and more steps: the same logits bit for bit."""
    monkeypatch.setattr(slack_cache_module, "SLACK_FROM_BYTES", threshold)
    ids = torch.tensor([[1, 403, 407, 261, 378, 429, 306, 414, 269, 263]])
    outs = []
    for cache in (DynamicCache(), slack_cache()):
        run = [stories64(input_ids=ids, cache=cache, use_cache=True).logits]
        block = torch.tensor([[300, 301, 302]])
        mask = kv.tree_mask(10, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), torch.float64)
        run.append(
            stories64(
                input_ids=block,
                position_ids=torch.tensor([[10, 11, 11]]),
                attention_mask=mask[None, None],
                cache=cache,
                use_cache=True,
            ).logits
        )
        kv.keep_rows(cache, 10, [10, 12])
        for t in (5, 6, 7):
            run.append(stories64(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits)
        outs.append(run)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_grouped_sdpa_changes_no_logit(stories64, monkeypatch):
    """stories260K has 8 query heads over 4 KV heads: a masked forward with and without the switch
    (which must reach torch: SDPA is called with enable_gqa and the KV heads unexpanded)."""
    assert kv.grouped_sdpa_helps(stories64)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((kwargs.get("enable_gqa", False), k.shape[1]))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.tensor([[1, 403, 407, 261, 378, 429, 306, 414, 269, 263, 300, 301]])
    visible = torch.ones(12, 12, dtype=torch.bool).tril()
    visible[11, 10] = False  # a sibling, not an ancestor
    mask = kv.float_mask(visible, torch.float64)[None, None]
    plain = stories64(input_ids=ids, attention_mask=mask).logits
    with kv.grouped_sdpa(True):
        grouped = stories64(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(plain, grouped, atol=1e-12, rtol=0)
    layers = stories64.config.num_hidden_layers
    assert seen == [(False, 8)] * layers + [(True, 4)] * layers
    assert not kv._GROUPED.get()  # only inside the context


@torch.inference_mode()
def test_grouped_sdpa_holds_only_in_its_own_thread(stories64, monkeypatch):
    """The switch is a context variable: a forward in another thread while one thread is inside
    ``grouped_sdpa(True)`` takes transformers' own path (the KV heads expanded)."""
    import threading

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((threading.current_thread().name, kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.tensor([[1, 403, 407, 261, 378]])
    mask = kv.float_mask(torch.ones(5, 5, dtype=torch.bool).tril(), torch.float64)[None, None]
    inside, outside = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        with torch.inference_mode():
            stories64(input_ids=ids, attention_mask=mask)
        outside.set()

    t = threading.Thread(target=other, name="other")
    t.start()
    with kv.grouped_sdpa(True):
        inside.set()
        outside.wait()  # the other thread's forward ran while this one was inside the switch
        stories64(input_ids=ids, attention_mask=mask)
    t.join()
    assert {flag for name, flag in seen if name == "other"} == {False}
    assert {flag for name, flag in seen if name != "other"} == {True}
