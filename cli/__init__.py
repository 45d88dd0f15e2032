"""The `treespec` command line (installed as ``treespec.cli``)."""
