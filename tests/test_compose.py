"""Drafter `compose` (`--drafter model+ngram`, `treespec.compose`): merging by token with the max and
mix rules on scripted parts, option routing and its errors, parts expanding nodes they never
proposed, and lossless decoding of model+ngram and self+ngram on the real target."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec.cli.app import app
from treespec.errors import ConfigError
from treespec.factory import make_drafter, resolve_drafter_name
from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals
from treespec.options import parse_pairs
from treespec.plugins.compose import ComposedDrafter, compose
from treespec.plugins.configs import ComposeConfig
from treespec.plugins.ngram import NgramDrafter
from treespec.tree import DraftTree

MAX_NEW = 128
N_PROMPTS = 8


class Scripted(Drafter):
    """Proposes fixed (token, q) lists keyed by the node's token; records prefill and commit."""

    def __init__(
        self, table: dict[int, list[tuple[int, float]]], hidden: bool = False, probs: bool = True, target=None
    ):
        super().__init__(treespec.PluginConfig(), target)
        self.table, self.calls = table, []
        self.needs_target_hidden, self.provides_probabilities = hidden, probs  # type: ignore[misc]

    def prefill(self, context: PrefillContext) -> None:
        self.calls.append(("prefill", context))

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        tokens, q = torch.zeros(len(nodes), k, dtype=torch.long), torch.zeros(len(nodes), k)  # [M, k]
        for i, tok in enumerate(tree.tokens[nodes].tolist()):
            for j, (t, p) in enumerate(self.table.get(tok, [])[:k]):
                tokens[i, j], q[i, j] = t, p
        return Proposals(tokens, q)

    def commit(self, commit: Commit) -> None:
        self.calls.append(("commit", commit))


def raw(*parts: Drafter) -> ComposedDrafter:
    """A composition that merges the parts' own q (these tests are about merging, not calibration)."""
    return ComposedDrafter(list(parts), ComposeConfig(calibrate=False))


def children(d: Drafter, tree: DraftTree, nodes: list[int], k: int) -> list[list[tuple[int, float]]]:
    p = d.expand(tree, torch.tensor(nodes), k)
    assert p.tokens.shape == p.q.shape == (len(nodes), k) and p.tokens.dtype == torch.long
    return [[(int(t), round(float(q), 6)) for t, q in zip(tr, qr) if q > 0] for tr, qr in zip(p.tokens, p.q)]


# root token 1: A and B share token 7; token 2 (a child of the root): only A proposes anything
A = {1: [(5, 0.5), (7, 0.3), (9, 0.1)], 2: [(4, 0.6), (6, 0.2)]}
B = {1: [(7, 0.9), (8, 0.05)]}


def two_level_tree() -> DraftTree:
    tree = DraftTree(1)
    tree.add_children(torch.tensor([0]), torch.tensor([2]), torch.tensor([0.5]))  # node 1, token 2
    return tree


# ---------------------------------------------------------------------- merging
def test_max_merges_by_token_and_keeps_the_most_confident_q():
    d = raw(Scripted(A), Scripted(B))
    # 7 from both parts is one child with max(0.3, 0.9); then 5 (0.5), 9 (0.1), 8 (0.05)
    assert children(d, DraftTree(1), [0], 4) == [[(7, 0.9), (5, 0.5), (9, 0.1), (8, 0.05)]]
    assert children(d, DraftTree(1), [0], 2) == [[(7, 0.9), (5, 0.5)]]  # the k best only
    assert children(d, DraftTree(1), [0], 6) == [[(7, 0.9), (5, 0.5), (9, 0.1), (8, 0.05)]]  # then padding
    # several nodes at once, each merged on its own; node 1 (token 2) has A's children only
    assert children(d, two_level_tree(), [0, 1], 3) == [[(7, 0.9), (5, 0.5), (9, 0.1)], [(4, 0.6), (6, 0.2)]]
    assert d.expand(DraftTree(1), torch.zeros(0, dtype=torch.long), 3).tokens.shape == (0, 3)


