"""Benchmarks that write ``results/``: ``python -m fractus.bench {cpu,aot,gpu} …``.

One module per kernel subject (``linear_attention``, ``moe``, ``cross_entropy``) and for
training throughput (``train``); ``levers`` (the optimization table), ``profile`` (time per
component), ``probes`` (generation and merge probes) and ``costmodel`` (analytic FLOPs, bytes
and ceilings) feed the notebooks; ``aot`` compiles every kernel for a GPU without one; ``gpu`` is
the GPU suite; ``report`` draws the notebooks' plots; :mod:`fractus.bench.common` holds the
smoke switch and the timing, memory and correctness-check helpers they share; their rows' provenance and CSVs come
from :mod:`fractus.records`.
"""
