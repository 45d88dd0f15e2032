"""Where a model lives and in what precision: devices, dtypes, and accelerate device maps (layers
split across devices or offloaded to disk), each checked before anything loads, in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treespec.errors import ConfigError, PromiseNote
from treespec.files import read_json


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says: benchmarks record it,
    and measured kernel choices are keyed by it (``treespec.row_matmul``)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def device_placement(device_map: Any, max_memory: Any, offload_folder: Any, device: Any = None) -> dict[str, Any]:
    """``from_pretrained`` arguments that place a model across devices or on disk (accelerate), from
    what a user types: a device_map name or JSON file, ``max_memory`` as ``"0=20GiB,cpu=60GiB"``, an
    offload folder. Empty if none is given; one line of error for anything wrong."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise ConfigError("--max-memory and --offload-folder go with --device-map (e.g. --device-map auto)")
        return {}
    if device is not None:
        raise ConfigError("give --device or --device-map, not both (a device map places every module itself)")
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            "--device-map needs accelerate: pip install 'treespec[accelerate]' (or pip install accelerate)"
        )
    out: dict[str, Any] = {"device_map": _device_map(device_map)}
    check_map_devices(out["device_map"])
    if max_memory is not None:
        out["max_memory"] = _max_memory(max_memory)
    if offload_folder is not None:
        folder = Path(offload_folder)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--offload-folder {folder} is a file: give a directory (it is created if missing)")
        folder.mkdir(parents=True, exist_ok=True)
        out["offload_folder"] = str(folder)
        out["offload_state_dict"] = True
    return out


def _device_map(value: Any) -> Any:
    if isinstance(value, dict) or value in DEVICE_MAPS:
        return value
    path = Path(str(value))
    if not path.is_file():
        raise ConfigError(f"--device-map {value!r}: use {', '.join(DEVICE_MAPS)} or a JSON file of module -> device")
    fix = 'give a JSON object of module name -> device ("cpu", 0, "disk", ...)'
    mapping = read_json(path, "--device-map", fix)
    if not mapping:
        raise ConfigError(f"--device-map {path} is an empty object; {fix}")
    return mapping


def check_map_devices(mapping: Any) -> None:
    """Every device a device map names exists here: a GPU on a machine without one is this line, not
    "the files are damaged" from deep inside the load (issue 29)."""
    if not isinstance(mapping, dict):
        return
    for module, where in mapping.items():
        if where in ("cpu", "disk", "meta"):
            continue
        device = f"cuda:{where}" if isinstance(where, int) and not isinstance(where, bool) else where
        if where == "gpu":
            device = "cuda"
        try:
            check_device(device)
        except ConfigError as exc:
            raise ConfigError(f"--device-map puts {module or 'the model'!r} on {where!r}: {exc}") from None


def check_map_modules(mapping: Any, model: Any) -> None:
    """Every module a device map names is one of the model's: a misspelt name was silently ignored."""
    if not isinstance(mapping, dict):
        return
    names = {name for name, _ in model.named_modules()}
    unknown = sorted(k for k in mapping if k and k not in names)
    if unknown:
        top = sorted(n for n in names if n and n.count(".") <= 1)[:6]
        raise ConfigError(
            f"--device-map names module(s) {', '.join(map(repr, unknown[:4]))} that the model does not have; "
            f"its modules are named like {', '.join(top)}"
        )


def _max_memory(value: Any) -> dict[Any, str]:
    if isinstance(value, dict):
        return value
    out: dict[Any, str] = {}
    for part in str(value).split(","):
        key, sep, amount = part.partition("=")
        if not sep or not key.strip() or not amount.strip():
            raise ConfigError(f"--max-memory {value!r}: use DEVICE=AMOUNT pairs, e.g. 0=20GiB,cpu=60GiB")
        key = key.strip()
        out[int(key) if key.isdigit() else key] = amount.strip()
    return out


DTYPES = ("float32", "float64", "float16", "bfloat16")


def check_dtype(dtype: Any) -> Any:
    """A torch dtype from ``dtype`` (a name, ``auto``/None for the default, or a torch.dtype)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use {', '.join(DTYPES)} or auto")
    return getattr(torch, dtype)


def check_device(device: Any) -> Any:
    """``device`` as given, once torch can parse it and it exists on this machine."""
    import torch

    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"unknown device {device!r}: use cpu, cuda, cuda:N or mps ({first_line(exc)[:60]}...)"
        ) from None
    if parsed.type == "meta":  # shapes without values: decoding failed on the first .item()
        raise ConfigError(
            f"device {device!r} holds tensor shapes but no values, so it cannot run a model: use cpu, "
            "cuda, cuda:N or mps"
        )
    if parsed.type not in ("cpu", "cuda", "mps"):  # xpu, npu, ...: only with their backend and a device present
        available = getattr(getattr(torch, parsed.type, None), "is_available", None)
        if not (callable(available) and available()):
            raise ConfigError(f"device {device!r} is not available on this machine; use --device cpu")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(
            f"device {device!r} is not available: {why}; use --device cpu (or install a CUDA build of torch)"
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} is not available: {torch.cuda.device_count()} CUDA device(s) visible")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} is not available on this machine; use --device cpu")
    return device


def device_type(device: Any) -> str:
    if device is None:
        return "cpu"
    return str(device).split(":")[0]


class InexactDtypeWarning(PromiseNote):
    """The target's dtype rounds so coarsely that a tree forward can flip a near-tied argmax (bfloat16, float16)."""


def dtype_note(dtype: Any) -> str | None:
    """What treespec promises in ``dtype``, when it is less than token-for-token equality (docs/reliability.md).

    Verifying a tree computes the target's logits for N tokens in one forward; ``generate`` computes
    them one token at a time. The two sum the same products in different orders (other matmul
    blockings, a longer attention row), so their logits differ in the last bits. In float32 that never
    flipped a greedy argmax in our probes. float16 keeps 11 bits of mantissa and bfloat16 8: logits one
    step of the dtype apart are ties either side may win (float16 flipped one on an Intel Xeon with
    AVX-512 where an AMD EPYC did not; bfloat16 often)."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16):
        return None
    name = str(dtype).removeprefix("torch.")
    return (
        f"{name}: every token is the target's argmax in the tree forward, but its rounding differs from "
        "generate()'s one-token forwards, so near-tied tokens can differ from generate(do_sample=False); "
        "use --dtype float32 for token-for-token equality"
    )
