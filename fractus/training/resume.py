"""What ``--resume`` checks before it uses any of a checkpoint's training state.

A checkpoint of :mod:`fractus.training.loop` holds the model and its training state: optimizer,
scheduler, step, data position, every process's carried state, RNG, skip counters, the
fingerprint of the weights the run started from, the trainer's arguments, the process count, the
provenance of each training session and the identity of its data directory. A resume refuses,
with an error naming the entry, a state that is incomplete or not what the trainer writes
(:func:`check_training_state`), settings that would change the run (:func:`check_settings`:
:data:`RESUME_KEYS` with defaults resolved, the model's config, the process count, the corpus),
and a state that does not fit this run's model and optimizer (:func:`check_against_run`,
:func:`load_optimizer_state`). ``--tokens`` may change (it stretches the schedule), and so may the
device, the kernels' backend, and the logging, evaluation and checkpoint cadence.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from fractus.checkpoint import CheckpointError, describe
from fractus.model import FractusConfig
from fractus.training.optim import DECAY_FRACTION, DEFAULT_LR, default_lr

SAMPLING = ("streams", "windows")  # how the trainer reads the training split (fractus.data)

# Arguments that must match when resuming: those that shape the run. The model's config is
# compared as resolved (--set's overrides on the preset), except the backend.
RESUME_KEYS = ("model", "preset", "data", "batch_size", "chunk_len", "sampling", "accum", "optimizer", "seed", "lr",
               "weight_decay", "warmup", "min_lr_ratio", "lr_shape", "decay_fraction", "grad_clip", "lb_coef", "head_positions",
               "detach_kuramoto", "active_blocks", "bf16")


def run_settings(args: dict) -> dict:
    """The arguments that shape a run (RESUME_KEYS), defaults resolved: the data directory as an
    absolute path, the optimizer's default lr, the config's lb coefficient, bf16 on for CUDA."""
    d = {k: args.get(k) for k in RESUME_KEYS}
    d["model"] = d["model"] or "cte"  # a checkpoint that records no model kind holds the CTE
    d["data"] = str(Path(d["data"]).resolve())
    d["lr"] = default_lr(d["optimizer"], d["model"], d["preset"]) if d["lr"] is None else d["lr"]
    # a checkpoint that records no sampling read its split as the CTE's streams or the transformer's windows
    d["sampling"] = d["sampling"] or ("windows" if d["model"] == "transformer" else "streams")
    d["lb_coef"] = FractusConfig.lb_coef if d["lb_coef"] is None else d["lb_coef"]
    d["bf16"] = torch.device(args["device"]).type == "cuda" if d["bf16"] is None else d["bf16"]
    # a checkpoint from before the rate's shapes: a cosine of its own
    d["lr_shape"] = d["lr_shape"] or "cosine"
    d["decay_fraction"] = DECAY_FRACTION if d["decay_fraction"] is None else d["decay_fraction"]
    return d


def data_identity(meta: dict) -> dict:
    """What a checkpoint records of its data directory's meta.json, and a resume compares."""
    return {"vocab_size": meta["vocab_size"], "source": meta["source"], "encoding": meta.get("encoding"),
            "train_tokens": meta["train"]["tokens"], "val_tokens": meta["val"]["tokens"]}


def check_settings(ck: dict, settings: dict, cfg, meta: dict, world: int, path) -> None:
    """ValueError listing every difference between the run the checkpoint ``ck`` records and this
    one (``settings``: :func:`run_settings` of its arguments; ``cfg``: its model's config; ``meta``:
    its data directory's meta.json; ``world`` processes); CheckpointError if ``ck``'s config is not
    a valid one."""
    saved = run_settings(ck["args"])
    if not os.path.isabs(ck["args"]["data"]) and ck.get("meta"):
        # a path relative to a working directory the checkpoint does not record: the data's
        # identity (compared below) decides
        saved["data"] = settings["data"]
    diff = {k: (saved[k], settings[k]) for k in RESUME_KEYS if saved[k] != settings[k]}
    if "model" not in diff:  # the same kind of model: its configs compare
        now_cfg = cfg.to_dict()
        try:
            saved_cfg = type(cfg).from_saved({**ck["config"], "backend": cfg.backend}).to_dict()
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: its config is not a valid one ({e})") from None
        diff.update({f"config {k}": (v, now_cfg[k]) for k, v in saved_cfg.items() if v != now_cfg[k]})
    if ck.get("world", 1) != world:
        diff["processes"] = (ck.get("world", 1), world)
    now_data = data_identity(meta)  # the same path may hold another corpus since
    diff.update({f"data {k}": (v, now_data[k]) for k, v in ck.get("meta", {}).items() if now_data.get(k, v) != v})
    if diff:
        raise ValueError(f"--resume with different settings than the checkpoint: {diff}")


