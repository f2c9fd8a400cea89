"""The training core: the loop, its optimiser and evaluation (:mod:`.loop`), a run's folder and
record (:mod:`.runs`, :mod:`.records`), what resuming checks (:mod:`.resume`), several processes
(:mod:`.ddp`), growth stage by stage (:mod:`.schedule`) and loading either model from a checkpoint
(:mod:`.registry`). ``python -m fractus.train`` is its command line; nothing imports that."""
