"""treespec from Hugging Face's own ``model.generate``: a ``custom_generate`` method shipped in the package.

    out = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=128,
                         custom_generate=treespec.hf.CUSTOM_GENERATE, trust_remote_code=True,
                         drafter="treespec-py-draft")          # or assistant_model=draft_model

transformers runs ``CUSTOM_GENERATE/custom_generate/generate.py`` (a local folder inside this package:
nothing from the hub; transformers asks ``trust_remote_code=True`` for any folder's code), which calls
``generate`` below: the same ids as plain ``generate`` returns, prompt included, token for token under
greedy decoding and distributed exactly as ``generate(do_sample=True)`` under sampling. Honoured:
``input_ids``/``inputs``, ``attention_mask`` (padding at either end; B rows decode as one batch),
``max_new_tokens``/``max_length``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
``pad_token_id``, ``streamer`` (one row), ``return_dict_in_generate`` (``sequences`` only), the model's
``generation_config``; treespec's own ``drafter``, ``builder``, ``drafter_options``,
``builder_options``, ``tokenizer``. Anything else that would change the output (beams, penalties,
logits processors, stop strings, scores ...) is refused in one line, never silently ignored.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch

from treespec.errors import ConfigError
from treespec.generation_settings import unhonoured

#: the folder to pass as ``custom_generate=``: it holds ``custom_generate/generate.py``
CUSTOM_GENERATE = str(Path(__file__).parent / "hf_generate")

#: arguments of ``generate`` itself that must stay unset
UNSET = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "negative_prompt_ids",
         "negative_prompt_attention_mask")  # fmt: skip

_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {settings: Decoder}


def generate(
    model: Any,
    inputs: torch.Tensor | None = None,
    generation_config: Any = None,
    *,
    drafter: Any = None,
    builder: Any = "opt-tree",
    drafter_options: dict[str, Any] | None = None,
    builder_options: dict[str, Any] | None = None,
    tokenizer: Any = None,
    assistant_model: Any = None,
    streamer: Any = None,
    synced_gpus: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``model.generate`` through treespec (see the module docstring); returns what ``generate`` would."""
    rows, attention_mask = _inputs(inputs, kwargs, synced_gpus)  # [B, L]
    settings = _settings(model, generation_config, kwargs, rows.shape[1])
    if drafter is None:
        if assistant_model is None:
            raise ConfigError(
                "treespec's generate needs a draft: drafter='NAME' (e.g. a draft model's path) or assistant_model=model"
            )
        drafter = assistant_model
    if streamer is not None and rows.shape[0] > 1:
        raise ConfigError("a streamer follows one row: pass one prompt, or drop the streamer")
    dec = _decoder(model, drafter, builder, drafter_options, builder_options, tokenizer)
    stream = None
    if streamer is not None:
        streamer.put(rows[0].cpu())
        stream = lambda ids: streamer.put(torch.tensor(ids))  # noqa: E731
    outs = dec.generate(
        input_ids=rows if rows.shape[0] > 1 else rows[0],
        attention_mask=attention_mask,
        max_new_tokens=settings["max_new_tokens"],
        temperature=settings["temperature"],
        top_k=settings["top_k"],
        top_p=settings["top_p"],
        stream=stream,
    )
    if streamer is not None:
        streamer.end()
    sequences = _sequences(rows, outs if isinstance(outs, list) else [outs], settings["pad"])
    if settings["return_dict"]:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _inputs(inputs: Any, kwargs: dict[str, Any], synced_gpus: bool | None) -> tuple[torch.Tensor, Any]:
    """(the prompts as [B, L] ids, their attention mask) from ``generate``'s arguments; one line for what
    treespec does not run (``UNSET``, ``synced_gpus``) and for missing or doubled ids."""
    for name in UNSET:
        value = kwargs.pop(name, None)
        if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
            raise ConfigError(f"treespec's generate does not run {name}: drop it, or use plain generate()")
    if synced_gpus:
        raise ConfigError("treespec's generate runs one process: drop synced_gpus")
    input_ids, attention_mask = kwargs.pop("input_ids", None), kwargs.pop("attention_mask", None)
    if inputs is not None:
        if input_ids is not None:
            raise ConfigError("generate() got both inputs and input_ids: pass one")
        input_ids = inputs
    if input_ids is None or not torch.is_tensor(input_ids):
        raise ConfigError(
            "treespec's generate needs input_ids: a [B, L] tensor (e.g. **tokenizer(text, return_tensors='pt'))"
        )
    return (input_ids if input_ids.dim() == 2 else input_ids[None]), attention_mask


