"""Benchmarks that write ``results/``: ``python -m fractus.bench {cpu,costmodel,aot,gpu} …``.

One module per kernel subject (``linear_attention``, ``moe``, ``cross_entropy``: baselines, CPU and
GPU timings, the GPU suite's correctness checks) and ``throughput`` (training tokens/s);
``optimizations`` (the optimization table), ``profile`` (time per component) and ``probes``
(generation and merge probes) feed the notebooks; ``costmodel`` (FLOPs, bytes and ceilings from the
config, and a GPU's step) and ``cpu_costmodel`` (the model on this CPU, fitted and checked) are the
cost model; ``gpu`` is the GPU suite; ``report`` draws the notebooks' plots;
:mod:`fractus.bench.common` holds the smoke switch and the timing and memory helpers they share.
Their rows' provenance and CSVs come from :mod:`fractus.training.records`. The inputs the suite's stages run
and the checks they make live in :mod:`fractus.verify` (``cases``, ``checks``), which the ``aot``
command's table (:mod:`fractus.verify.aot`) captures too: the checks made without a GPU.
"""
