"""The settings of `treespec train block` (``block_train.py``), importable without torch (the CLI's
``--help`` reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from treespec.plugins.train_settings import DataSettings


@dataclass(frozen=True)
class BlockSettings(DataSettings):
    epochs: int = 10
    batch_size: int = 8
    lr: float = 1e-3
    block_size: int = 7  # K draft positions
    layers: int = 1  # decoder layers in the drafter
    anchors: int = 32  # blocks per sequence per batch
    gamma: float | None = None  # depth decay of the loss weights [default: K / 2]
    draft_vocab: int | None = None  # default: the whole vocabulary up to 32,000 ids
    max_len: int = 2048
    save_dtype: str = "float32"
    seed: int = 0
    last_feature: bool = False  # add the newest context row to every block row (BlockSpec.last_feature)
    feature_layers: tuple[int, ...] = ()  # the target's hidden_states indices fused [default: EAGLE-3's three]
    init: str | None = None  # start from this block drafter (its layers, feature layers, draft vocabulary): fine-tune

    data_version: ClassVar[int] = 3  # EAGLE-3's data (``eagle_data.py``): the same files serve both

    def data_key(self) -> dict[str, Any]:
        return super().data_key() | {"layers": list(self.feature_layers)}
