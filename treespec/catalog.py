"""Names treespec knows: public draft aliases and the targets they were made for, what ships in the
package (treespec's own pair, heads trained here) and which of it a target gets by default, and what an
alias resolves to. Facts, not loading: ``treespec.models`` finds and loads what these names mean."""

from __future__ import annotations

from pathlib import Path

#: Common public draft models, by short name. Facts, not code: extend freely.
MODEL_ALIASES: dict[str, str] = {
    "llama-68m": "JackFram/llama-68m",
    "llama-160m": "JackFram/llama-160m",
    "vicuna-68m": "double7/vicuna-68m",
    "vicuna-160m": "double7/vicuna-160m",
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "gpt2": "openai-community/gpt2",
}


#: The targets a draft alias was made for, the first being the one `--drafter ALIAS` alone decodes
#: with. Facts from the drafts' papers and model cards: llama-68m/160m are SpecInfer's small LLaMAs
#: (Wikipedia + C4), the draft of the LLaMA-2 / Vicuna targets in the OPT-Tree paper; the Vicuna
#: drafts were distilled from Vicuna conversations; the others share their family's tokenizer.
DRAFT_TARGETS: dict[str, tuple[str, ...]] = {
    "llama-68m": (
        "meta-llama/Llama-2-7b-hf",
        "meta-llama/Llama-2-7b-chat-hf",
        "meta-llama/Llama-2-13b-hf",
        "lmsys/vicuna-7b-v1.3",
    ),
    "llama-160m": (
        "meta-llama/Llama-2-7b-hf",
        "meta-llama/Llama-2-7b-chat-hf",
        "meta-llama/Llama-2-13b-hf",
        "lmsys/vicuna-7b-v1.3",
    ),
    "vicuna-68m": ("lmsys/vicuna-7b-v1.3", "lmsys/vicuna-13b-v1.3", "lmsys/vicuna-33b-v1.3"),
    "vicuna-160m": ("lmsys/vicuna-7b-v1.3", "lmsys/vicuna-13b-v1.3", "lmsys/vicuna-33b-v1.3"),
    "tinyllama": ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-13b-chat-hf"),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct"),
    "gpt2": ("openai-community/gpt2-xl", "openai-community/gpt2-large"),
    "treespec-py-draft": ("treespec-py",),
}


def default_target_for(drafter: str | None) -> str | None:
    """The target a draft alias was made for (``DRAFT_TARGETS``), or None."""
    targets = DRAFT_TARGETS.get(drafter or "")
    return targets[0] if targets else None


#: treespec's own default pair, shipped inside the package (docs/default-pair.md): alias -> folder.
PAIR_DIR = Path(__file__).resolve().parent / "default_pair"
PACKAGED_MODELS: dict[str, Path] = {
    "treespec-py": PAIR_DIR / "target",  # Llama, 6.95M parameters, Python stdlib source
    "treespec-py-draft": PAIR_DIR / "draft",  # Llama, 0.61M parameters, same tokenizer
    "treespec-py-eagle": PAIR_DIR / "eagle",  # EAGLE head for treespec-py (`--drafter eagle -D head=`)
    # EAGLE head for SmolLM2-135M-Instruct (`smollm2`, treespec.gguf), trained here (docs/smollm2.md)
    "smollm2-eagle": Path(__file__).resolve().parent / "heads" / "smollm2-eagle",
    "treespec-py-block": PAIR_DIR / "block",  # block drafter for treespec-py (`--drafter block`, docs/drafters.md)
    "smollm2-block": Path(__file__).resolve().parent / "heads" / "smollm2-block",  # block drafter for smollm2
}
#: the EAGLE head `--drafter eagle` uses for a target when no head= is given: target alias -> head alias
SHIPPED_HEADS: dict[str, str] = {"treespec-py": "treespec-py-eagle", "smollm2": "smollm2-eagle"}
#: the block drafter `--drafter block` uses for a target when no head= is given: target alias -> its alias
SHIPPED_BLOCKS: dict[str, str] = {"treespec-py": "treespec-py-block", "smollm2": "smollm2-block"}
#: where a packaged GGUF's model is published: a target loaded under one of these hub ids (or from a
#: folder named like its repository) gets that alias's shipped drafters too (trained on the GGUF's
#: dequantised weights; the published ones are the same model before quantisation)
MODEL_SOURCES: dict[str, tuple[str, ...]] = {"smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct",)}
MAIN_TARGET = "smollm2"  # `treespec run` without --target: SmolLM2-135M-Instruct, a real chat model
DEFAULT_TARGET = "treespec-py"  # treespec's own small pair: tests, `bench`/`tree show` without --target
DEFAULT_DRAFT = "treespec-py-draft"


def shipped_for(target_name: str | None, table: dict[str, str]) -> str | None:
    """The drafter alias ``table`` (``SHIPPED_HEADS``, ``SHIPPED_BLOCKS``) ships for a target given by
    alias, by the folder a packaged alias resolves to, by a packaged GGUF's file name or the folder
    treespec converted it into, or by the model's published hub id (``MODEL_SOURCES``, also as the
    name of a local folder); None if none."""
    from treespec.gguf import PACKAGED_GGUF, converted_from

    if not target_name:
        return None
    if target_name in table:
        return table[target_name]
    leaf, source = Path(target_name).name, converted_from(target_name)
    for alias, drafter in table.items():
        if alias in PACKAGED_MODELS:
            if Path(resolve_name(target_name)).expanduser().resolve() == PACKAGED_MODELS[alias].resolve():
                return drafter
        elif alias in PACKAGED_GGUF and PACKAGED_GGUF[alias][2] in (leaf, source):
            return drafter
        sources = MODEL_SOURCES.get(alias, ())
        if target_name in sources or leaf.lower() in {s.rsplit("/", 1)[-1].lower() for s in sources}:
            return drafter
    return None


def resolve_name(name: str) -> str:
    """An alias becomes its folder (treespec's own models) or hub id; a path or hub id is returned unchanged."""
    if name in PACKAGED_MODELS:
        return str(PACKAGED_MODELS[name])
    return MODEL_ALIASES.get(name, name)
