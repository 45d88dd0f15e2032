"""Drafter `block` (``plugins/block.py``, ``block_head.py``, ``block_train.py``): one forward gives
every depth's marginals; the decode-time forward with its cached context is the training forward;
every builder decodes losslessly with it; trees follow the product of marginals; bad heads and
settings are one line; `treespec train block` trains, resumes and decodes losslessly."""

from __future__ import annotations

import heapq
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import treespec
from conftest import STORIES260K, block_head_dir, eagle3_head_dir, tinystories_prompts
from treespec.errors import ConfigError, TreespecError
from treespec.interfaces import Commit
from treespec.plugins.block import BlockDrafter
from treespec.plugins.block_head import BlockHead, BlockSpec
from treespec.plugins.configs import BlockConfig
from treespec.plugins.eagle3_head import default_layers
from treespec.plugins.eagle_head import head_config_for
from treespec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_head(target, k: int = 4, layers: int = 2, seed: int = 0, last: bool = True) -> BlockHead:
    torch.manual_seed(seed)
    cfg = target.model.config
    layers_in = default_layers(cfg.num_hidden_layers)
    spec = BlockSpec(k, layers_in, cfg.hidden_size, cfg.vocab_size, cfg.vocab_size, last_feature=last)
    head = BlockHead(head_config_for(cfg, layers=layers), spec).to(torch.float64)
    with torch.no_grad():
        head.mask.normal_()
        for p in head.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return head.eval()


@pytest.mark.parametrize("last", [True, False])
def test_the_decoding_forward_is_the_training_forward(target64, last):
    """Blocks at several anchors of two sequences, each seeing only its context (training's batched
    ``forward``), equal one block at a time over exactly that context (decoding's ``forward_one``)."""
    head = random_head(target64, last=last)
    gen = torch.Generator().manual_seed(1)
    b, t, width = 2, 11, head.fc.in_features
    feats = torch.randn(b, t, width, generator=gen, dtype=torch.float64)
    roots = torch.randn(b, 3, head.config.hidden_size, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[0, 4, 10], [1, 7, 3]])
    c = head.fuse(feats)
    ctx = head.context(c, torch.arange(t)[None].expand(b, t))
    newest = c.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, c.shape[-1])) * (anchors > 0)[..., None]
    x = head.block_input(roots, newest)  # [B, N, K+1, H]
    positions = anchors[..., None] + torch.arange(5)
    got = head(x, positions, ctx, torch.arange(t)[None, None] < anchors[..., None])
    for r in range(b):
        for n in range(3):
            a = int(anchors[r, n])
            own_c = head.fuse(feats[r : r + 1, :a])
            own = head.context(own_c, torch.arange(a)[None])
            want = head.forward_one(head.block_input(roots[r, n], own_c[0, -1] if a else None), positions[r, n], own)
            assert torch.allclose(got[r, n], want, atol=1e-10), (r, n)


class Recording(BlockDrafter):
    """The block drafter, recording the committed sequence (prompt, then each commit's tokens)."""

    def prefill(self, context):
        self.seen = context.input_ids.tolist()
        super().prefill(context)

    def commit(self, commit: Commit):
        self.seen += list(commit.tokens)
        super().commit(commit)


@pytest.mark.parametrize("head", ["trained", "random, last_feature"])
def test_marginals_after_many_steps_equal_a_fresh_computation(target64, tmp_path, head):
    """After a decode of many steps (accepted paths and bonus tokens), the next step's proposals are
    those of the head run from scratch on the target's hidden states of the whole committed sequence:
    the cached context keys (and the newest context row, with ``last_feature``) hold the target's true
    features at the right positions."""
    folder = block_head_dir()
    if head != "trained":
        folder = tmp_path / "random"
        random_head(target64, last=True).save(folder)
    d = Recording(BlockConfig(head=str(folder)), target64)
    dec = treespec.Decoder(target64, drafter=d, builder="opt-tree", builder_options={"nodes": 8})
    prompt = dec.encode(tinystories_prompts(2)[1])
    out = dec.generate(prompt, max_new_tokens=40)
    assert len(out.stats.steps) > 3 and (head != "trained" or sum(s.accepted for s in out.stats.steps) > 0)
    seq = d.seen
    d.begin_step(seq[-1])
    tree = DraftTree(seq[-1])
    got = d.expand(tree, torch.tensor([0]), 5)
    with torch.inference_mode():
        hs = target64.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        fused = torch.cat([hs[i][0] for i in d.target_hidden_layers], -1)[:-1]  # [C-1, 3H]: all but the root
        head = d.head
        c = head.fuse(fused[None])
        ctx = head.context(c, torch.arange(len(seq) - 1)[None])
        x = head.block_input(torch.nn.functional.embedding(torch.tensor([seq[-1]]), d.embed_weight), c[:, -1])[0]
        out = head.forward_one(x, torch.arange(len(seq) - 1, len(seq) + head.spec.block_size), ctx)
        logits = head.logits(out[1:], d.out_weight)
        q = torch.softmax(logits[0].double() / float(d.temperatures[0]), -1)
    top = q.topk(5)
    assert got.tokens[0].tolist() == d.ids[top.indices].tolist()
    assert torch.allclose(got.q[0].double(), top.values, atol=1e-6)


