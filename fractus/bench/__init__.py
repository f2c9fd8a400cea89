"""Benchmarks that write ``results/``: ``python -m fractus.bench {cpu,gpu} …``.

One module per subject (``linear_attention``, ``moe``, ``cross_entropy``, ``train``);
:mod:`fractus.bench.common` holds provenance, timing and memory helpers they share.
"""