def test_mix_weights_and_renormalisation_over_the_parts_that_proposed():
    equal = ComposedDrafter([Scripted(A), Scripted(B)], ComposeConfig(merge="mix"))
    # ŵ = (1/2, 1/2): 7 → 0.5·0.3 + 0.5·0.9 = 0.6, 5 → 0.25, 9 → 0.05, 8 → 0.025
    assert children(equal, DraftTree(1), [0], 4) == [[(7, 0.6), (5, 0.25), (9, 0.05), (8, 0.025)]]
    weighted = ComposedDrafter([Scripted(A), Scripted(B)], ComposeConfig(merge="mix", weights=[3, 1]))
    # ŵ = (3/4, 1/4): 7 → 0.225 + 0.225 = 0.45, 5 → 0.375, 9 → 0.075, 8 → 0.0125
    assert children(weighted, DraftTree(1), [0], 4) == [[(7, 0.45), (5, 0.375), (9, 0.075), (8, 0.0125)]]
    # at node 1 only A proposes: ŵ_A = 3/3 = 1, A's q unchanged (B's silence does not deflate it)
    assert children(weighted, two_level_tree(), [1], 4) == [[(4, 0.6), (6, 0.2)]]
    # nobody proposes: padding only
    assert children(weighted, DraftTree(3), [0], 2) == [[]]


def test_ties_go_to_the_earliest_proposal_in_part_order_then_rank():
    a, b = Scripted({1: [(30, 0.4), (20, 0.4)]}), Scripted({1: [(10, 0.4), (20, 0.1)]})
    assert children(raw(a, b), DraftTree(1), [0], 3) == [[(30, 0.4), (20, 0.4), (10, 0.4)]]
    # 20 was also proposed by b (with a lower q): b is listed first now, so 20 comes before 30
    assert children(raw(b, a), DraftTree(1), [0], 3) == [[(10, 0.4), (20, 0.4), (30, 0.4)]]


def test_parts_narrower_than_k_and_three_parts():
    class Narrow(Scripted):  # returns [M, 1] whatever k is (as the model drafter does when k > vocab)
        def expand(self, tree, nodes, k):
            p = super().expand(tree, nodes, k)
            return Proposals(p.tokens[:, :1], p.q[:, :1])

    d = raw(Narrow(A), Scripted(B), Scripted({1: [(11, 0.7)]}))
    assert children(d, DraftTree(1), [0], 4) == [[(7, 0.9), (11, 0.7), (5, 0.5), (8, 0.05)]]


def test_lifecycle_fans_out_and_flags_are_per_instance():
    a, b = Scripted(A, hidden=True), Scripted(B, probs=False)
    d = ComposedDrafter([a, b])
    ctx, commit = PrefillContext(input_ids=torch.tensor([3, 1])), Commit(tokens=[7, 2])
    d.prefill(ctx)
    d.commit(commit)
    assert a.calls == b.calls == [("prefill", ctx), ("commit", commit)]
    assert d.needs_target_hidden and not d.provides_probabilities  # any / all
    assert not ComposedDrafter.needs_target_hidden  # the class default is untouched
    assert ComposedDrafter([Scripted(A), Scripted(B)], ComposeConfig(merge="mix")).provides_probabilities
    assert not ComposedDrafter([Scripted(A), Scripted(B)]).provides_probabilities  # a max is no distribution
    assert not ComposedDrafter([Scripted(A), Scripted(B)]).needs_target_hidden


def test_decoder_reads_the_instance_flag(target64):
    a = Scripted({}, hidden=True)
    dec = treespec.Decoder(target64, drafter=ComposedDrafter([a, Scripted({})]), builder="chain")
    dec.generate("Once upon a time", max_new_tokens=4)
    prefill, commit = a.calls[0][1], a.calls[1][1]
    assert prefill.hidden is not None and commit.hidden is not None  # asked for because a part needs them
    assert commit.hidden.shape[0] == len(commit.tokens)