def test_nodes_at_the_same_depth_share_candidates_and_depth_k_gets_none(target64):
    d = BlockDrafter(BlockConfig(head=str(block_head_dir())), target64)
    dec = treespec.Decoder(target64, drafter=d, builder="chain")
    treespec.step.prefill(target64, d, dec.encode(tinystories_prompts(1)[0]))
    tree = DraftTree(5)
    d.begin_step(5)
    first = d.expand(tree, torch.tensor([0]), 3)
    a, b = tree.add_children(torch.zeros(2, dtype=torch.long), first.tokens[0, :2], first.q[0, :2]).tolist()
    second = d.expand(tree, torch.tensor([a, b]), 3)
    assert torch.equal(second.tokens[0], second.tokens[1]) and torch.equal(second.q[0], second.q[1])
    alone = d.expand(tree, torch.tensor([a]), 3)  # one node (a chain's): the same answer
    assert torch.equal(alone.tokens, second.tokens[:1]) and torch.equal(alone.q, second.q[:1])
    with torch.inference_mode():  # a copy: a caller that writes into its proposals changes no later answer
        alone.q.zero_()
    assert torch.equal(d.expand(tree, torch.tensor([a]), 3).q, second.q[:1])
    kd = int(d.ids.numel())  # the whole draft vocabulary: the most the marginals answer without padding
    alone, both = d.expand(tree, torch.tensor([a]), kd), d.expand(tree, torch.tensor([a, b]), kd)
    assert torch.equal(alone.tokens, both.tokens[:1]) and torch.equal(alone.q, both.q[:1])
    d.begin_step(6)  # a new step: no marginals yet; asking for no children must not run the block
    assert d.expand(tree, torch.tensor([a]), 0).tokens.shape == (1, 0) and d.q_cal is None
    d.begin_step(5)
    node = a
    for _ in range(d.K - 1):
        node = int(
            tree.add_children(torch.tensor([node]), d.expand(tree, torch.tensor([node]), 1).tokens[0], torch.ones(1))[0]
        )
    assert int(tree.depths[node]) == d.K
    assert d.expand(tree, torch.tensor([node]), 3).q.abs().sum() == 0  # beyond the block: nothing
    mixed = d.expand(tree, torch.tensor([a, node]), 3)  # one node beyond the block: the padded path
    assert torch.equal(mixed.tokens[0], second.tokens[0]) and torch.equal(mixed.q[0], second.q[0])
    assert mixed.q[1].abs().sum() == 0
    dist = d.distribution(tree, torch.tensor([0, node]))
    assert torch.allclose(dist[0].sum(), torch.tensor(1.0, dtype=dist.dtype)) and dist[1].abs().sum() == 0
    assert (dist[0, d.ids] > 0).all()


@pytest.mark.parametrize(
    "builder, options",
    [
        ("opt-tree", {"nodes": 12}),
        ("opt-tree", {"nodes": "auto"}),
        ("chain", {"k": 4}),
        ("eagle2", {"top_k": 3, "depth": 4, "total_tokens": 10}),
        ("sequoia", {"nodes": 8, "max_depth": 4, "acceptance": [0.5, 0.3, 0.2]}),
        ("static", {"shape": "[[0],[1],[0,0],[0,1],[0,0,0],[0,0,0,0],[0,0,0,0,0]]"}),
    ],
)
def test_every_builder_is_lossless(target64, greedy_reference, builder, options):
    dec = treespec.Decoder(
        target64,
        drafter="block",
        drafter_options={"head": str(block_head_dir())},
        builder=builder,
        builder_options=options,
    )
    accepted = 0
    for prompt in tinystories_prompts(3):
        ids = dec.encode(prompt)
        out = dec.generate(ids, max_new_tokens=48)
        assert out.token_ids == greedy_reference(ids, 48), (builder, prompt)
        accepted += sum(s.accepted for s in out.stats.steps)
    assert accepted > 0


