"""The models the trainer builds and every tool loads, by kind: "cte" (:class:`fractus.model.FractusCTE`)
and "transformer" (the Transformer++ baseline, :class:`fractus.baseline.Transformer`). A checkpoint records its kind as
``arch`` (absent: "cte")."""
from __future__ import annotations

import torch.nn as nn

from fractus.baseline import Transformer, TransformerConfig
from fractus.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from fractus.model import FractusConfig, FractusCTE

MODELS = {"cte": (FractusCTE, FractusConfig), "transformer": (Transformer, TransformerConfig)}


def load_model(path, backend: str | None = None) -> nn.Module:
    """The model of a checkpoint of either kind, on the CPU (``.to(device)`` moves it); ``backend``
    replaces the kernels' backend it was saved with."""
    ckpt = load_checkpoint(path)
    arch = ckpt.get("arch", "cte")
    if not isinstance(arch, str) or arch not in MODELS:
        raise CheckpointError(f"{path}: unknown model kind 'arch' {arch!r}; expected one of {sorted(MODELS)}")
    return model_from_checkpoint(ckpt, path, *MODELS[arch], backend)