# ---------------------------------------------------------------------- names, options, errors
def test_plus_names_route_options_to_parts():
    assert resolve_drafter_name("model+ngram", {"merge": "mix"}) == (
        "compose",
        {"merge": "mix", "parts": ["model", "ngram"]},
    )
    assert parse_pairs(["ngram.max_ngram=2,1.min_ngram=2,weights=0.7,0.3"], "drafter") == {
        "ngram.max_ngram": "2",
        "1.min_ngram": "2",
        "weights": "0.7,0.3",
    }
    d = make_drafter(
        "ngram+ngram", {"1.max_ngram": "2", "2.max_ngram": "4", "merge": "mix", "weights": "0.7,0.3"}, None
    )
    assert isinstance(d, ComposedDrafter) and all(isinstance(p, NgramDrafter) for p in d.parts)
    assert [p.config.max_ngram for p in d.parts] == [2, 4] and d.config.weights == [0.7, 0.3]
    nested = make_drafter("compose", {"parts": "ngram,ngram", "2": {"max_matches": 3}}, None)  # Python: a dict per part
    assert [p.config.max_matches for p in nested.parts] == [8, 3] and nested.config.merge == "max"


@pytest.mark.parametrize(
    "name,options,needle",
    [
        ("ngram+ngrm", {}, "unknown drafter 'ngrm'; did you mean 'ngram'"),
        ("ngram+ngram", {"merge": "mix", "weights": "1,2,3"}, "3 weights for 2 parts"),
        ("ngram+ngram", {"weights": "1,2"}, "weights apply to merge=mix only"),
        ("ngram+ngram", {"merge": "mix", "calibrate": "true"}, "calibrate applies to merge=max only"),
        (
            "ngram+ngram",
            {"ngram.max_ngram": 2},
            "2 parts are named 'ngram'; address them by position (1=ngram, 2=ngram)",
        ),
        ("ngram+ngram", {"2.foo": 1}, "drafter 'ngram' (part 2 of 'ngram+ngram'): unknown option 'foo'"),
        ("ngram+ngram", {"max_ngram": 2}, "'max_ngram' is not an option of the composition"),
        ("ngram+ngram", {"ngrm.max_ngram": 2}, "option prefix 'ngrm' names no part"),
        ("ngram+ngram", {"3.max_ngram": 2}, "option prefix '3' names no part"),
        ("ngram+ngram", {"merge": "avg"}, "option 'merge'"),
        ("model+ngram", {}, "part 1 'model' needs a draft model"),
        ("compose", {"parts": "ngram"}, "needs two or more parts"),
        ("compose+ngram", {}, "a part cannot be 'compose'"),
    ],
)
def test_errors_are_one_line(name, options, needle):
    with pytest.raises(ConfigError) as err:
        make_drafter(name, options, None)
    msg = str(err.value)
    assert "\n" not in msg and needle in msg, msg


def test_python_api_compose_takes_instances_and_names(target64):
    a = Scripted(A, target=target64)
    d = treespec.compose(a, "ngram", merge="mix", weights=[2, 1])  # the target comes from the instance
    assert treespec.compose is compose and isinstance(d.parts[1], NgramDrafter) and d.target is target64
    assert d.config.merge == "mix" and d.config.weights == [2.0, 1.0]
    with pytest.raises(ConfigError, match="needs the target"):
        compose("ngram", "ngram")
    with pytest.raises(ConfigError, match="option 'merge'"):
        compose(a, Scripted(B), merge="avg")
    with pytest.raises(ConfigError, match="two or more"):
        ComposedDrafter([a])
    reg = treespec.load_plugins()
    assert reg.drafters["compose"].spec.resolve() is ComposedDrafter


def test_model_and_self_parts_are_built_by_name(target64):
    d = make_drafter(f"{STORIES260K}+ngram", {"model.layers": 3, "ngram.max_ngram": 2}, target64)
    assert d.parts[0].config.model == str(STORIES260K) and d.parts[0].config.layers == 3
    assert d.parts[1].config.max_ngram == 2
    s = make_drafter("self+ngram", {"self": {"layers": 3}}, target64)
    assert type(s.parts[0]).__name__ == "SelfDrafter" and s.parts[0].config.layers == 3


