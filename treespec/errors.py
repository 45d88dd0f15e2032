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
    """Decoding failed part-way. ``output`` holds everything generated before the failure."""

    def __init__(self, message: str, output: "Output"):
        super().__init__(message)
        self.output = output


class Interrupted(DecodingError):
    """Decoding was interrupted (Ctrl-C, ``KeyboardInterrupt``). ``output`` holds everything
    generated before it, with ``stats.stop_reason == "interrupted"``."""


class TreespecWarning(UserWarning):
    """Something was ignored or redone, and the run goes on (the CLI prints it as one ``warning:`` line)."""
