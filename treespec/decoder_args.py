"""What a ``Decoder`` accepts: its arguments' types, the user's own loaded models (a transformers model
as target or draft, with its tokenizer), and the models it needs from the hub cache; each misuse is
one ``ConfigError`` line, before anything loads."""

from __future__ import annotations

from typing import Any

from treespec.errors import ConfigError, TreespecError
from treespec.inputs import is_loaded_model, model_name
from treespec.interfaces import Drafter, TreeBuilder
from treespec.target import TargetModel


def adopt_target(model: Any, tokenizer: Any, placement: dict[str, Any]) -> TargetModel:
    """The user's loaded model as the target, where and in the dtype it already is (treespec moves no
    one's model: ``model.to(...)`` first). Without ``tokenizer``, the one saved beside the model if
    there is one; else prompts and outputs are token ids."""
    given = [name for name, value in placement.items() if value is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} place a model treespec loads; the target was passed already loaded: move it "
            "first (model.to(...)), or pass its name or path instead"
        )
    if tokenizer is None:
        tokenizer = _saved_tokenizer(model)
    return TargetModel(model, tokenizer, name=model_name(model))


def _saved_tokenizer(model: Any) -> Any:
    """The tokenizer in the local folder a model was loaded from, or None (nothing is downloaded)."""
    from pathlib import Path

    folder = Path(model_name(model))
    if not (folder / "tokenizer_config.json").is_file() and not (folder / "tokenizer.json").is_file():
        return None
    try:
        from treespec.models import load_tokenizer

        return load_tokenizer(str(folder))
    except TreespecError:
        return None


def check_arguments(
    target: Any, drafter: Any, builder: Any, drafter_options: Any, builder_options: Any, offload_folder: Any
) -> tuple[Any, Any]:
    """The Decoder's arguments have the types it takes (a path may be a ``pathlib.Path``): one
    ``ConfigError`` each otherwise, not a ``TypeError`` from deep inside (``Decoder(3)``,
    ``builder_options="k=3"``). Returns (target, drafter) with paths as strings."""
    import os
    from collections.abc import Mapping

    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    if isinstance(drafter, os.PathLike):
        drafter = os.fspath(drafter)
    if not isinstance(target, (str, TargetModel)) and not is_loaded_model(target):
        raise ConfigError(
            "target must be a model name or path (str), a loaded transformers model or a TargetModel, got "
            f"{_short(target)} ({type(target).__name__})"
        )
    if not isinstance(drafter, (str, Drafter)) and not is_loaded_model(drafter):
        raise ConfigError(
            "drafter must be a drafter name, a draft model (its name, or the model loaded) or a Drafter, got "
            f"{_short(drafter)} ({type(drafter).__name__})"
        )
    if not isinstance(builder, (str, TreeBuilder)):
        raise ConfigError(
            f"builder must be a builder name (str) or a TreeBuilder, got {builder!r} ({type(builder).__name__})"
        )
    for name, options in (("drafter_options", drafter_options), ("builder_options", builder_options)):
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(
                f"{name} must be a dict of option name -> value, got {options!r} ({type(options).__name__})"
            )
    if offload_folder is not None and not isinstance(offload_folder, (str, os.PathLike)):
        raise ConfigError(
            f"offload_folder must be a folder path, got {offload_folder!r} ({type(offload_folder).__name__})"
        )
    return target, drafter


def require_models(target: Any, drafter: Any, options: dict[str, Any] | None) -> None:
    """Before loading anything: the hub models this Decoder needs (the target, a draft model) are
    cached, or (offline) one line names them all (``treespec.models.require_cached``)."""
    from treespec.factory import resolve_drafter_name
    from treespec.models import require_cached

    needed = [(target, "target")] if isinstance(target, str) else []
    if isinstance(drafter, str):
        try:
            name, opts = resolve_drafter_name(drafter, options)
        except TreespecError:
            name, opts = "", {}  # an unknown drafter: make_drafter says so, in its words
        if name == "model" and isinstance(opts.get("model"), str):
            needed.append((opts["model"], "draft model"))
        if isinstance(opts.get("head"), str):  # eagle, eagle3: a head from the hub is a model too
            needed.append((opts["head"], "EAGLE head"))
    require_cached(needed)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def hf_prompt(prompt: Any, input_ids: Any, attention_mask: Any) -> Any:
    """``generate``'s prompt from what Hugging Face users pass: ``input_ids`` [L] / [1, L] (one prompt)
    or [B, L] (B prompts: a batch), without the positions ``attention_mask`` marks as padding."""
    from treespec.inputs import is_tensor

    if input_ids is not None:
        if prompt is not None:
            raise ConfigError("generate() got both a prompt and input_ids: pass one of them")
        prompt = input_ids
    if prompt is None:
        raise ConfigError(
            "generate() needs a prompt: text, token ids, or input_ids (e.g. **tokenizer(text, return_tensors='pt'))"
        )
    if attention_mask is None and not (is_tensor(prompt) and prompt.dim() == 2 and prompt.shape[0] > 1):
        return prompt
    if not is_tensor(prompt):
        raise ConfigError("attention_mask goes with input_ids given as a tensor: pass both, or a list of prompts")
    rows = prompt if prompt.dim() == 2 else prompt[None]  # [B, L]
    mask = attention_mask if attention_mask is not None else rows.new_ones(rows.shape)
    if not is_tensor(mask) or tuple(mask.shape) != tuple(rows.shape if mask.dim() == 2 else rows.shape[1:]):
        raise ConfigError(
            f"attention_mask must be a tensor shaped like input_ids {list(prompt.shape)}, got "
            f"{list(mask.shape) if is_tensor(mask) else type(mask).__name__}"
        )
    mask = (mask if mask.dim() == 2 else mask[None]).bool()  # [B, L]
    kept = []
    for row, keep in zip(rows, mask):
        where = keep.nonzero().flatten()
        if where.numel() and int(where[-1] - where[0]) + 1 != where.numel():
            raise ConfigError("attention_mask has holes inside a prompt: only padding at either end is dropped")
        kept.append(row[keep])
    return kept[0] if len(kept) == 1 else [r.tolist() for r in kept]


def sample_or_not(do_sample: Any, temperature: float | None) -> float | None:
    """Hugging Face's ``do_sample``: True samples (at temperature 1 unless given), False is greedy."""
    if do_sample is None:
        return temperature
    if not isinstance(do_sample, bool):
        raise ConfigError(f"do_sample must be True or False, got {do_sample!r}")
    if not do_sample:
        if temperature:
            raise ConfigError(f"do_sample=False is greedy, but temperature={temperature} asks to sample: drop one")
        return None
    return 1.0 if temperature is None else temperature


def refuse_unknown(unknown: dict[str, Any]) -> None:
    """``generate(**kwargs)`` with names it does not take: one line naming them and what it takes."""
    if unknown:
        raise ConfigError(
            f"generate() got unknown argument(s) {', '.join(map(repr, unknown))}; it takes prompt (or input_ids and "
            "attention_mask), max_new_tokens, stream, temperature, top_p, top_k, do_sample, seed, "
            "draft_temperature, rule, batch_size"
        )