# ---------------------------------------------------------------------- parts see nodes of other parts
@pytest.mark.parametrize("name,options", [(str(STORIES260K), {"layers": 3}), ("self", {"layers": 3})])
def test_model_drafters_expand_nodes_they_never_proposed(target64, name, options):
    """Nodes made of tokens the draft would never rank high, expanded without expanding their
    parents first, give the draft's exact distribution after that path; so does the next step after
    committing such a path."""
    d = make_drafter(name, options, target64)
    prompt = target64.tokenizer("Once upon a time, there was a little dog").input_ids

    def reference(ids: list[int], k: int) -> tuple[list[int], torch.Tensor]:
        with torch.inference_mode():
            probs = torch.softmax(d.model(torch.tensor([ids])).logits[0, -1, : d.vocab].float(), dim=-1)  # [V]
        q, t = probs.topk(k)
        return t.tolist(), q

    d.prefill(PrefillContext(input_ids=torch.tensor(prompt)))
    tree = DraftTree(prompt[-1])
    first = tree.add_children(torch.tensor([0, 0]), torch.tensor([300, 400]), torch.tensor([0.5, 0.5]))  # [2]
    deep = tree.add_children(first[:1], torch.tensor([500]), torch.tensor([0.5]))  # [1] below 300
    for nodes in ([int(deep[0]), int(first[1])], [0]):  # the deep node and a sibling first, the root last
        p = d.expand(tree, torch.tensor(nodes), 5)  # [2, 5]
        for i, node in enumerate(nodes):
            want_t, want_q = reference(prompt + tree.path_tokens(node)[1:], 5)
            assert p.tokens[i].tolist() == want_t
            torch.testing.assert_close(p.q[i], want_q, rtol=0, atol=1e-9)
    d.commit(Commit(tokens=[300, 500, 42]))  # accepted 300, 500; bonus 42 (not drafted)
    p = d.expand(DraftTree(42), torch.tensor([0]), 5)
    want_t, want_q = reference(prompt + [300, 500, 42], 5)
    assert p.tokens[0].tolist() == want_t
    torch.testing.assert_close(p.q[0], want_q, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------- the drafter conformance suite
@pytest.mark.parametrize(
    "name,options",
    [
        ("model+ngram", {"model.model": str(STORIES260K), "model.layers": 3, "calibrate": "false"}),
        ("model+ngram", {"model.model": str(STORIES260K), "model.layers": 3}),
        ("self+ngram", {"self.layers": 3, "merge": "mix", "weights": "3,1"}),
    ],
)
def test_conformance(target64, name, options):
    from treespec.testing import check_drafter

    # mix sums each part's q over the candidates of its k best only, so its q may depend on k (a token
    # outside a part's k best gets nothing from that part): the budget check holds for max only
    skip = ["budget"] if options.get("merge") == "mix" else []
    if options.get("merge", "max") == "max" and options.get("calibrate") != "false":
        # per-part calibration learns across steps and sequences by design, so its q differ from a
        # fresh drafter's (the parts' sequence state is checked by the uncalibrated row above), and
        # it scales a node's k children to sum to at most 1, so its q depend on k as mix's do
        skip += ["prefill_starts_over", "commit_consistency", "budget"]
    check_drafter(
        lambda t: make_drafter(name, options, t),
        target64,
        tinystories_prompts(3),
        skip=skip,
        path_exact=True,
        expect_acceptance=True,
        max_new_tokens=24,
    )


# ---------------------------------------------------------------------- lossless on the real target
class Spy(Drafter):
    """Passes everything to ``inner``; logs its proposals by (step, path) and the accepted tokens."""

    def __init__(self, inner: Drafter):
        super().__init__(inner.config, inner.target)
        self.inner, self.step, self.root = inner, 0, -1
        self.proposed: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
        self.accepted: list[tuple[int, int, list[int]]] = []  # (step, root, accepted tokens)

    def q(self, step: int, path: tuple[int, ...], token: int) -> float:
        """The q this part gave ``token`` below ``path`` in ``step`` (0: not proposed)."""
        tokens, q = self.proposed.get((step, path), (torch.zeros(0, dtype=torch.long), torch.zeros(0)))
        hit = (tokens == token) & (q > 0)
        return float(q[hit][0]) if bool(hit.any()) else 0.0

    def prefill(self, context: PrefillContext) -> None:
        self.root = int(context.input_ids[-1])
        self.inner.prefill(context)

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        p = self.inner.expand(tree, nodes, k)
        for i, node in enumerate(nodes.tolist()):
            self.proposed[(self.step, tuple(tree.path_tokens(node)))] = (p.tokens[i], p.q[i])
        return p

    def commit(self, commit: Commit) -> None:
        self.inner.commit(commit)
        self.accepted.append((self.step, self.root, list(commit.tokens[:-1])))
        self.step, self.root = self.step + 1, commit.tokens[-1]


@pytest.fixture(scope="module")
def prompts(target64):
    return [target64.tokenizer(p).input_ids for p in tinystories_prompts(N_PROMPTS)]


DRAFTERS = {  # the same 3-layer draft both ways; max for one, mix for the other
    "model+ngram": ("model+ngram", {"model.model": str(STORIES260K), "model.layers": 3}),
    "self+ngram-mix": ("self+ngram", {"self": {"layers": 3}, "merge": "mix", "weights": "3,1"}),
}
BUILDERS = {"opt-tree": ("opt-tree", {"nodes": 10, "max_depth": 6}), "chain": ("chain", {"k": 4})}


@pytest.mark.parametrize("drafter_key", DRAFTERS)
@pytest.mark.parametrize("builder_key", BUILDERS)
def test_lossless_and_the_ngram_part_counts(drafter_key, builder_key, target64, greedy_reference, prompts):
    name, d_opts = DRAFTERS[drafter_key]
    builder, b_opts = BUILDERS[builder_key]
    dec = treespec.Decoder(target64, drafter=name, drafter_options=d_opts, builder=builder, builder_options=b_opts)
    model, ngram = dec.drafter.parts = [Spy(p) for p in dec.drafter.parts]
    failures, tokens, steps = [], 0, 0
    for ids in prompts:
        out = dec.generate(ids, max_new_tokens=MAX_NEW)
        want = greedy_reference(ids, MAX_NEW)
        if out.token_ids != want:
            failures.append(greedy_reference.explain(ids, out.token_ids, want))
        tokens, steps = tokens + len(out.token_ids), steps + out.stats.n_steps
    assert not failures, f"{len(failures)}/{len(prompts)} prompts differ:\n" + "\n".join(failures)
    # not vacuous: some accepted tokens were proposed by the ngram part only (not in the model part's
    # top k there), so they reached the tree through the merge
    only_ngram = 0
    for step, root, accepted in ngram.accepted:
        path: tuple[int, ...] = (root,)
        for t in accepted:
            only_ngram += ngram.q(step, path, t) > 0 and model.q(step, path, t) == 0
            path += (t,)
    print(f"{drafter_key} + {builder_key}: τ = {tokens / steps:.3f}; {only_ngram} accepted tokens from ngram only")
    assert only_ngram > 0 and tokens / steps > 1.0


def test_cli_run_self_plus_ngram(greedy_reference):
    prompt = "Once upon a time, there was a little dog"
    res = CliRunner().invoke(
        app,
        [
            "run",
            "--target",
            str(STORIES260K),
            "--drafter",
            "self+ngram",
            "-D",
            "self.layers=3,ngram.max_ngram=2",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "16",
            "--json",
            "--dtype",
            "float64",
        ],
    )
    assert res.exit_code == 0, res.output
    ids = greedy_reference.target.tokenizer(prompt).input_ids
    assert json.loads(res.stdout)["token_ids"] == greedy_reference(ids, 16)
