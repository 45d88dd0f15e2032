"""treespec's built-in plugins, installed as ``treespec.plugins`` and registered through the
``treespec`` entry-point group (``builtin = "treespec.plugins.builtin"``), like any third-party plugin."""
