"""Finding and loading models: aliases, local directories, hub ids and the offline cache."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from treespec import model_checks as checks
from treespec.catalog import MODEL_ALIASES, PACKAGED_MODELS, resolve_name
from treespec.devices import check_device, check_dtype, check_map_modules, device_placement, device_type
from treespec.errors import ConfigError, ModelLoadError, TreespecError
from treespec.hf_bars import progress_bars


def looks_like_model(name: str) -> bool:
    """Whether ``--drafter NAME`` should be read as a model: an alias, a directory, a GGUF file or ``org/model``."""
    from treespec.gguf import is_gguf_name

    if name in MODEL_ALIASES or name in PACKAGED_MODELS or is_gguf_name(name) or Path(name).expanduser().is_dir():
        return True
    return name.count("/") == 1 and not name.startswith((".", "/")) and not Path(name).exists()


def locate(name: str, what: str = "model") -> str:
    """A local directory, or a hub id (after alias resolution); a path that is no directory is an error.
    A GGUF name (``smollm2``, ``*.gguf``) becomes its converted folder (``treespec.gguf``)."""
    from treespec.gguf import converted, is_gguf_name

    if is_gguf_name(name):
        return str(converted(name))
    resolved = resolve_name(name)
    path = Path(resolved).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists() or resolved.startswith((".", "/", "~")) or resolved.count("/") > 1:
        if not path.exists():
            raise ModelLoadError(f"{what} {name!r}: {resolved} does not exist; pass a directory holding config.json")
        raise ModelLoadError(f"{what} {name!r}: {resolved} is not a directory; pass a directory holding config.json")
    return resolved


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")


@functools.lru_cache(maxsize=1)
def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the hub (HF_ENDPOINT), instead of huggingface_hub's minute of retries."""
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def is_cached(name: str) -> bool:
    """Whether a model needs nothing from the hub: treespec's own, a local directory, or a hub id whose
    config.json is in the local Hugging Face cache."""
    from treespec.gguf import is_gguf_name

    resolved = resolve_name(name)
    if Path(resolved).expanduser().is_dir() or name in PACKAGED_MODELS or is_gguf_name(name):
        return True  # local (a GGUF file converts locally, or says what to install)
    if resolved.count("/") != 1 or resolved.startswith((".", "/", "~")):
        return True  # not a hub id: loading it says what is wrong
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(resolved, "config.json")
    except Exception:  # noqa: BLE001 - an unusable cache is a cache without it
        return False
    return isinstance(found, str)


def require_cached(models: list[tuple[str, str]]) -> None:
    """Offline (HF_HUB_OFFLINE, or the hub out of reach), every hub model in ``models`` ((name, what)
    pairs) must be cached: otherwise ONE line names every missing model and how to download them all,
    before anything loads (rather than failing on the target, then on the draft after a download)."""
    missing = [(name, what) for name, what in models if not is_cached(name)]
    if not missing or not (_offline() or not _hub_reachable()):
        return
    why = "HF_HUB_OFFLINE is set" if _offline() else "the hub cannot be reached"
    names = " and ".join(
        f"{what} {name!r}" + (f" ({resolve_name(name)})" if resolve_name(name) != name else "")
        for name, what in missing
    )
    fetch = " && ".join(f"hf download {resolve_name(name)}" for name, _ in missing)
    raise ModelLoadError(
        f"{names} {'is' if len(missing) == 1 else 'are'} not in the local Hugging Face cache and "
        f"{why}: download {'it' if len(missing) == 1 else 'them'} first with `{fetch}`, or pass local paths"
    )


def _refuse_if_offline(name: str, resolved: str, what: str) -> None:
    """A model missing from the local cache while the hub is out of reach: one line, no retries."""
    if _offline() or not _hub_reachable():
        why = "HF_HUB_OFFLINE is set" if _offline() else "the hub cannot be reached"
        raise ModelLoadError(
            f"{what} {name!r} ({resolved}) is not in the local Hugging Face cache and {why}; "
            f"pass a local path, or download it first with `hf download {resolved}`"
        ) from None  # raised while handling the cache miss: that traceback says nothing more


