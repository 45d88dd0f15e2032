"""What every drafter trainer's settings share (``train eagle`` versions 1 and 3, ``train block``): the
data they train on, and the key that says whether a saved ``data.pt`` was made from the same data
(``eagle_data.training_data`` reuses it only then). Importable without torch: the CLI's ``--help``
reads the defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class DataSettings:
    target: str
    data: str
    out: str
    offset: int = 0  # skip the dataset's first prompts (keep benchmark prompts out of training)
    limit: int = 2000  # prompts used (train + held out)
    holdout: float = 0.1  # fraction of prompts held out for the agreement summary
    max_new_tokens: int = 128  # length of the target's continuation per prompt
    answers: str | None = None  # an earlier run's data.pt whose continuations to reuse (features computed anew)
    gen_batch_size: int | None = None  # prompts per batch while the target generates [default: batch_size]
    #: where the target runs and the drafter trains (cpu, cuda, cuda:N, mps); None: the loader's default, cpu.
    #: The saved data and the checkpoint are device-free: a run may resume on another device.
    device: str | None = None
    #: the layout of ``data.pt`` (1: EAGLE-1's last hidden state; 3: EAGLE-3's fused layers as well)
    data_version: ClassVar[int] = 1

    def data_key(self) -> dict[str, Any]:
        """What the saved data depends on: a ``data.pt`` with another key is generated anew."""
        return {
            "v": self.data_version,
            "target": self.target,
            "data": self.data,
            "offset": self.offset,
            "limit": self.limit,
            "max_new_tokens": self.max_new_tokens,
        }