def _sequences(rows: torch.Tensor, outs: list[Any], pad: int) -> torch.Tensor:
    """[B, L + max new]: each prompt and its new tokens, finished rows padded, as ``generate`` returns them."""
    width = max(len(o.token_ids) for o in outs)
    new = torch.full((len(outs), width), pad, dtype=rows.dtype)  # [B, max new]
    for i, o in enumerate(outs):
        new[i, : len(o.token_ids)] = torch.tensor(o.token_ids, dtype=rows.dtype)
    return torch.cat([rows, new.to(rows.device)], dim=1)


def _settings(model: Any, generation_config: Any, kwargs: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    """The generation settings in effect (the model's ``generation_config``, then ``generation_config``,
    then keyword arguments), refused in one line where treespec would not produce ``generate``'s output."""
    import copy

    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    if "eos_token_id" in kwargs and kwargs["eos_token_id"] != model.generation_config.eos_token_id:
        raise ConfigError(
            f"treespec's generate stops where the model's generation_config says (eos_token_id="
            f"{model.generation_config.eos_token_id!r}): set it there, not per call"
        )
    unused = gc.update(**kwargs)
    unused = {k: v for k, v in unused.items() if k not in ("use_cache",)}
    if unused:
        raise ConfigError(
            f"treespec's generate does not take {', '.join(sorted(unused))}: it honours input_ids, attention_mask, "
            "max_new_tokens, max_length, do_sample, temperature, top_k, top_p, pad_token_id, streamer, "
            "return_dict_in_generate, drafter, builder, drafter_options, builder_options, tokenizer"
        )
    changed = unhonoured(gc)
    if changed:
        raise ConfigError(
            f"treespec's generate cannot honour {', '.join(changed)}: "
            "drop them (the model's generation_config too), or use plain generate()"
        )
    defaults = gc._get_default_generation_params() if hasattr(gc, "_get_default_generation_params") else {}

    def value(key: str) -> Any:
        v = getattr(gc, key, None)
        return defaults.get(key) if v is None else v

    if gc.max_new_tokens is not None:
        max_new = gc.max_new_tokens
    else:
        max_new = int(value("max_length") or 20) - prompt_len
        if max_new <= 0:
            raise ConfigError(
                f"max_length {value('max_length')} leaves no room after a {prompt_len}-token prompt: set max_new_tokens"
            )
    sample = bool(value("do_sample"))
    eos = value("eos_token_id")
    first_eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    pad = value("pad_token_id")
    return {
        "max_new_tokens": max_new,
        "temperature": float(value("temperature") or 1.0) if sample else None,
        "top_k": int(value("top_k") or 0) if sample else None,
        "top_p": float(value("top_p") or 1.0) if sample else None,
        "pad": int(pad if pad is not None else (first_eos if first_eos is not None else 0)),
        "return_dict": bool(value("return_dict_in_generate")),
    }


def _decoder(model: Any, drafter: Any, builder: Any, drafter_options: Any, builder_options: Any, tokenizer: Any) -> Any:
    """One Decoder per model and settings, kept while the model lives: its cost measurements and
    calibration carry over from call to call, as a Decoder's do from prompt to prompt."""
    from treespec.decoder import Decoder

    key = (
        id(drafter) if not isinstance(drafter, str) else drafter,
        id(builder) if not isinstance(builder, str) else builder,
        repr(sorted((drafter_options or {}).items())),
        repr(sorted((builder_options or {}).items())),
        id(tokenizer),
    )
    per_model = _decoders.setdefault(model, {})
    if key not in per_model:
        per_model[key] = Decoder(
            model,
            drafter=drafter,
            builder=builder,
            drafter_options=drafter_options,
            builder_options=builder_options,
            tokenizer=tokenizer,
        )
    return per_model[key]