def _download_error(name: str, resolved: str, what: str, exc: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"{what} {name!r} ({resolved}) could not be downloaded ({_first_line(exc)}); check the name, or pass a local path"
    )


def require_bool_consent(value: Any) -> bool:
    """``trust_remote_code`` runs a model's own code: only the literal ``True`` allows it. Anything but
    a bool (``"false"``, ``1``, ``None``) is one line of error rather than a truthy yes."""
    if not isinstance(value, bool):
        raise ConfigError(
            f"trust_remote_code must be True or False, got {value!r} ({type(value).__name__}): "
            "pass the literal True to let a model run its own code"
        )
    return value


def _trust_fix(what: str) -> str:
    if what.startswith("draft"):
        return (
            "give the drafter the option trust_remote_code=true (`treespec run -D trust_remote_code=true`, "
            "a bench drafter spec, or drafter_options in Python)"
        )
    return (
        "pass --trust-remote-code to `treespec run` (Python: trust_remote_code=True); bench, calibrate and "
        "train load only targets that need no code of their own"
    )


@contextlib.contextmanager
def quiet_transformers() -> Any:
    """transformers' own warnings and progress bars off while loading (and while a CLI command that
    calls ``generate()`` runs, ``cli.common.hf_errors_only``), the caller's settings back after:
    treespec reports what matters in one line (a refused custom-code model would otherwise print a
    stray config-type warning)."""
    import logging

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    placing = logging.getLogger("accelerate.big_modeling")  # "Some parameters are on the meta device ...":
    level = placing.level  # what a device map is for, not news
    placing.setLevel(logging.ERROR)
    try:
        with progress_bars(False):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        placing.setLevel(level)


def _load(loader: Any, name: str, what: str, **kwargs: Any) -> Any:
    resolved = locate(name, what)
    try:
        # Local directories and cached hub models load without touching the network.
        return loader.from_pretrained(resolved, local_files_only=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one line below
        if (
            kwargs.get("num_hidden_layers") is not None
        ):  # a model cut to k layers that fails to load: the cut is what failed
            raise ModelLoadError(
                f"{what} {name!r} cannot be cut to its first {kwargs['num_hidden_layers']} layer(s) "
                f"({type(exc).__name__}: {_first_line(exc)}): its architecture ties settings to every layer; "
                "draft with the whole model, more layers, or another draft"
            ) from None
        if "ignore_mismatched_sizes" in str(exc):
            raise ModelLoadError(
                f"{what} {name!r}: weights in {resolved} have other shapes than its config.json says; "
                "point at the folder the model was saved in, or fix config.json to match its weights"
            ) from None
        if _out_of_resources(exc):  # not the files' fault: say what ran out
            raise ModelLoadError(
                f"{what} {name!r}: this machine ran out of {_out_of_resources(exc)} while loading {resolved} "
                f"({type(exc).__name__}: {_first_line(exc)}); use fewer --threads, or free memory"
            ) from None
        if not isinstance(exc, (OSError, ValueError)) and Path(resolved).is_dir():
            raise ModelLoadError(
                f"{what} {name!r}: a file in {resolved} is damaged or incomplete ({type(exc).__name__}: {_first_line(exc)}); "
                "download or save it again"
            ) from None
        if not isinstance(exc, (OSError, ValueError)):
            raise
        if "custom code" in str(exc) and not kwargs.get("trust_remote_code"):
            raise ModelLoadError(
                f"{what} {name!r} ships its own Python code, which treespec runs only when allowed: if you trust "
                f"{resolved}, {_trust_fix(what)}"
            ) from None
        if Path(resolved).is_dir() or not isinstance(exc, OSError):
            raise ModelLoadError(f"{what} {name!r}: cannot load {resolved} ({_first_line(exc)})") from None
        _refuse_if_offline(name, resolved, what)
    try:
        return loader.from_pretrained(resolved, **kwargs)
    except (OSError, ValueError) as exc:
        raise _download_error(name, resolved, what, exc) from None


def snapshot_dir(name: str, patterns: list[str], what: str = "model") -> Path:
    """A folder holding a repository's files: a local directory, else the hub id's snapshot in the
    Hugging Face cache, else (online only) downloaded. For non-``transformers`` files (EAGLE heads)."""
    resolved = locate(name, what)
    if Path(resolved).is_dir():
        return Path(resolved)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(resolved, allow_patterns=patterns, local_files_only=True))
    except Exception:
        _refuse_if_offline(name, resolved, what)
    try:
        return Path(snapshot_download(resolved, allow_patterns=patterns))
    except Exception as exc:
        raise _download_error(name, resolved, what, exc) from None


