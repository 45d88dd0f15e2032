"""What the drafters that run a network of their own on the target's hidden states share (``eagle``,
``eagle3``, ``block``): the network (their ``head``) loaded for the target's hidden size and vocabulary
and placed on its device and dtype, and the target's hidden states that every prefill and commit
must carry (``Drafter.needs_target_hidden``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from treespec.interfaces import Commit, Drafter, PrefillContext
from treespec.plugins.eagle_head import drafter_dims

if TYPE_CHECKING:
    import torch

    from treespec.target import TargetModel


class HeadDrafter(Drafter):
    """A drafter whose head reads the target's features."""

    needs_target_hidden = True
    provides_probabilities = True
    #: the drafter's name where a prefill or commit comes without the target's hidden states
    drafter: ClassVar[str] = "head"

    def load(self, target: TargetModel, name: str, loader: Callable[..., tuple[Any, Any]]) -> Any:
        """Set ``head`` to ``loader(name, hidden, vocab, target_name)`` for the target's sizes, on the target's
        device and dtype (``device``, ``dtype``; ``vocab``: the target's vocabulary as ``drafter_dims``
        counts it); returns what the loader gives with the head (its metadata)."""
        hidden, self.vocab = drafter_dims(target)
        self.head, meta = loader(name, hidden, self.vocab, f"target {target.name!r}")
        self.device, self.dtype = target.device, target.dtype
        self.head.to(device=self.device, dtype=self.dtype)
        return meta

    def target_hidden(self, context: PrefillContext | Commit) -> torch.Tensor:
        """The target's hidden states ``context`` carries: one line if the Decoder passed none."""
        if context.hidden is None:
            what = "PrefillContext" if isinstance(context, PrefillContext) else "Commit"
            raise ValueError(f"drafter {self.drafter!r} needs the target's hidden states ({what}.hidden)")
        return context.hidden