# -- a checkpoint's training state, checked before any of it is used --------------------------
def _int(v, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _device(v) -> bool:
    try:
        return isinstance(v, str) and torch.device(v).type in ("cpu", "cuda")
    except RuntimeError:
        return False


def _byte_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1


# What a checkpoint's training state holds (what :func:`fractus.training.loop.save` writes): name → (test,
# what it must be). The optional entries may be absent.
TRAINING_STATE = {
    "args": (lambda v: isinstance(v, dict), "a dict of the trainer's arguments"),
    "optimizer": (lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
                  and isinstance(v.get("param_groups"), list), "an optimizer's state_dict (state, param_groups)"),
    "scheduler": (lambda v: isinstance(v, dict) and _int(v.get("last_epoch"))
                  and isinstance(v.get("base_lrs"), list) and all(map(_real, v["base_lrs"]))
                  and isinstance(v.get("lr_lambdas"), list), "a LambdaLR's state_dict"),
    "step": (_int, "an integer ≥ 0"),
    "data_position": (_int, "an integer ≥ 0"),
    "elapsed_s": (lambda v: _real(v) and v >= 0, "a finite number ≥ 0"),
    "states": (lambda v: isinstance(v, list), "a list of every process's carried state"),
    "rng": (lambda v: isinstance(v, dict) and _byte_tensor(v.get("torch"))
            and v["torch"].shape == torch.get_rng_state().shape
            and (isinstance(v.get("cuda", []), list) and all(map(_byte_tensor, v.get("cuda", [])))),
            "RNG states: {'torch': torch.get_rng_state()'s uint8 tensor, 'cuda': a list of uint8 tensors}"),
    "counters": (lambda v: isinstance(v, dict) and _int(v.get("nan_run")) and _int(v.get("skipped")),
                 "{'nan_run': an integer ≥ 0, 'skipped': an integer ≥ 0}"),
    "ancestor": (lambda v: isinstance(v, str), "a weights fingerprint (str)"),
}
OPTIONAL_STATE = {
    "world": (lambda v: _int(v, 1), "an integer ≥ 1"),
    "sessions": (lambda v: isinstance(v, list) and all(isinstance(s, dict) and _int(s.get("from_step")) for s in v),
                 "a list of dicts with a from_step ≥ 0"),
    "meta": (lambda v: isinstance(v, dict) and all(isinstance(x, (str, int, float, type(None))) for x in v.values()),
             "a dict of plain values"),
}
# The trainer's arguments a checkpoint must record (``args``): those resumes compare, and what
# planned_steps and run_settings read.
SAVED_ARGS = {
    **{k: (lambda v: isinstance(v, str), "a str") for k in ("preset", "data", "head_positions")},
    **{k: (lambda v: _int(v, 1), "an integer ≥ 1") for k in ("tokens", "batch_size", "chunk_len", "accum")},
    "active_blocks": (_int, "an integer ≥ 0"),
    "warmup": (lambda v: v is None or _int(v), "None (5 % of the steps) or an integer ≥ 0"),
    **{k: (_real, "a finite number") for k in ("weight_decay", "min_lr_ratio", "grad_clip")},
    **{k: (lambda v: v is None or _real(v), "None or a finite number") for k in ("lr", "lb_coef")},
    "seed": (lambda v: _int(v, -2**63), "an integer"),
    "optimizer": (lambda v: v in DEFAULT_LR, f"one of {sorted(DEFAULT_LR)}"),
    "sampling": (lambda v: v is None or v in SAMPLING, f"None or one of {SAMPLING}"),
    "detach_kuramoto": (lambda v: isinstance(v, bool), "True or False"),
    "bf16": (lambda v: v is None or isinstance(v, bool), "None, True or False"),
    "device": (_device, "a device's name"),
}


def _shown(v) -> str:
    """A short description of a value for an error message."""
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    text = repr(v)
    return text if len(text) <= 80 else f"a {type(v).__name__} ({text[:60]}…)"


def check_training_state(ck: dict, path) -> None:
    """CheckpointError naming the first entry of ``ck``'s training state (:data:`TRAINING_STATE`,
    :data:`OPTIONAL_STATE`, the arguments of :data:`SAVED_ARGS`) that is missing or not what the
    trainer writes, and what it must be; a model-only checkpoint is named so."""
    lacking = [k for k in TRAINING_STATE if k not in ck]
    if len(lacking) == len(TRAINING_STATE):
        raise CheckpointError(f"{path} holds a model but no training state (no {', '.join(sorted(lacking))}): "
                              "start a new run from it with --grow-from")
    if lacking:
        raise CheckpointError(f"{path} lacks the training state's {', '.join(map(repr, lacking))}: it was not written "
                              "by fractus.train, or was edited")
    checks = [(repr(k), ck[k], *TRAINING_STATE[k]) for k in TRAINING_STATE]
    checks += [(repr(k), ck[k], *OPTIONAL_STATE[k]) for k in OPTIONAL_STATE if k in ck]
    checks += [(f"'args' entry {k!r}", ck["args"].get(k), *SAVED_ARGS[k]) for k in SAVED_ARGS
               if isinstance(ck["args"], dict)]
    for name, value, test, what in checks:
        if not test(value):
            raise CheckpointError(f"{path}: the training state's {name} must be {what}, got {_shown(value)}")


def check_against_run(ck: dict, world: int, model, opt: torch.optim.Optimizer, batch_size: int, path) -> None:
    """CheckpointError unless the training state ``ck`` fits this run (once its settings are known to
    be the checkpoint's): ``states`` holds the carried state of each of ``world`` processes, None (none
    yet) or per block the tensors of ``model``'s state for ``batch_size`` streams, so shaped (a
    model that carries no state: None); the scheduler is at the checkpoint's step with one entry per
    parameter group of ``opt``."""
    groups, sched = len(opt.param_groups), ck["scheduler"]
    if sched["last_epoch"] != ck["step"] or len(sched["base_lrs"]) != groups or len(sched["lr_lambdas"]) != groups:
        raise CheckpointError(f"{path}: the training state's 'scheduler' must be at step {ck['step']} with "
                              f"{groups} parameter groups, got {_shown(sched)}")
    states = ck["states"]
    if len(states) != world:
        raise CheckpointError(f"{path}: the training state's 'states' must hold the carried state of each of its "
                              f"{world} process(es), got {len(states)}")
    zero = model.init_state(batch_size, "meta")
    want = None if zero is None else [tuple(tuple(t.shape) for t in block) for block in zero]
    for rank, st in enumerate(states):
        ok = st is None or (want is not None and isinstance(st, list) and len(st) == len(want) and all(
            isinstance(block, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in block)
            and tuple(tuple(t.shape) for t in block) == shapes for block, shapes in zip(st, want)))
        if not ok:
            what = "None (this model carries no state)" if want is None else \
                f"None or one tuple of tensors per block shaped {want[0]}"
            raise CheckpointError(f"{path}: the training state's 'states' entry {rank} must be {what}, "
                                  f"got {_shown(st)}")


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict, path) -> None:
    """``opt.load_state_dict(saved)``; CheckpointError naming what does not fit ``opt``: its parameter
    groups, a group's numeric setting (lr, betas …), a parameter's state tensor of another shape."""
    def numeric(v) -> str | None:
        """What ``v`` is if it is a finite number or a sequence of them, else None."""
        if _real(v):
            return "a finite number"
        if isinstance(v, (tuple, list)) and v and all(map(_real, v)):
            return f"{len(v)} finite numbers"
        return None
    for key, st in saved["state"].items():  # torch would turn other values into garbage of their type
        if not isinstance(st, dict) or not all(v is None or _real(v) or torch.is_tensor(v) for v in st.values()):
            raise CheckpointError(f"{path}: the training state's 'optimizer' state of parameter {key!r} must be a "
                                  f"dict of tensors and numbers, got {_shown(st)}")
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    try:
        opt.load_state_dict(saved)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: the training state's 'optimizer' does not fit this run's optimizer "
                              f"({describe(e)})") from None
    for i, (old, group) in enumerate(zip(fresh, opt.param_groups)):
        for k, v in old.items():
            want = numeric(v)
            if want and numeric(group.get(k)) != want:
                raise CheckpointError(f"{path}: the training state's 'optimizer' parameter group {i}: {k} must be "
                                      f"{want}, got {_shown(group.get(k))}")
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() and v.shape != p.shape:
                raise CheckpointError(f"{path}: the training state's 'optimizer' holds for a parameter of shape "
                                      f"{tuple(p.shape)} a {k!r} that is {_shown(v)}")