def _folder(name: str, what: str) -> Path | None:
    """The local folder of a model (for the checks before loading), or None: an unresolvable name is
    left to the loader, which says what is wrong in its words."""
    try:
        return Path(locate(name, what))
    except TreespecError:
        return None


def _out_of_resources(exc: BaseException) -> str:
    """ "memory" or "threads" when ``exc`` says the machine ran out of it (not a damaged file), else ""."""
    text = str(exc).lower()
    if (
        isinstance(exc, MemoryError)
        or "can't allocate memory" in text
        or "cannot allocate memory" in text
        or "out of memory" in text
    ):
        return "memory"
    if "can't start new thread" in text or "resource temporarily unavailable" in text:
        return "threads"
    return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def load_causal_lm(
    name: str,
    device: Any = None,
    dtype: Any = None,
    num_hidden_layers: int | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    what: str = "model",
    device_map: Any = None,
    max_memory: Any = None,
    offload_folder: Any = None,
) -> Any:
    """``AutoModelForCausalLM`` by alias, local path or hub id; float32 by default on CPU.

    ``num_hidden_layers=k`` keeps only the first k decoder layers (a self-draft made of the target's
    own first layers); the skipped layers' weights are ignored quietly. ``device_map`` (``auto``,
    ``balanced``, ``sequential``, a dict or a JSON file of module -> device), ``max_memory`` (a dict
    or ``"0=20GiB,cpu=60GiB"``) and ``offload_folder`` split the model across devices or offload it to
    disk through accelerate (``treespec[accelerate]``); see ``device_placement``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    device, dtype = check_device(device), check_dtype(dtype)

    kwargs: dict[str, Any] = {"trust_remote_code": require_bool_consent(trust_remote_code)}
    kwargs.update(device_placement(device_map, max_memory, offload_folder, device))
    if num_hidden_layers is not None:
        from transformers import AutoConfig

        checks.check_layers(
            name, num_hidden_layers, _load(AutoConfig, name, "model", trust_remote_code=trust_remote_code)
        )
        kwargs["num_hidden_layers"] = num_hidden_layers
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    kwargs["dtype"] = dtype if dtype is not None else (torch.float32 if device_type(device) == "cpu" else "auto")
    if "device_map" not in kwargs:  # a device map may offload: accelerate places what fits
        checks.check_size(name, what, num_hidden_layers, kwargs["dtype"], _folder(name, what))
    with quiet_transformers():  # transformers' load report is hidden, so its verdict is checked here
        model, info = _load(AutoModelForCausalLM, name, what, output_loading_info=True, **kwargs)
    checks.check_loaded(name, what, info)
    check_map_modules(kwargs.get("device_map"), model)
    if device is not None and "device_map" not in kwargs:
        model = model.to(device)
    return model.eval()


def load_tokenizer(name: str, trust_remote_code: bool = False, what: str = "tokenizer") -> Any:
    from transformers import AutoTokenizer

    with quiet_transformers():
        return _load(AutoTokenizer, name, what, trust_remote_code=require_bool_consent(trust_remote_code))


def check_same_tokenizer(target_tok: Any, draft_tok: Any, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose vocabulary (token → id) differs from the target's."""
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a == b:
        return
    differ = sum(1 for t, i in a.items() if b.get(t) != i) + sum(1 for t in b if t not in a)
    raise ModelLoadError(
        f"drafter {draft_name!r} does not share the tokenizer of target {target_name!r} "
        f"({len(b)} vs {len(a)} tokens, {differ} differ); pick a draft from the target's model family"
    )