def test_a_one_token_prompt_runs_the_block_on_an_empty_context(target64, greedy_reference):
    dec = treespec.Decoder(
        target64, drafter="block", drafter_options={"head": str(block_head_dir())}, builder="opt-tree"
    )
    assert dec.generate([1], max_new_tokens=24).token_ids == greedy_reference([1], 24)


def best_first(q: torch.Tensor, n: int) -> set[tuple[int, ...]]:
    """DDTree's tree: the n most likely paths (as tuples of ranks per depth) under the product of the
    per-depth marginals ``q`` [K, W] (sorted, best first), by a best-first search."""
    logq = q.double().log()
    heap, out = [(-float(logq[0, 0]), (0,))], set()
    while heap and len(out) < n:
        cost, path = heapq.heappop(heap)
        out.add(path)
        d = len(path) - 1
        if path[-1] + 1 < q.shape[1]:  # the next sibling
            heapq.heappush(heap, (cost + float(logq[d, path[-1]] - logq[d, path[-1] + 1]), path[:-1] + (path[-1] + 1,)))
        if d + 1 < q.shape[0]:  # the best child
            heapq.heappush(heap, (cost - float(logq[d + 1, 0]), path + (0,)))
    return out


@pytest.mark.parametrize("nodes", [6, 15])
def test_opt_tree_builds_the_top_paths_under_the_product_of_marginals(target64, nodes):
    """With every depth offering the same candidates, opt-tree (threshold 0, depth up to K) keeps the
    ``nodes`` paths of highest Π q_d: DDTree's best-first tree."""
    d = BlockDrafter(BlockConfig(head=str(block_head_dir())), target64)
    dec = treespec.Decoder(target64, drafter=d, builder="chain")
    treespec.step.prefill(target64, d, dec.encode(tinystories_prompts(1)[0]))
    builder = treespec.factory.make_builder("opt-tree", {"nodes": nodes, "threshold": 0.0, "max_depth": d.K})
    builder.start(None)
    root = dec.encode(tinystories_prompts(1)[0])[-1]
    tree = builder.build(d, root, max_depth=d.K)
    # the marginals' candidates per depth, read along a chain of a fresh tree of the same step
    d.begin_step(root)
    chain, node, cands, qs = DraftTree(root), 0, [], []
    for _ in range(d.K):
        got = d.expand(chain, torch.tensor([node]), nodes)
        cands.append(got.tokens[0].tolist())
        qs.append(got.q[0])
        node = int(chain.add_children(torch.tensor([node]), got.tokens[0, :1], got.q[0, :1])[0])
    ranks: dict[int, tuple[int, ...]] = {0: ()}
    for u in range(1, len(tree)):
        parent = int(tree.parents[u])
        ranks[u] = ranks[parent] + (cands[len(ranks[parent])].index(int(tree.tokens[u])),)
    del ranks[0]
    assert set(ranks.values()) == best_first(torch.stack(qs), nodes)


def test_wrong_heads_and_settings_are_one_line(target64, tmp_path):
    with pytest.raises(ConfigError, match="has no 'block' section.*treespec train block") as err:
        BlockDrafter(BlockConfig(head=str(eagle3_head_dir())), target64)
    assert "\n" not in str(err.value)
    head = random_head(target64)
    head.spec = BlockSpec(4, (1, 2, 3), 128, 512, 512)  # written for a wider target
    head.fc = torch.nn.Linear(3 * 128, 64, bias=False)
    head.save(tmp_path / "wide")
    with pytest.raises(ConfigError, match="hidden size 128 and 512 tokens, but target .* has 64 and 512"):
        BlockDrafter(BlockConfig(head=str(tmp_path / "wide")), target64)
    with pytest.raises(TreespecError, match="block drafter") as err:
        BlockDrafter(BlockConfig(head=str(tmp_path / "missing")), target64)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="needs a block drafter trained for target"):
        treespec.Decoder(target64, drafter="block", builder="chain")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "treespec.cli.app", "train", "block", "--block-size", "0", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode != 0 and "--block-size must be ≥ 1, got 0" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "treespec.cli.app",
            "train",
            "block",
            "--feature-layers",
            "2,x",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode != 0 and "give comma-separated layer indices" in r.stderr and "Traceback" not in r.stderr


