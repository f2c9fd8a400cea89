"""The research experiments the notebooks read: each trains models side by side, writes its rows
with provenance to ``results/``, and is read only once its learning curves have settled
(:mod:`fractus.experiments.convergence`). They build on :mod:`fractus.bench` (the training set-ups,
the timing helpers, the figures), which imports nothing of them."""
