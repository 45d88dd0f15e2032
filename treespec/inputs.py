"""Checks at the API boundary: what ``Decoder.generate`` accepts, and the JSON-lines files users
hand over (datasets, datastore corpora), refused in one line otherwise.

Each function raises ``ConfigError`` naming the problem and the fix, before anything runs, so a
misuse never fails half-way through a decode (or, worse, silently decodes something else: a ``[B, L]``
tensor flattened into one prompt, float ids truncated to integers).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from numbers import Integral
from pathlib import Path
from typing import Any

from treespec.errors import ConfigError

PROMPT_TYPES = "text (str), a list of token ids, or a [L] / [1, L] integer tensor"


def is_loaded_model(value: Any) -> bool:
    """A model object as transformers loads it (``AutoModelForCausalLM.from_pretrained(...)``): a torch
    module with a ``config`` and a ``generate``, not a name."""
    import torch

    return isinstance(value, torch.nn.Module) and hasattr(value, "config") and hasattr(value, "generate")


def model_name(model: Any) -> str:
    """What a loaded model is called in messages and cost profiles: the path or hub id it came from."""
    return str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or type(model).__name__)


def token_ids(prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    """The token ids of ``prompt`` (text through ``tokenizer``), each in ``[0, vocab_size)``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("the target has no tokenizer: pass token ids instead of text")
        return list(tokenizer(prompt, verbose=False).input_ids)  # no length warning: the context is checked
    ids = _tensor_ids(prompt) if is_tensor(prompt) else _list_ids(prompt)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(
            f"token id {bad} is outside the target's vocabulary [0, {vocab_size}): pass ids from its tokenizer"
        )
    return ids


def is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "dtype") and hasattr(value, "shape")


def _tensor_ids(prompt: Any) -> list[int]:
    import torch

    if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
        raise ConfigError(f"the prompt tensor has dtype {prompt.dtype}: token ids must be integers (torch.long)")
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1:
        shape = list(prompt.shape)
        hint = "; several prompts: pass them to generate() (a [B, L] tensor or a list)" if prompt.dim() == 2 else ""
        raise ConfigError(f"the prompt tensor has shape {shape}: give [L] or [1, L]{hint}")
    return [int(t) for t in prompt.tolist()]


def _list_ids(prompt: Any) -> list[int]:
    if not isinstance(prompt, (list, tuple)):
        raise ConfigError(f"the prompt is a {type(prompt).__name__}: give {PROMPT_TYPES}")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, Integral)), None)
    if bad is not None:
        raise ConfigError(f"the prompt holds {bad!r} ({type(bad).__name__}): token ids must be integers")
    return [int(t) for t in prompt]


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int > 0 (bools and non-integral numbers refused)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ConfigError(f"{name} must be a whole number > 0, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")
    return int(value)


SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch's generators take, with room for ``seed + n``


def seed_value(value: Any, name: str = "seed") -> int:
    """A random seed: a whole number in ``SEED_RANGE`` (2**64 failed deep inside torch; a float or a
    string was used as something else without a word)."""
    lo, hi = SEED_RANGE
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ConfigError(f"{name} must be a whole number, got {value!r} ({type(value).__name__})")
    if not lo <= value <= hi:
        raise ConfigError(f"{name} {value} is out of range: use a whole number between -2**63 and 2**63 - 1")
    return int(value)


def real_number(name: str, value: Any) -> float | None:
    """``value`` (None passes) as a float, if it is an int or a float: a string or a list is one line,
    not a ``TypeError`` from a comparison deep inside."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def json_lines(path: Path, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a ``.jsonl`` (or ``.jsonl.gz``) file; a line
    that is not a JSON object is one ``ConfigError`` naming ``what``, the file and the line."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError(
                    f"{what} {path} line {n} is not JSON ({exc}): give one JSON object per line"
                ) from None
            if not isinstance(row, dict):
                raise ConfigError(f"{what} {path} line {n} is not a JSON object: give one JSON object per line")
            yield n, row


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template (instruct and chat models do)."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], model: str = "the target") -> list[int]:
    """Token ids of a conversation (``[{"role": "system"|"user"|"assistant", "content": ...}, ...]``)
    in the model's own chat template, ending with the prompt for the assistant's next turn."""
    if not has_chat_template(tokenizer):
        raise ConfigError(f"{model} has no chat template (a base model): drop --chat/--system and give a plain prompt")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - a template is code from the model's files: jinja errors, its raise_exception
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise ConfigError(
            f"{model}'s chat template fails on this conversation ({type(exc).__name__}: {first}): fix "
            "chat_template in its tokenizer_config.json, or drop --chat/--system"
        ) from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
