"""Benchmark tooling (not the decoding core): prompt sets (``datasets``), the interleaved benchmark
runner behind ``treespec bench`` (``runner``) and the Markdown report (``report``)."""
