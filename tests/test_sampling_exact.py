"""Speculative sampling is exact: the tokens a verification emits are distributed as the target's own
sampling, for every builder, every verification rule and a range of sampling settings; and a
deliberately broken verifier is caught by the same check.

Models: random-weight float64 Llamas with a vocabulary of V = 8 (init range 0.3: distributions of
~1.6 nats at temperature 1, neither uniform nor one-hot), seeded differently for the target and the
draft so that they disagree. Drafts: the random draft model, the target itself ("identical"), and the
draft with the target's two likeliest tokens removed at every node ("zero probability on the
target's choices"). Drafters read the drafts from exact tables (``TableDrafter``), so a tree costs
no model forward; the target's side is its real tree forward.

Each check: n trials of one verification; the emitted tokens (accepted + bonus), completed to
L = depth + 1 tokens by exact sampling from the target where a trial emitted fewer, must fit the
target's exact distribution over the first L tokens, enumerated over all V^L sequences
(``sampling_stats``: Pearson's chi-square, α = 1e-6, fixed seeds). Trees with fixed (ranked)
children are verified n times with ``verify_batch``; trees with sampled children are drawn afresh
for every trial (batched through the same draw helpers the builders use), and the real builders'
sampled trees also go through the real ``build`` and the full Decoder (``test_decoder_*``).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from sampling_stats import ALPHA, Tables, assert_exact, complete, emitted, fit
from transformers import LlamaConfig, LlamaForCausalLM

from treespec import DraftTree, TargetModel
from treespec.factory import make_builder
from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals
from treespec.sampling import DraftSampling, SamplingParams, draw_children, make_generator, with_temperature
from treespec.verify import sampling_verify, verify_batch

V = 8
PROMPT = [1, 5, 3]
N_TRIALS = 40_000


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------- models
@functools.cache
def tiny(seed: int, noise: float = 0.0) -> LlamaForCausalLM:
    """The tiny model of ``seed``; with ``noise``, its weights plus seeded Gaussian noise (a draft that
    mostly, but far from always, agrees with it)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    model.generation_config.eos_token_id = None  # no token ends a run
    if noise:
        gen = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for w in model.parameters():
                w.add_(noise * torch.randn(w.shape, generator=gen, dtype=w.dtype))
    return model


TARGET_SEED, DRAFT_NOISE = 0, 0.3


@functools.cache
def target_tables(params: SamplingParams | None, levels: int) -> Tables:
    return Tables.build(tiny(TARGET_SEED), PROMPT, levels, params.probs if params else _softmax)


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.to(torch.float64), dim=-1)


def draft_tables(kind: str, params: SamplingParams, levels: int) -> Tables:
    """The draft's temperature-1 distributions: 'model' (the random draft), 'identical' (the target's
    processed distribution itself: use draft_temperature = 1), 'zero' (the draft with the target's
    two likeliest tokens at each context removed)."""
    if kind == "identical":
        return target_tables(params, levels)
    draft = Tables.build(tiny(TARGET_SEED, DRAFT_NOISE), PROMPT, levels, _softmax)
    if kind == "model":
        return draft
    assert kind == "zero"
    rows = []
    for q, p in zip(draft.rows, target_tables(params, levels).rows):
        top = p.topk(2, dim=-1).indices
        q = q.scatter(-1, top, 0.0)
        rows.append(q / q.sum(-1, keepdim=True))
    return Tables(rows, V)


