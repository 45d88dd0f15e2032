"""Does a checkpoint fill the model its config describes? Checks ``models.load_causal_lm`` runs around
transformers' loading, which would otherwise initialise whatever is missing at random and say so only
in a log treespec keeps quiet (issue 27): layers asked for or configured beyond the stored weights,
missing or mis-shaped weights, and a model too large for this machine's memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treespec.errors import ModelLoadError


def check_size(name: str, what: str, layers: int | None, dtype: Any, folder: Path | None) -> None:
    """Before allocating a local model: its config.json may not describe more decoder layers than its
    weights hold (``num_hidden_layers: 100000`` on a 5-layer checkpoint allocated gigabytes of random
    layers before ``_check_loaded`` could refuse it), and the model it describes must fit the memory
    available. ``folder``: where the model is (``models.locate``). Anything unreadable is left to the
    loader, which says what is wrong in its words."""
    from treespec.memory import check_fits, decoder_parameters

    if folder is None:
        return
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(raw, dict):
        return
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    have = text.get("num_hidden_layers")
    if layers is None and isinstance(have, int):
        stored = _stored_layers(folder)
        if stored is not None and have > stored:
            raise ModelLoadError(
                f"{what} {name!r}: config.json says num_hidden_layers {have:,} but the weights in {folder} hold {stored} "
                f"layers: the weights of {have - stored:,} layers are missing from the checkpoint, so they would be random: "
                "fix config.json (num_hidden_layers) to match its weights, or point at the folder the model was saved in"
            )
    if "quantization_config" in raw or "quantization_config" in text:
        return  # stored in fewer bits than any dtype: the estimate below would be too high
    params = decoder_parameters(text, layers if layers is not None else have)
    item = getattr(dtype, "itemsize", 2)  # "auto": the checkpoint's own dtype, 2 bytes at least
    check_fits(
        params * item,
        f"{what} {name!r} ({params:,} parameters by its config.json)",
        "fix its config.json, load it in a smaller --dtype, or free memory",
    )


def _stored_layers(folder: Path) -> int | None:
    """Decoder layers the safetensors weights in ``folder`` hold (the highest ``layers.N.`` + 1), read
    from the headers only; None if there are none to read."""
    import re

    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}))
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(folder / "model.safetensors"), "pt") as fh:
                names = list(fh.keys())
        else:
            return None
    except Exception:  # noqa: BLE001 - a damaged file: loading it says so
        return None
    found = [int(m.group(1)) for n in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))]
    return max(found) + 1 if found else None


def check_loaded(name: str, what: str, info: dict[str, Any]) -> None:
    """Refuse a checkpoint whose weights do not fill its config: transformers initialises what is
    missing (or of the wrong shape) at random, reports it in a log treespec keeps quiet, and the model
    then decodes garbage. Weights the config does not use (layers a self-draft skips) are fine."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    bad = missing or mismatched
    if not bad:
        return
    kind = "missing from" if missing else "of the wrong shape in"
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    raise ModelLoadError(
        f"{what} {name!r}: {len(bad)} weights its config needs are {kind} the checkpoint ({bad[0]!r}{more}), so "
        "they would be random: point at the folder the model was saved in, or fix config.json to match its weights"
    )


def check_layers(name: str, layers: int, config: Any) -> None:
    """Refuse asking for more decoder layers than the checkpoint (its ``AutoConfig``) has: transformers
    would silently build the missing ones with random weights."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    have = getattr(config, "num_hidden_layers", None)
    if isinstance(have, int) and layers > have:
        raise ModelLoadError(
            f"model {name!r} has {have} decoder layers, so layers={layers} would add {layers - have} "
            f"randomly initialised ones: use layers between 1 and {have}"
        )
