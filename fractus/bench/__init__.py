"""Benchmarks that write ``results/``: ``python -m fractus.bench {cpu,costmodel,aot,gpu} …``.

One module per kernel subject (``linear_attention``, ``moe``, ``cross_entropy``: baselines, the
CPU and GPU timings declared as :class:`fractus.bench.harness.Bench` and run by
:func:`fractus.bench.harness.run` into rows of one schema, the GPU suite's correctness checks) and
``throughput`` (training tokens/s); ``setup`` (a training configuration as the benchmarks time it),
``optimizations`` (the optimization stack and its speed) and ``profile`` (time per component,
launch counts) measure training steps; ``costmodel`` (FLOPs, bytes and ceilings from the config,
and a GPU's step) and ``cpu_costmodel`` (the model on this CPU, fitted and checked) are the cost
model; ``gpu`` is the GPU suite; ``prepare`` times corpus preparation; ``report`` holds what the
notebooks share (results folders, figures with their provenance); :mod:`fractus.bench.common` holds
the smoke switch and the timing and memory helpers they share. Their rows' provenance and CSVs come
from :mod:`fractus.training.records`. The inputs the suite's stages run and the checks they make
live in :mod:`fractus.verify` (``cases``, ``checks``), which the ``aot`` command's table
(:mod:`fractus.verify.aot`) captures too: the checks made without a GPU. Nothing here imports
:mod:`fractus.experiments`, which builds on these modules.
"""
