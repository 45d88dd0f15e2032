"""treespec as a Hugging Face custom generation method (``treespec.hf``): lossless tree speculative
decoding behind ``model.generate(..., custom_generate=treespec.hf.CUSTOM_GENERATE, trust_remote_code=True)``."""

from treespec.hf import generate  # noqa: F401 - transformers loads `generate` from this file
