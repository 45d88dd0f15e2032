"""An example treespec plugin: drafter ``bigram`` and builder ``best-first``.

Importing this package is light; the implementations (which import torch) are loaded by the
registry only when they are used. See ``docs/plugins.md`` in the treespec repository.
"""

__version__ = "0.1.0"