def settings(out, **overrides):
    from treespec.plugins.block_train import BlockSettings

    base = dict(target=str(STORIES260K), data="tinystories", out=str(out), offset=200, limit=120, max_new_tokens=64)
    base |= dict(epochs=2, batch_size=16, lr=1e-2, block_size=3, answers=str(eagle3_head_dir() / "data.pt"))
    return BlockSettings(**(base | overrides))


def test_an_interrupted_run_resumes_to_the_same_drafter(tmp_path):
    from treespec.plugins.block_train import train_block

    full = train_block(settings(tmp_path / "full"), log=lambda _: None)

    class Stop(Exception):
        pass

    def interrupt(task: str, done: int, total: int, info: str) -> None:
        if task.startswith("epoch 2"):
            raise Stop

    with pytest.raises(Stop):
        train_block(settings(tmp_path / "cut"), progress=interrupt, log=lambda _: None)
    logs: list[str] = []
    resumed = train_block(settings(tmp_path / "cut"), log=logs.append)
    assert any("reusing the target's generations" in m for m in logs)
    assert any("resuming" in m and "after epoch 1" in m for m in logs)
    assert resumed["held_out"] == full["held_out"]
    assert resumed["history"][-1]["held_out"]["loss"] < resumed["history"][0]["held_out"]["loss"]  # it learns
    from safetensors.torch import load_file

    a, b = (
        load_file(str(tmp_path / "full" / "model.safetensors")),
        load_file(str(tmp_path / "cut" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_fine_tunes_from_the_drafters_own_weights_and_refuses_another_shape(tmp_path):
    """``--init``: with no epochs the drafter scores on the held-out set exactly what it scored when it
    was saved (its weights, feature layers and draft vocabulary were loaded, not made anew); one epoch
    more lowers the held-out loss; a block size or layer count that differs is one line naming the flag."""
    from treespec.plugins.block_train import train_block

    base = train_block(settings(tmp_path / "base"), log=lambda _: None)
    logs: list[str] = []
    same = train_block(settings(tmp_path / "same", epochs=0, init=str(tmp_path / "base")), log=logs.append)
    assert any("starting from" in m for m in logs), logs
    assert same["held_out"] == base["held_out"] and same["draft_vocab"] == base["draft_vocab"]
    more = train_block(settings(tmp_path / "more", epochs=1, init=str(tmp_path / "base")), log=lambda _: None)
    assert more["held_out"]["loss"] < base["held_out"]["loss"]
    for wrong, flag in ((dict(block_size=4), "--block-size 3"), (dict(layers=2), "--layers 1")):
        with pytest.raises(ConfigError, match=f"--init .* pass {flag}"):
            train_block(settings(tmp_path / "wrong", init=str(tmp_path / "base"), **wrong), log=lambda _: None)


def test_cli_trains_and_decodes_losslessly(tmp_path, greedy_reference):
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    exe = [sys.executable, "-m", "treespec.cli.app"]
    out = tmp_path / "block"
    cmd = ["train", "block", "--target", str(STORIES260K), "--data", "tinystories", "--offset", "200"]
    cmd += ["--limit", "120", "--max-new-tokens", "64", "--block-size", "3", "--lr", "1e-2", "--out", str(out)]
    cmd += ["--answers", str(eagle3_head_dir() / "data.pt"), "--save-dtype", "float16", "--epochs", "2"]
    r = subprocess.run(exe + cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "reusing 120 continuations" in r.stdout + r.stderr and "use it: treespec run" in r.stdout
    summary = json.loads((out / "training.json").read_text())
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"  # loss and agreement, plotted
    assert len(summary["calibration_temperatures"]) == 3 and all(
        math.isfinite(t) for t in summary["calibration_temperatures"]
    )
    prompt = tinystories_prompts(4)[3]
    r = subprocess.run(
        exe
        + ["run", "--target", str(STORIES260K), "--dtype", "float64", "--drafter", "block", "-D", f"head={out}"]
        + ["--max-new-tokens", "48", "--prompt", prompt, "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    ids = greedy_reference.target.tokenizer(prompt).input_ids
    assert json.loads(r.stdout)["token_ids"] == greedy_reference(ids, 48)
