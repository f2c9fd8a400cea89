"""Benchmarks that write ``results/``: ``python -m fractus.bench {cpu,aot,gpu} …``.

One module per kernel subject (``linear_attention``, ``moe``, ``cross_entropy``: inputs, baselines,
CPU and GPU timings, the GPU suite's correctness checks) and ``throughput`` (training tokens/s);
``optimizations`` (the optimization table), ``profile`` (time per component), ``probes`` (generation
and merge probes) and ``costmodel`` (analytic FLOPs, bytes and ceilings) feed the notebooks; ``gpu``
is the GPU suite, ``cases`` the inputs its stages share with the launches it precompiles; ``report``
draws the notebooks' plots; :mod:`fractus.bench.common` holds the smoke switch and the timing,
memory and correctness-check helpers they share. Their rows' provenance and CSVs come from
:mod:`fractus.records`. The ``aot`` command's table is :mod:`fractus.verify.aot`'s: the checks made
without a GPU live in :mod:`fractus.verify`.
"""
