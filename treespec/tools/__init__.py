"""Inspection tooling (not the decoding core): rendering one draft tree (``render``) for
``treespec tree show``."""