class TableDrafter(Drafter):
    """A drafter that reads the draft's distribution after PROMPT + path from exact tables."""

    def __init__(self, tables: Tables):
        self.tables = tables
        self.config = None
        self.target = None

    def prefill(self, context: PrefillContext) -> None:
        pass

    def _dist(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.tables.at(torch.tensor(tree.path_tokens(int(n))[1:])) for n in nodes]).float()

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        q, tokens = self._dist(tree, nodes).topk(min(k, V), dim=-1)
        return Proposals(tokens=tokens, q=q)

    def distribution(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        return self._dist(tree, nodes)

    def commit(self, commit: Commit) -> None:
        pass


def target_logits(tree: DraftTree) -> tuple[object, torch.Tensor]:
    """The real tree forward of the target after PROMPT: (tree tensors, logits [N, V])."""
    target = TargetModel(tiny(TARGET_SEED))
    target.prefill(torch.tensor(PROMPT[:-1]))
    tt = tree.tensors(target.past_len, dtype=torch.float64)
    logits, _ = target.forward_tree(tt)
    return tt, logits


def target_probs(tree: DraftTree, params: SamplingParams) -> tuple[object, torch.Tensor]:
    """(tree tensors, the target's processed distributions [N, V]) from its real tree forward."""
    tt, logits = target_logits(tree)
    return tt, params.probs(logits)


# ----------------------------------------------------------------------------------------- ranked trees
T07 = SamplingParams(temperature=0.7)
SETTINGS = {
    "t0.3": SamplingParams(temperature=0.3),
    "t0.7": T07,
    "t1.0": SamplingParams(temperature=1.0),
    "t1.5": SamplingParams(temperature=1.5),
    "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t1.0-top_k5": SamplingParams(temperature=1.0, top_k=5),
    "t1.5-top_k5-top_p0.9": SamplingParams(temperature=1.5, top_k=5, top_p=0.9),
}
BUILDERS = {  # ranked (top-k) children, depth ≤ 3, several branchings
    "opt-tree": ("opt-tree", {"nodes": 6, "threshold": 0.0, "max_depth": 2}),
    "chain": ("chain", {"k": 3}),
    "static": ("static", {"shape": "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]"}),
    "sequoia": ("sequoia", {"nodes": 6, "max_depth": 2, "acceptance": [0.5, 0.25, 0.1]}),
    "eagle2": ("eagle2", {"top_k": 2, "depth": 2, "total_tokens": 5}),
}
RANKED_CASES = [  # (builder, draft, setting, rule)
    ("opt-tree", "model", "t0.7", "auto"),
    ("opt-tree", "zero", "t1.0", "deterministic"),
    ("opt-tree", "identical", "t0.7-top_p0.9", "target-only"),
    ("chain", "model", "t1.5", "deterministic"),
    ("chain", "zero", "t0.3", "target-only"),
    ("static", "model", "t1.0-top_k5", "auto"),
    ("static", "zero", "t0.7", "target-only"),
    ("static", "model", "t0.3", "deterministic"),
    ("sequoia", "model", "t0.7-top_p0.9", "deterministic"),
    ("sequoia", "identical", "t1.5-top_k5-top_p0.9", "auto"),
    ("eagle2", "model", "t0.7", "target-only"),
    ("eagle2", "zero", "t1.5", "auto"),
]


def ranked_trials(builder_key: str, draft: str, setting: str, rule: str, seed: int = 0, source: Drafter | None = None):
    """n verifications of one ranked tree built from the ``draft`` tables (or from ``source``, a drafter
    prefilled with PROMPT)."""
    params = SETTINGS[setting]
    name, opts = BUILDERS[builder_key]
    builder = make_builder(name, opts)
    builder.start(None)  # ranked children
    source = source or TableDrafter(draft_tables(draft, params, 4))
    tree = builder.build(source, PROMPT[-1], max_depth=3)
    tt, probs = target_probs(tree, params)
    length = tree.depth + 1
    tables = target_tables(params, length)
    gen = make_generator(seed, "cpu")
    tokens = tt.input_ids[None].expand(N_TRIALS, -1)
    best, bonus = verify_batch(tt, tokens, probs[None].expand(N_TRIALS, -1, -1), gen, rule)
    seqs = complete(emitted(tt, tokens, best, bonus, length), tables, gen)
    return tree, seqs, tables, best


@pytest.mark.parametrize("builder_key,draft,setting,rule", RANKED_CASES)
def test_ranked_tree_is_exact(builder_key, draft, setting, rule):
    tree, seqs, tables, best = ranked_trials(builder_key, draft, setting, rule)
    assert tree.size >= 3 and (tree.depth >= 2 or builder_key == "chain")
    assert_exact(seqs, tables, f"{builder_key}/{draft}/{setting}/{rule}")
    accepted = tree.depths[best].float().mean()
    if draft == "identical" and rule != "target-only":
        assert accepted > 0.5  # the target agrees with itself: drafts are accepted


@pytest.mark.parametrize("rule", ["deterministic", "target-only", "traversal"])
def test_sampling_verify_one_call_at_a_time(rule):
    """The Decoder's entry point (B = 1, the processors run lazily on the rows the walk reads; for
    traversal, a leaf's row exists only after ``fill`` asks for it)."""
    params = SETTINGS["t1.0-top_k5"]
    builder = make_builder(*BUILDERS["opt-tree"])
    tree = builder.build(TableDrafter(draft_tables("model", params, 3)), PROMPT[-1], max_depth=3)
    tt, logits = target_logits(tree)
    length = tree.depth + 1
    gen = make_generator(0, "cpu")
    seqs = torch.full((6000, length), -1, dtype=torch.long)
    for i in range(seqs.shape[0]):
        acc = sampling_verify(tt, logits, params, gen, rule)
        out = (acc.tokens + [acc.bonus])[:length]
        seqs[i, : len(out)] = torch.tensor(out)
    assert_exact(
        complete(seqs, target_tables(params, length), gen), target_tables(params, length), f"sampling_verify {rule}"
    )


# ----------------------------------------------------------------------------------------- sampled trees
SHAPES = {  # rank paths as the static builder reads them; with sampling, rank = draw order
    "chain-2": [[0], [0, 0]],
    "branchy": [[0], [1], [2], [0, 0], [0, 1], [1, 0]],
    "deep": [[0], [1], [0, 0], [0, 1], [0, 0, 0]],
}
SAMPLED_CASES = [  # (shape, draft, setting, rule, draft temperature: None = the target's)
    ("chain-2", "model", "t0.7", "specinfer", None),
    ("chain-2", "zero", "t1.0", "target-only", None),
    ("branchy", "model", "t0.7-top_p0.9", "auto", None),
    ("branchy", "zero", "t1.0", "specinfer", None),
    ("branchy", "identical", "t0.7", "specinfer", 1.0),
    ("branchy", "model", "t1.5", "deterministic", None),
    ("branchy", "zero", "t1.5-top_k5-top_p0.9", "target-only", None),
    ("deep", "model", "t0.3", "specinfer", None),
    ("deep", "model", "t1.0-top_k5", "specinfer", 0.5),
    ("deep", "identical", "t1.5", "deterministic", 1.0),
]


def skeleton(paths: list[list[int]]) -> tuple[DraftTree, list[list[int]]]:
    """A tree of the shape (dummy tokens; node ids in shape order) whose internal nodes are marked as
    sampled, and the children of every node in draw order."""
    paths = sorted(paths, key=lambda p: (len(p), p))
    node = {(): 0}
    tree = DraftTree(PROMPT[-1])
    for p in paths:
        node[tuple(p)] = int(
            tree.add_children(torch.tensor([node[tuple(p[:-1])]]), torch.tensor([0]), torch.ones(1))[0]
        )
    kids = [[] for _ in range(len(tree))]
    for p in paths:
        kids[node[tuple(p[:-1])]].append(node[tuple(p)])
    inner = torch.tensor([u for u in range(len(tree)) if kids[u]])
    tree.record_draws(inner, torch.zeros(inner.numel(), V))
    return tree, kids


def draw_trials(
    shape: list[list[int]],
    draft: str,
    setting: str,
    draft_t: float | None,
    seed: int = 0,
    n: int = N_TRIALS,
    ranked: frozenset[int] = frozenset(),
):
    """n trees of ``shape`` (its paths) with children drawn afresh (Gumbel-top-k from the draft at the
    draft temperature, as ``sampled_expand`` draws them); the nodes in ``ranked`` get the draft's top-k
    instead (point masses: no recorded draw). Returns (tree, tt, tokens [n, N], target probs [n, N, V],
    recorded draws [n, R, V], tables, the generator after the draws)."""
    params = SETTINGS[setting]
    tree, kids = skeleton(shape)
    tt = tree.tensors(0)
    if ranked:
        is_ranked = torch.isin(torch.arange(len(tree)), torch.tensor(sorted(ranked)))  # [N]
        tt = dataclasses.replace(tt, draw_row=torch.where(is_ranked, -1, tt.draw_row))
    length = tree.depth + 1
    tables = target_tables(params, length)
    drafts = draft_tables(draft, params, length)
    dt = params.temperature if draft_t is None else draft_t
    gen = make_generator(seed, "cpu")
    paths = [tree.path(u) for u in range(len(tree))]
    tokens = torch.full((n, len(tree)), PROMPT[-1], dtype=torch.long)
    dists = torch.zeros(n, int(tt.draw_dist.shape[0]), V)
    for u in range(len(tree)):  # parents before children
        if kids[u]:
            q = with_temperature(drafts.at(tokens[:, paths[u][1:]]).float(), dt)  # [n, V]
            if u in ranked:
                tokens[:, kids[u]] = q.topk(len(kids[u]), dim=-1).indices
                continue
            drawn, qx = draw_children(q, len(kids[u]), gen)
            assert bool((qx > 0).all()), "the draft's support must hold every child"
            tokens[:, kids[u]] = drawn
            dists[:, int(tt.draw_row[u])] = q
    probs = torch.stack([tables.at(tokens[:, paths[u][1:]]) for u in range(len(tree))], dim=1)  # [n, N, V]
    return tree, tt, tokens, probs, dists, tables, gen


def sampled_trials(
    shape: str, draft: str, setting: str, rule: str, draft_t: float | None, seed: int = 0, n: int = N_TRIALS
):
    """n trees of ``shape`` with children drawn afresh (``draw_trials``), each verified once."""
    tree, tt, tokens, probs, dists, tables, gen = draw_trials(SHAPES[shape], draft, setting, draft_t, seed, n)
    best, bonus = verify_batch(tt, tokens, probs.float(), gen, rule, dists)
    seqs = complete(emitted(tt, tokens, best, bonus, tree.depth + 1), tables, gen)
    return tree, seqs, tables, best


@pytest.mark.parametrize("shape,draft,setting,rule,draft_t", SAMPLED_CASES)
def test_sampled_tree_is_exact(shape, draft, setting, rule, draft_t):
    tree, seqs, tables, best = sampled_trials(shape, draft, setting, rule, draft_t)
    assert_exact(seqs, tables, f"{shape}/{draft}/{setting}/{rule}/draft_t={draft_t}")
    if draft == "identical" and rule in ("specinfer", "auto"):
        assert (
            bool((best.ne(0)).all()) and float(tree.depths[best].float().mean()) == tree.depth
        )  # q = p: always accepted


# ----------------------------------------------------------------------------------------- broken verifiers
def _bonus_without_residual(parents, tokens, probs, best):
    """BROKEN: the bonus token drawn from p itself, not from p with the rejected children removed."""
    return probs[torch.arange(probs.shape[0]), best].to(torch.float64)


def test_broken_verifiers_fail_the_same_checks(monkeypatch):
    """Each broken rule fails the check its correct version passes, with the same trials and seeds."""
    import treespec.verify as verify

    ok = sampled_trials("branchy", "model", "t0.7-top_p0.9", "specinfer", None)
    ok_ranked = ranked_trials("opt-tree", "model", "t0.7", "deterministic")
    with monkeypatch.context() as m:  # SpecInfer without the residual: after a rejection keep p
        m.setattr(verify, "_residual", lambda r, q: r)
        bad = sampled_trials("branchy", "model", "t0.7-top_p0.9", "specinfer", None)
    with monkeypatch.context() as m:  # the deterministic rule with the bonus drawn from p
        m.setattr(verify, "_bonus_rows", _bonus_without_residual)
        bad_ranked = ranked_trials("opt-tree", "model", "t0.7", "deterministic")
    # ranked (top-k) children verified as if they had been sampled: min(1, p/q) with the draft's q
    params = SETTINGS["t0.7"]
    drafter = TableDrafter(draft_tables("model", params, 3))
    builder = make_builder(*BUILDERS["opt-tree"])
    tree = builder.build(drafter, PROMPT[-1], max_depth=3)
    inner = torch.tensor(sorted(set(tree.parents[1:].tolist())))
    tree.record_draws(inner, with_temperature(drafter.distribution(tree, inner), params.temperature))
    tt, probs = target_probs(tree, params)
    gen = make_generator(0, "cpu")
    tokens = tt.input_ids[None].expand(N_TRIALS, -1)
    best, bonus = verify_batch(
        tt, tokens, probs[None].expand(N_TRIALS, -1, -1), gen, "specinfer", tt.draw_dist[None].expand(N_TRIALS, -1, -1)
    )
    tables = target_tables(params, tree.depth + 1)
    bad_q = complete(emitted(tt, tokens, best, bonus, tree.depth + 1), tables, gen)

    for name, good, broken in [
        ("specinfer without residual", ok, bad),
        ("bonus from p", ok_ranked, bad_ranked),
        ("ranked children as sampled", ok_ranked, (None, bad_q, tables, None)),
    ]:
        assert fit(good[1], good[2])[2] >= ALPHA, name
        stat, df, pvalue, _ = fit(broken[1], broken[2])
        assert pvalue < ALPHA, f"{name}: the broken verifier passed (X² = {stat:.1f} on {df} df, p = {pvalue:.3g})"


# ----------------------------------------------------------------------------------------- the real builders
def real_builder_trials(name: str, opts: dict, draft: str, setting: str, n: int, seed: int = 0):
    """n trees from the real ``build`` with sample=true (the table drafter, the Decoder's draft
    settings), verified in one batch (every tree has the shape: the draft's support holds every child)."""
    params = SETTINGS[setting]
    builder = make_builder(name, {**opts, "sample": True})
    gen = make_generator(seed, "cpu")
    builder.start(DraftSampling(temperature=params.temperature, generator=gen))
    drafter = TableDrafter(draft_tables(draft, params, 4))
    trees = [builder.build(drafter, PROMPT[-1], max_depth=3) for _ in range(n)]
    tree = trees[0]
    assert all(len(t) == len(tree) for t in trees) and tree.draw_row is not None
    tt = tree.tensors(0)
    tokens = torch.stack([t.tokens for t in trees])  # [n, N]
    dists = torch.stack([t.draw_dist for t in trees])  # [n, R, V]
    length = tree.depth + 1
    tables = target_tables(params, length)
    paths = [tree.path(u) for u in range(len(tree))]
    probs = torch.stack([tables.at(tokens[:, paths[u][1:]]) for u in range(len(tree))], dim=1)
    best, bonus = verify_batch(tt, tokens, probs.float(), gen, "auto", dists)
    return tree, complete(emitted(tt, tokens, best, bonus, length), tables, gen), tables, best


@pytest.mark.parametrize(
    "name,opts,draft,setting,n",
    [
        ("static", {"shape": "[[0],[1],[2],[0,0],[0,1],[1,0]]"}, "model", "t1.0", 4000),
        ("chain", {"k": 3}, "zero", "t0.7-top_p0.9", 3000),
        ("sequoia", {"nodes": 4, "max_depth": 2, "acceptance": [0.5, 0.25]}, "model", "t1.5-top_k5-top_p0.9", 2000),
    ],
)
def test_real_sampling_builders_are_exact(name, opts, draft, setting, n):
    tree, seqs, tables, best = real_builder_trials(name, opts, draft, setting, n)
    assert_exact(seqs, tables, f"{name} sample=true/{draft}/{setting}")
    assert float(tree.depths[best].float().mean()) > 0.2  # drafts do get accepted


# ----------------------------------------------------------------------------------------- the Decoder
@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The noisy draft model on disk, for the real ``model`` drafter."""
    path = tmp_path_factory.mktemp("tiny-draft")
    tiny(TARGET_SEED, DRAFT_NOISE).save_pretrained(path)
    return str(path)


DECODER_CASES = [  # (builder, options, setting, rule, runs)
    ("static", {"shape": "[[0],[1],[2],[0,0],[0,1],[1,0]]", "sample": True}, "t0.7-top_p0.9", "auto", 1500),
    ("opt-tree", {"nodes": 6, "max_depth": 2}, "t1.5-top_k5-top_p0.9", "target-only", 1200),
]


@pytest.mark.parametrize("builder,opts,setting,rule,runs", DECODER_CASES)
def test_decoder_first_tokens_are_exact(builder, opts, setting, rule, runs, draft_dir):
    """Whole seeded ``generate`` calls with the real model drafter: the first two tokens fit."""
    from treespec import Decoder

    params = SETTINGS[setting]
    dec = Decoder(TargetModel(tiny(TARGET_SEED)), drafter=draft_dir, builder=builder, builder_options=opts)
    kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, rule=rule)
    seqs, accepted = [], 0
    for seed in range(runs):
        out = dec.generate(PROMPT, max_new_tokens=2, seed=seed, **kw)
        seqs.append(out.token_ids)
        accepted += out.stats.steps[0].accepted
    assert_exact(torch.tensor(seqs), target_tables(params, 2), f"Decoder {builder}/{setting}/{rule}")
    assert accepted > runs * 0.3


def test_seeds_reproduce_and_greedy_is_unchanged(draft_dir):
    from treespec import Decoder

    dec = Decoder(TargetModel(tiny(TARGET_SEED)), drafter=draft_dir, builder="chain", builder_options={"sample": True})
    runs = [dec.generate(PROMPT, max_new_tokens=24, temperature=1.0, seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    torch.manual_seed(5)
    a = dec.generate(PROMPT, max_new_tokens=24, temperature=1.0).token_ids
    torch.manual_seed(5)
    assert dec.generate(PROMPT, max_new_tokens=24, temperature=1.0).token_ids == a  # no seed: torch's RNG
    greedy = dec.generate(PROMPT, max_new_tokens=24).token_ids
    assert dec.generate(PROMPT, max_new_tokens=24, temperature=0, seed=3, top_k=2).token_ids == greedy
    with torch.inference_mode():
        ref = tiny(TARGET_SEED).generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=24)[0, len(PROMPT) :]
    assert greedy == ref.tolist()


def test_bad_settings_are_one_line_errors(draft_dir):
    from treespec import Decoder
    from treespec.errors import ConfigError

    dec = Decoder(TargetModel(tiny(TARGET_SEED)), drafter="ngram", builder="chain", builder_options={"sample": True})
    with pytest.raises(ConfigError, match="full distribution"):
        dec.generate(PROMPT, max_new_tokens=4, temperature=0.7)
    dec.generate(PROMPT, max_new_tokens=4)  # greedy needs no distribution
    ranked = Decoder(TargetModel(tiny(TARGET_SEED)), drafter="ngram", builder="chain")
    assert len(ranked.generate(PROMPT, max_new_tokens=4, temperature=0.7, seed=1).token_ids) == 4
    with pytest.raises(ConfigError, match="full distribution"):
        ranked.generate(PROMPT, max_new_tokens=4, temperature=0.7, rule="specinfer")
    for bad, match in [
        ({"temperature": -1}, "temperature"),
        ({"temperature": 1, "top_p": 1.5}, "top_p"),
        ({"temperature": 1, "top_k": -2}, "top_k"),
        ({"temperature": 1, "rule": "nope"}, "rule"),
        ({"temperature": 1, "draft_temperature": 0}, "draft_temperature"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ranked.generate(PROMPT, max_new_tokens=4, **bad)
