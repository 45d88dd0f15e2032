"""Plugin discovery, the registry's error paths, and the example plugin (examples/treespec-example-plugin).

Discovery is tested through real entry points: the built-ins are entry points of the installed
``treespec`` distribution, the example plugin is installed with
``pip install -e examples/treespec-example-plugin``, and the error cases put fake distributions
(a ``NAME-0.1.dist-info`` directory plus a module) on ``sys.path``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import treespec
from treespec import registry
from treespec.errors import ConfigError, PluginError

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "stories260K"
PROMPTS = SHARED / "prompts" / "tinystories_val.txt"

HAS_EXAMPLE = importlib.util.find_spec("treespec_example") is not None
needs_example = pytest.mark.skipif(
    not HAS_EXAMPLE,
    reason="the example plugin is not installed: pip install -e examples/treespec-example-plugin",
)
needs_model = pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} not found (../shared/models/stories260K)")


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Every test starts and ends with an unloaded process-wide registry and no env switches."""
    monkeypatch.delenv("TREESPEC_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("TREESPEC_BLOCK_PLUGINS", raising=False)
    registry.reset()
    yield
    registry.reset()


# ---------------------------------------------------------------------------------------------------
# fake distributions on disk


class FakeDists:
    """Writes installed-looking distributions into one directory that is put on sys.path."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        self.modules: list[str] = []
        monkeypatch.syspath_prepend(str(root))

    def add(self, dist: str, entry_point: str, module: str, source: str) -> None:
        info = self.root / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[treespec]\n{entry_point} = {module}\n")
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        self.modules.append(module)
        importlib.invalidate_caches()

    def cleanup(self) -> None:
        for module in self.modules:
            sys.modules.pop(module, None)
        importlib.invalidate_caches()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    dists = FakeDists(tmp_path, monkeypatch)
    yield dists
    dists.cleanup()


def plugin_source(kind: str, name: str, aliases: tuple[str, ...] = ()) -> str:
    """A hook module registering one builder or drafter (reusing the built-in chain's classes)."""
    hook = "treespec_builders" if kind == "builder" else "treespec_drafters"
    return f"""
        import treespec
        from treespec.plugins.configs import ChainConfig

        @treespec.hookimpl
        def {hook}():
            return [treespec.PluginSpec(name={name!r}, summary="fake", config=ChainConfig,
                                        load="treespec.plugins.chain:ChainBuilder", aliases={aliases!r})]
        """


# ---------------------------------------------------------------------------------------------------
# discovery through real entry points


def test_builtins_are_discovered_through_entry_points():
    eps = [
        ep for ep in md.entry_points(group="treespec") if ep.dist is not None and ep.dist.metadata["Name"] == "treespec"
    ]
    assert ("builtin", "treespec.plugins.builtin") in [(ep.name, ep.value) for ep in eps]

    reg = registry.load_plugins()
    assert registry.load_plugins() is reg  # loaded once
    assert {"opt-tree", "chain"} <= set(reg.builders)
    assert "model" in reg.drafters
    for entry in (reg.builders["opt-tree"], reg.builders["chain"], reg.drafters["model"]):
        assert entry.package == "treespec"
        assert entry.source == "builtin"
        assert entry.version == treespec.__version__
    assert reg.failures == []


@needs_example
def test_example_plugin_is_discovered_through_its_entry_point():
    from treespec_example.best_first import BestFirstBuilder
    from treespec_example.bigram import BigramDrafter

    reg = registry.load_plugins()
    bigram, best_first = reg.drafters["bigram"], reg.builders["best-first"]
    for entry in (bigram, best_first):
        assert entry.package == "treespec-example-plugin"
        assert entry.version == "0.1.0"
        assert entry.source == "example"
    assert bigram.spec.load == "treespec_example.bigram:BigramDrafter"  # lazy
    assert bigram.spec.resolve() is BigramDrafter and BigramDrafter.Config is bigram.spec.config
    assert best_first.spec.resolve() is BestFirstBuilder and BestFirstBuilder.Config is best_first.spec.config
    assert BigramDrafter.provides_probabilities is False and BigramDrafter.needs_target_hidden is False


@needs_example
def test_listing_plugins_does_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        from typer.testing import CliRunner
        from treespec.cli.app import app
        result = CliRunner().invoke(app, ["plugins", "--json"])
        assert result.exit_code == 0, result.output
        names = {p["name"] for p in __import__("json").loads(result.output)["plugins"]}
        assert {"bigram", "best-first", "opt-tree", "chain", "model"} <= names, names
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        assert not heavy, heavy
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@needs_example
def test_cli_plugins_json_lists_the_example():
    from typer.testing import CliRunner

    from treespec.cli.app import app

    result = CliRunner().invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = {(p["kind"], p["name"]): p for p in data["plugins"]}
    bigram = rows[("drafter", "bigram")]
    assert bigram["package"] == "treespec-example-plugin"
    assert bigram["entry_point"] == "example"
    assert [o["name"] for o in bigram["options"]] == ["min_count"]
    assert [o["name"] for o in rows[("builder", "best-first")]["options"]] == ["nodes", "branch", "max_depth"]
    assert not [f for f in data["failed"] if f["package"] == "treespec-example-plugin"]


# ---------------------------------------------------------------------------------------------------
# registry errors


def test_duplicate_of_a_builtin_names_both_sources(fake):
    fake.add("fake-dup", "dupe", "fake_dup_chain", plugin_source("builder", "chain"))
    reg = registry.discover()  # listing still works: only the ambiguous name is unusable
    assert reg.get("builder", "opt-tree").spec.name == "opt-tree"
    assert "chain" in reg.names("builder") and "builder:chain" in reg.conflicts
    with pytest.raises(PluginError) as err:
        reg.get("builder", "chain")
    msg = str(err.value)
    assert "'chain' is registered twice" in msg
    assert f"treespec {treespec.__version__} (entry point 'builtin')" in msg
    assert "fake-dup 0.1 (entry point 'dupe')" in msg
    assert "TREESPEC_BLOCK_PLUGINS=dupe" in msg


def test_duplicate_between_two_plugins_names_both_and_blocking_one_resolves_it(fake, monkeypatch):
    fake.add("fake-one", "one", "fake_twin_one", plugin_source("drafter", "twin"))
    fake.add("fake-two", "two", "fake_twin_two", plugin_source("drafter", "twin"))
    with pytest.raises(PluginError) as err:
        registry.discover().get("drafter", "twin")
    msg = str(err.value)
    assert "fake-one 0.1 (entry point 'one')" in msg and "fake-two 0.1 (entry point 'two')" in msg

    monkeypatch.setenv("TREESPEC_BLOCK_PLUGINS", "two")
    reg = registry.discover()
    assert reg.drafters["twin"].package == "fake-one"
    assert reg.skipped == ["two"]


def test_alias_that_shadows_a_name_is_a_duplicate(fake):
    fake.add("fake-alias", "alias", "fake_alias_mod", plugin_source("drafter", "mine", aliases=("model",)))
    reg = registry.discover()
    assert reg.get("drafter", "mine").spec.name == "mine"  # the plugin's own name still works
    with pytest.raises(
        PluginError, match=rf"drafter name 'model' is registered twice: by treespec {re.escape(treespec.__version__)}"
    ):
        reg.get("drafter", "model")


def test_unknown_names_suggest_close_ones():
    reg = registry.load_plugins()
    with pytest.raises(ConfigError, match=r"unknown builder 'opt-tre'; did you mean 'opt-tree'\?"):
        reg.get("builder", "opt-tre")
    from treespec.factory import make_builder

    with pytest.raises(ConfigError, match="did you mean 'chain'"):
        make_builder("chian")


@needs_example
def test_unknown_drafter_suggests_the_example():
    from treespec.factory import resolve_drafter_name

    with pytest.raises(ConfigError, match="did you mean 'bigram'"):
        resolve_drafter_name("bigrm", None)


@needs_example
def test_unknown_option_is_rejected():
    from treespec.factory import make_builder, make_drafter

    with pytest.raises(ConfigError, match=r"unknown option 'min_cnt'.*Valid options: min_count=1"):
        make_drafter("bigram", {"min_cnt": 2}, target=None)
    with pytest.raises(ConfigError, match=r"option 'branch'"):
        make_builder("best-first", {"branch": 0})
    assert make_builder("best-first", {"nodes": "5"}).config.nodes == 5  # strings from the CLI


def test_plugin_that_fails_to_import_is_reported_and_the_others_load(fake):
    fake.add("fake-broken", "broken", "fake_broken_mod", "raise RuntimeError('boom: missing dependency')\n")
    fake.add("fake-fine", "fine", "fake_fine_mod", plugin_source("builder", "fine-builder"))
    reg = registry.discover()
    assert ("broken", "fake-broken", "RuntimeError: boom: missing dependency") in reg.failures
    assert {"opt-tree", "chain", "fine-builder"} <= set(reg.builders)
    assert "model" in reg.drafters
    with pytest.raises(ConfigError, match=r"plugin\(s\) failed to load: see `treespec plugins`"):
        reg.get("builder", "nope")


def test_plugin_whose_hook_raises_is_reported_and_the_others_load(fake):
    fake.add(
        "fake-hookfail",
        "hookfail",
        "fake_hookfail_mod",
        """
        import treespec

        @treespec.hookimpl
        def treespec_builders():
            raise ValueError("hook exploded")
        """,
    )
    fake.add("fake-fine2", "fine2", "fake_fine2_mod", plugin_source("builder", "fine-builder-2"))
    reg = registry.discover()
    assert ("hookfail", "fake-hookfail", "ValueError: hook exploded") in reg.failures
    assert "fine-builder-2" in reg.builders and "chain" in reg.builders


def test_builder_alias_resolves(fake):
    fake.add("fake-alias-b", "alias-b", "fake_alias_b_mod", plugin_source("builder", "beam", aliases=("beam-search",)))
    reg = registry.discover()
    assert reg.get("builder", "beam-search") is reg.builders["beam"]
    with pytest.raises(ConfigError, match="did you mean 'beam-search'"):
        reg.get("builder", "beam-serch")


def test_a_plugin_whose_class_cannot_be_imported_is_named(fake, monkeypatch):
    from treespec.errors import PluginError
    from treespec.factory import make_builder

    fake.add(
        "fake-badload",
        "badload",
        "fake_badload_mod",
        """
        import treespec
        from treespec.plugins.configs import ChainConfig

        @treespec.hookimpl
        def treespec_builders():
            return [treespec.PluginSpec(name="ghost", summary="x", config=ChainConfig, load="no_such_module:Ghost")]
        """,
    )
    monkeypatch.setattr(registry, "_registry", registry.discover())
    with pytest.raises(PluginError) as err:
        make_builder("ghost")
    msg = str(err.value)
    assert "builder 'ghost' from fake-badload 0.1" in msg and "no_such_module" in msg and "\n" not in msg


def test_unmatched_switch_names_are_reported(monkeypatch):
    monkeypatch.setenv("TREESPEC_BLOCK_PLUGINS", "bigram")  # a plugin's drafter name, not an entry point
    assert "bigram" in registry.discover().unmatched


# ---------------------------------------------------------------------------------------------------
# environment switches


def test_load_plugins_empty_loads_builtins_only(fake, monkeypatch):
    fake.add("fake-a", "plug-a", "fake_env_a", plugin_source("builder", "builder-a"))
    monkeypatch.setenv("TREESPEC_LOAD_PLUGINS", "")
    reg = registry.load_plugins()
    assert {"opt-tree", "chain"} <= set(reg.builders) and "model" in reg.drafters
    assert "builder-a" not in reg.builders and "bigram" not in reg.drafters
    assert "plug-a" in reg.skipped and "builtin" not in reg.skipped
    if HAS_EXAMPLE:
        assert "example" in reg.skipped


def test_load_plugins_list_loads_only_those(fake, monkeypatch):
    fake.add("fake-a", "plug-a", "fake_env_a2", plugin_source("builder", "builder-a"))
    fake.add("fake-b", "plug-b", "fake_env_b2", plugin_source("builder", "builder-b"))
    monkeypatch.setenv("TREESPEC_LOAD_PLUGINS", " plug-b , ")
    reg = registry.discover()
    assert "builder-b" in reg.builders and "builder-a" not in reg.builders
    assert "chain" in reg.builders  # built-ins always load
    assert "plug-a" in reg.skipped and "plug-b" not in reg.skipped


def test_block_plugins_skips_those_but_never_builtins(fake, monkeypatch):
    fake.add("fake-a", "plug-a", "fake_env_a3", plugin_source("builder", "builder-a"))
    fake.add("fake-b", "plug-b", "fake_env_b3", plugin_source("builder", "builder-b"))
    monkeypatch.setenv("TREESPEC_BLOCK_PLUGINS", "plug-a,builtin")
    reg = registry.discover()
    assert "builder-b" in reg.builders and "builder-a" not in reg.builders
    assert {"opt-tree", "chain"} <= set(reg.builders)
    assert reg.skipped == ["plug-a"]


# ---------------------------------------------------------------------------------------------------
# the example plugin's components, alone


@needs_example
def test_bigram_counts_prompt_and_commits():
    import torch
    from treespec_example.bigram import BigramDrafter
    from treespec_example.configs import BigramConfig

    d = BigramDrafter(BigramConfig(), target=None)
    d.prefill(treespec.PrefillContext(input_ids=torch.tensor([1, 5, 6, 5, 7, 5, 6])))
    tree = treespec.DraftTree(6)  # root = the last prompt token
    prop = d.expand(tree, torch.tensor([0]), 3)
    assert prop.tokens.shape == prop.q.shape == (1, 3)
    assert prop.tokens[0, 0] == 5 and prop.q[0].tolist() == [1.0, 0.0, 0.0]  # padding: q = 0
    child = tree.add_children(torch.tensor([0]), prop.tokens[0, :1], prop.q[0, :1])
    prop = d.expand(tree, torch.cat([child, torch.tensor([0])]), 2)  # [2, 2]: node 5, then root 6
    assert prop.tokens.tolist() == [[6, 7], [5, 0]]
    assert prop.q.flatten().tolist() == pytest.approx([2 / 3, 1 / 3, 1.0, 0.0])

    d.commit(treespec.Commit(tokens=[5, 9]))  # adds (6, 5) and (5, 9); 9 is the next root
    assert d.followers[6] == {5: 2} and d.followers[5] == {6: 2, 7: 1, 9: 1}
    assert d.expand(treespec.DraftTree(9), torch.tensor([0]), 2).q.tolist() == [[0.0, 0.0]]  # 9: never followed

    strict = BigramDrafter(BigramConfig(min_count=2), target=None)
    strict.prefill(treespec.PrefillContext(input_ids=torch.tensor([1, 5, 6, 5, 7, 5, 6])))
    prop = strict.expand(treespec.DraftTree(5), torch.tensor([0]), 2)
    assert prop.tokens.tolist() == [[6, 0]] and prop.q[0].tolist() == pytest.approx([2 / 3, 0.0])


class ScriptedDrafter(treespec.Drafter):
    """Children of node i: tokens 10*i + j with q = qs[j]; records every expand call."""

    def __init__(self, qs):
        super().__init__(treespec.PluginConfig(), target=None)
        self.qs, self.calls = qs, []

    def prefill(self, context):
        pass

    def expand(self, tree, nodes, k):
        import torch

        self.calls.append((nodes.tolist(), k, tree.phat[nodes].tolist()))
        q = torch.zeros(len(nodes), k)
        n = min(k, len(self.qs))
        q[:, :n] = torch.tensor(self.qs[:n])
        tokens = nodes[:, None] * 10 + torch.arange(k)[None, :]
        return treespec.Proposals(tokens=tokens, q=q)

    def commit(self, commit):
        pass


@needs_example
@pytest.mark.parametrize(
    "nodes,branch,opt_depth,arg_depth,qs",
    [
        (16, 2, 8, 100, [0.6, 0.3]),
        (5, 2, 8, 100, [0.6, 0.3]),  # the last expansion asks for fewer children than branch
        (16, 3, 2, 100, [0.5, 0.3, 0.2]),  # the option max_depth binds
        (16, 3, 8, 2, [0.5, 0.3, 0.2]),  # the Decoder's max_depth binds
        (16, 2, 8, 100, [0.9, 0.0]),  # q == 0 entries are never added: a chain
        (7, 4, 8, 100, [0.4, 0.3, 0.2, 0.1]),
    ],
)
def test_best_first_budget_depth_and_order(nodes, branch, opt_depth, arg_depth, qs):
    from treespec_example.best_first import BestFirstBuilder
    from treespec_example.configs import BestFirstConfig

    builder = BestFirstBuilder(BestFirstConfig(nodes=nodes, branch=branch, max_depth=opt_depth))
    drafter = ScriptedDrafter(qs)
    tree = builder.build(drafter, root_token=7, max_depth=arg_depth)
    tree.validate()
    cap = min(opt_depth, arg_depth)
    assert tree.depth <= cap
    assert bool((tree.q[1:] > 0).all())
    assert all(len(call[0]) == 1 and 1 <= call[1] <= branch for call in drafter.calls)  # one node per expand
    expanded_phat = [call[2][0] for call in drafter.calls]
    assert expanded_phat == sorted(expanded_phat, reverse=True)  # best first
    live = sum(q > 0 for q in qs[:branch])  # children with q > 0 per node
    full = sum(live**d for d in range(1, cap + 1))  # the complete tree down to the depth limit
    assert tree.size == min(nodes, full)  # the budget is met exactly whenever the drafter allows it


@needs_example
def test_best_first_depth_zero_is_the_root_only():
    from treespec_example.best_first import BestFirstBuilder
    from treespec_example.configs import BestFirstConfig

    drafter = ScriptedDrafter([0.5, 0.5])
    tree = BestFirstBuilder(BestFirstConfig()).build(drafter, root_token=3, max_depth=0)
    assert len(tree) == 1 and tree.tokens.tolist() == [3] and drafter.calls == []


# ---------------------------------------------------------------------------------------------------
# lossless end to end with the real model


def first_prompts(n: int = 5, words: int = 12) -> list[str]:
    stories = [s for s in PROMPTS.read_text().split("\n\n") if s.strip()]
    return [" ".join(s.split()[:words]) for s in stories[:n]]


@pytest.fixture(scope="module")
def stories64():
    if not MODEL.is_dir() or not PROMPTS.is_file():
        pytest.skip(f"{MODEL} or {PROMPTS} not found")
    import torch

    # A 260K-parameter model gains nothing from intra-op threads, and on a busy CI box they make
    # every tiny forward ~10x slower; restore the setting afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield treespec.TargetModel.load(str(MODEL), dtype="float64")
    torch.set_num_threads(threads)


@needs_example
@needs_model
@pytest.mark.parametrize("builder", ["best-first", "opt-tree"])
def test_bigram_is_lossless(stories64, builder):
    import torch

    # a fixed budget: this is about the drafter's tokens being verified (auto may rightly stop drafting
    # with a draft this weak: tests/test_cost_aware.py)
    options = {"nodes": 10} if builder == "opt-tree" else None
    dec = treespec.Decoder(stories64, drafter="bigram", builder=builder, builder_options=options)
    accepted = 0
    for prompt in first_prompts():
        ids = stories64.tokenizer(prompt).input_ids
        out = dec.generate(ids, max_new_tokens=64)
        ref = stories64.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)
        assert out.token_ids == ref[0, len(ids) :].tolist(), prompt
        accepted += sum(s.accepted for s in out.stats.steps)
    assert accepted > 0  # the drafter really drafts: some of its tokens were accepted


@needs_example
@needs_model
def test_cli_run_with_the_example():
    from typer.testing import CliRunner

    from treespec.cli.app import app

    args = ["run", "--target", str(MODEL), "--drafter", "bigram", "--builder", "best-first",
            "-B", "nodes=8,branch=3", "-D", "min_count=1", "--prompt", "Once upon a time", "--max-new-tokens", "16",
            "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(data["token_ids"]) == 16 or data["stats"]["stop_reason"] == "eos"


def test_hook_reference_is_generated_from_the_hookspecs():
    from pathlib import Path

    from treespec import hookspecs

    doc = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
    assert doc.read_text() == hookspecs.reference(), "regenerate docs/hooks.md (command at its top)"
