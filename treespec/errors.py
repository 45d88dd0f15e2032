"""Errors that reach users: one line that names the problem and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treespec.decoder import Output


class TreespecError(Exception):
    """A user-facing error. Its message is one line: what is wrong, and what to do."""


class ConfigError(TreespecError):
    """Bad options, an unknown plugin name, a budget out of range."""


class PluginError(TreespecError):
    """A plugin could not be registered (duplicate name) or loaded."""


class ModelLoadError(TreespecError):
    """A model or tokenizer could not be found or loaded."""


class DecodingError(TreespecError):
    """Decoding failed part-way. ``output`` holds everything generated before the failure; for a batch
    (``generate([...])``) ``outputs`` holds every prompt's output in order (finished, partial, or empty
    with ``stats.stop_reason == "not started"``) and ``output`` is the first. One prompt: ``[output]``."""

    def __init__(self, message: str, output: Output, outputs: list[Output] | None = None):
        super().__init__(message)
        self.output = output
        self.outputs = outputs if outputs is not None else [output]


class Interrupted(DecodingError):
    """Decoding was interrupted (Ctrl-C, ``KeyboardInterrupt``). ``output`` (``outputs`` for a batch)
    holds everything generated before it; an unfinished output has ``stats.stop_reason == "interrupted"``."""


class PromiseNote(UserWarning):
    """What treespec promises for this target, where it is less than (or other than) ``generate``'s
    output token for token (the CLI prints it as one ``note:`` line)."""


class GenerationConfigNote(PromiseNote):
    """The target's ``generation_config`` sets what changes ``generate``'s output (forced tokens,
    penalties, ...), which treespec's decoding does not apply."""


class TreespecWarning(UserWarning):
    """Something was ignored or redone, and the run goes on (the CLI prints it as one ``warning:`` line)."""
