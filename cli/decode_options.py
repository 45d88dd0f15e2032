"""The options the commands that load a target and a drafter share (`run`, `bench`, `profile`,
`tree show`, `export measure`), declared once (typer reads each parameter's ``Annotated`` type): the
builder's and the drafter's options, where and how the target loads, torch's threads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

B_OPTION_HELP = (
    "builder option name=value, repeatable or comma-separated (e.g. -B nodes=25 -B threshold=0.3). "
    "`treespec plugins` lists every option."
)
D_OPTION_HELP = (
    "drafter option name=value, repeatable or comma-separated (e.g. -D layers=4, -D head=DIR, "
    "-D ngram.max_ngram=4 for a part of a+b). `treespec plugins` lists every option."
)
DEVICE_HELP = "cpu, cuda, cuda:1, mps ... (default: cpu)"
DEVICE_MAP_HELP = (
    "split the target across devices or offload it (accelerate): auto, balanced, sequential, or a "
    'JSON file of module -> device ("cpu", 0, "disk")'
)
MAX_MEMORY_HELP = "with --device-map: memory per device, e.g. 0=20GiB,cpu=60GiB"
OFFLOAD_HELP = "with --device-map: the folder for weights offloaded to disk"
DTYPE_HELP = "float32, bfloat16, float16, float64 (default: float32 on CPU)"
THREADS_HELP = "CPU threads for torch [default: torch's]"

BuilderOptions = Annotated[Optional[list[str]], typer.Option("--builder-option", "-B", help=B_OPTION_HELP)]
DrafterOptions = Annotated[Optional[list[str]], typer.Option("--drafter-option", "-D", help=D_OPTION_HELP)]
Device = Annotated[Optional[str], typer.Option(help=DEVICE_HELP)]
Dtype = Annotated[Optional[str], typer.Option(help=DTYPE_HELP)]
DeviceMap = Annotated[Optional[str], typer.Option(help=DEVICE_MAP_HELP, show_default=False)]
MaxMemory = Annotated[Optional[str], typer.Option(help=MAX_MEMORY_HELP, show_default=False)]
OffloadFolder = Annotated[Optional[Path], typer.Option(help=OFFLOAD_HELP, show_default=False)]
Threads = Annotated[Optional[int], typer.Option(help=THREADS_HELP, show_default=False)]
