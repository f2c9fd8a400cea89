"""The training core, below its command line (``python -m fractus.train``, which nothing imports).

From the top: :mod:`.command` runs a schedule of runs (:mod:`.schedule`: growth stage by stage)
or one run (:mod:`.loop`: set-up, the loop, checkpoints, final validation), with the options of
:mod:`.options`. Below the loop: a step's parts (:mod:`.steps`), the optimizer and its schedule
(:mod:`.optim`), held-out evaluation (:mod:`.evaluation`), how a run stops short (:mod:`.stopping`),
what resuming checks (:mod:`.resume`), a run's folder (:mod:`.runs`), results records with their
provenance (:mod:`.records`), several processes (:mod:`.ddp`), and loading either model from a
checkpoint (:mod:`.registry`).

Beside the core, flat in :mod:`fractus` because modules below it use them too:
:mod:`fractus.checkpoint` (checkpoints written atomically and loaded safely; the models save and
load through it), :mod:`fractus.atomic` (atomic file writes) and :mod:`fractus.allocator` (glibc's
malloc settings for CPU training; the benchmarks set them too). The commands around the core are
flat too: :mod:`fractus.grow` and :mod:`fractus.merge` (growing and merging checkpoints),
:mod:`fractus.evaluate` and :mod:`fractus.sample` (reading a checkpoint) and :mod:`fractus.vision`
(the digit-image trainer, which shares the steps, the optimizer and the stopping rules).
"""
