"""Merge checkpoints by averaging their parameters (the original's "unified merge").

``python -m fractus.merge A.pt B.pt … -o M.pt`` writes a checkpoint whose every parameter is
the mean of the inputs'. The inputs must share the architecture and the vocabulary (refused
otherwise, naming the differences) and their buffers (expert phases) must agree. Keys saved
from ``torch.compile`` models are accepted. The result holds only the config and the weights:
no optimizer, schedule, data position or carried recurrent state — start training from it with
``python -m fractus.train --grow-from M.pt …`` (same preset: a plain copy, fresh optimizer).

Averaging only makes sense for models that share an ancestor (runs started from the same
weights: one checkpoint, e.g. shards trained with ``--grow-from BASE.pt`` on different data, or
one seed): independently initialised models are not aligned, and their mean is not a model. So
every input must record its ``ancestor``, the fingerprint of the weights its run started from
(:func:`fractus.checkpoint.weights_fingerprint`; the trainer writes it), and all must agree; the
merge keeps it. The CLI prints each input's relative distance to the mean. The output may not be
one of the inputs, nor an existing file unless ``--force`` is given; a mean with a NaN or an
infinity is refused.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from fractus.checkpoint import (
    CheckpointError,
    check_finite,
    check_model_state,
    load_checkpoint,
    save_checkpoint,
)
from fractus.cli import run_command
from fractus.model import TRAINING_KEYS, FractusConfig, FractusCTE

# Saved config keys that only steer training or the kernels; checkpoints may differ in them.
RUN_FIELDS = ("backend", "lb_coef", "detach_kuramoto", "fused_ce", *TRAINING_KEYS)


def merge(paths: list[str | Path], out: str | Path | None = None,
          force: bool = False) -> tuple[dict, list[float]]:
    """Mean of the checkpoints' parameters → (checkpoint dict {config, model, ancestor, merged_from},
    each input's :func:`distance_to_mean`); the checkpoint is written atomically to ``out`` when
    given. Raises CheckpointError when the inputs differ, the mean is not finite, or ``out`` is one
    of them or (unless ``force``) exists."""
    if len(paths) < 2:
        raise CheckpointError(f"merge needs at least two checkpoints, got {len(paths)}")
    if out is not None and os.path.exists(out):
        for path in paths:
            if os.path.exists(path) and os.path.samefile(path, out):
                raise CheckpointError(f"refusing to write the merge to {out}: it is the input {path}")
        if not force and os.path.isfile(out):
            raise CheckpointError(f"refusing to write the merge to {out}: the file exists (--force replaces it)")
    acc, first_cfg, ancestor = {}, None, None
    for path in paths:
        ck = load_checkpoint(path)
        if "ancestor" not in ck:
            raise CheckpointError(f"{path} does not record the weights its run started from ('ancestor'): "
                                  "merge only checkpoints written by `python -m fractus.train` (or saved "
                                  "with ancestor=weights_fingerprint(starting weights))")
        if ancestor is not None and ck["ancestor"] != ancestor:
            raise CheckpointError(f"cannot merge {paths[0]} and {path}: they started from different weights "
                                  f"(ancestor {ancestor} vs {ck['ancestor']}); independently initialised "
                                  "models are not aligned, and their mean is not a model")
        ancestor = ck["ancestor"]
        if first_cfg is None:
            first_cfg = ck["config"]
            try:
                cfg = FractusConfig.from_saved(first_cfg)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: invalid config ({e})") from None
            with torch.device("meta"):
                ref = FractusCTE(cfg)
            params = {n for n, _ in ref.named_parameters()}
        keys = sorted((set(first_cfg) | set(ck["config"])) - set(RUN_FIELDS))
        diff = {k: (first_cfg.get(k), ck["config"].get(k)) for k in keys
                if first_cfg.get(k) != ck["config"].get(k)}
        if diff:
            what = "vocabularies" if "vocab_size" in diff else "configs"
            raise CheckpointError(f"cannot merge {paths[0]} and {path}: different {what}: "
                                  + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in diff.items()))
        state = check_model_state(ref, ck["model"], path)
        for k, v in state.items():
            if k not in params:  # buffers (expert phases) must agree
                if k in acc and not torch.equal(acc[k], v):
                    raise CheckpointError(f"cannot merge {paths[0]} and {path}: buffer {k} differs "
                                          "(e.g. the expert phases of a grown model)")
                acc.setdefault(k, v)
            elif k in acc:
                acc[k] += v.double()
            else:
                acc[k] = v.to(torch.float64, copy=True)
    model = {k: (v / len(paths)).float() if k in params else v for k, v in acc.items()}
    check_finite(model, "the merge")
    merged = {"config": first_cfg, "model": model, "ancestor": ancestor, "merged_from": [str(p) for p in paths]}
    # a second read of each input: one model in memory at a time (1b shards are 4 GB each)
    distances = [distance_to_mean(check_model_state(ref, load_checkpoint(p)["model"], p), model) for p in paths]
    if out is not None:
        save_checkpoint(out, merged)
    return merged, distances


def distance_to_mean(state: dict, mean: dict) -> float:
    """‖θ − θ̄‖ / ‖θ̄‖ over all floating tensors of the state dicts ``state`` and ``mean``."""
    num = den = 0.0
    for k, m in mean.items():
        if m.is_floating_point() and k in state:
            num += float((state[k].double() - m.double()).pow(2).sum())
            den += float(m.double().pow(2).sum())
    return (num / max(den, 1e-30)) ** 0.5


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.merge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="two or more checkpoints of the same architecture")
    ap.add_argument("-o", "--out", required=True, help="merged checkpoint to write")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = ap.parse_args(argv)

    def body():
        _, distances = merge(a.checkpoints, a.out, a.force)
        for p, d in zip(a.checkpoints, distances):
            print(f"{p}: relative distance to the mean {d:.4f}")
        print(f"wrote {a.out}: mean of {len(a.checkpoints)} checkpoints (no optimizer or recurrent state)")
    run_command(body)


if __name__ == "__main__":
    main()
