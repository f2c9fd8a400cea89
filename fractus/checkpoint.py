"""Checkpoints: atomic writes, loads that never execute code, clear errors on mismatch.

A checkpoint is a dict of tensors and plain Python values written with ``torch.save`` and
read back with ``torch.load(weights_only=True)``, so a crafted pickle cannot run code. The
CRC-32 of every member of ``torch.save``'s zip archive is checked first, so damaged bytes are
reported rather than loaded; a file that is no zip archive is not read at all.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import zipfile
from pathlib import Path

import torch

from fractus.atomic import atomic_open


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (truncated, unsafe, or for another model)."""


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (:func:`fractus.atomic.atomic_open`)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"cannot write checkpoint {path}: it is a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        torch.save(payload, f)


def verify_zip(path: Path) -> None:
    """Raise ``zipfile.BadZipFile`` unless every member of the zip archive ``path`` passes its
    CRC-32 check."""
    with zipfile.ZipFile(path) as z:
        bad = z.testzip()
    if bad is not None:
        raise zipfile.BadZipFile(f"member {bad} fails its CRC-32 or header check")


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint onto the CPU with ``weights_only=True``; raise :class:`CheckpointError` on any defect."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a file")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    with open(path, "rb") as f:  # torch.save's zip archive starts with a member; torch.load would
        is_zip = f.read(4) == b"PK\x03\x04"  # unpickle anything else (a legacy checkpoint, a plain pickle)
    if not is_zip:
        raise CheckpointError(f"refusing to load {path}: the file is damaged, truncated or not a checkpoint "
                              "(not a zip archive written by torch.save)")
    try:
        verify_zip(path)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and "
                              f"plain values, which could run code ({describe(e)})") from None
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: the file is damaged, truncated or not a "
                              f"checkpoint ({describe(e)})") from None
    if not isinstance(ckpt, dict) or "config" not in ckpt or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a Fractus checkpoint (no 'config'/'model' entries)")
    model = ckpt["model"]
    if (not isinstance(ckpt["config"], dict) or not isinstance(model, dict)
            or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())):
        raise CheckpointError(f"{path} is not a Fractus checkpoint: 'config' must be a dict and 'model' a dict "
                              f"of named tensors")
    return ckpt


def describe(e: Exception) -> str:
    """An exception's type and the first line of its message (torch's can run to many) that is not
    torch's advice on ``weights_only`` (never to be followed here)."""
    line = next((s for s in str(e).splitlines() if s.strip() and "weights_only" not in s), "")
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def strip_compile_prefix(state: dict) -> dict:
    """Keys saved from ``torch.compile`` models carry ``_orig_mod.``; remove it."""
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def check_model_state(model: torch.nn.Module, state: dict, source="checkpoint") -> dict:
    """``state`` without compile prefixes; CheckpointError naming every missing, unexpected or
    mis-shaped tensor unless it fits ``model`` (which may live on the meta device)."""
    state = strip_compile_prefix(state)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    shapes += [f"{k}: {state[k].dtype} vs model {own[k].dtype}" for k in own if k in state
               and own[k].is_floating_point() and not (torch.is_tensor(state[k]) and state[k].is_floating_point())]
    if missing or unexpected or shapes:
        msg = [f"{source} does not match this model's config:"]
        if missing:
            msg.append(f"missing {len(missing)} tensors, e.g. {missing[:3]}")
        if unexpected:
            msg.append(f"unexpected {len(unexpected)} tensors, e.g. {unexpected[:3]}")
        if shapes:
            msg.append(f"{len(shapes)} shape or type mismatches, e.g. {shapes[:3]}")
        raise CheckpointError("; ".join(msg))
    return state


def check_finite(state: dict, source="checkpoint") -> None:
    """CheckpointError naming the tensors of ``state`` that hold a NaN or an infinity."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{source} holds non-finite values (NaN or inf) in {len(bad)} tensors, "
                              f"e.g. {bad[:3]}")


def parameter_count(model_cls, cfg) -> int:
    """The parameters of ``model_cls(cfg)``, counted on the meta device from one and two blocks
    (nothing allocated, whatever the size)."""
    with torch.device("meta"):
        one = model_cls(dataclasses.replace(cfg, n_layers=1)).num_params()
        two = model_cls(dataclasses.replace(cfg, n_layers=2)).num_params()
    return one + (cfg.n_layers - 1) * (two - one)


def available_bytes(device="cpu") -> int:
    """Memory a new tensor may take: the GPU's free memory, or the host's available memory
    (``MemAvailable`` of /proc/meminfo; physical memory where that is absent)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(model_cls, cfg, what: str = "the model", device="cpu") -> int:
    """ValueError unless ``model_cls(cfg)``'s fp32 weights fit the memory ``device`` has free
    (training needs about four times that: gradients and AdamW's two moments); the parameter count."""
    n = parameter_count(model_cls, cfg)
    need, have = 4 * n, available_bytes(device)
    if need > have:
        raise ValueError(f"{what} has {n:,} parameters: {need / 2 ** 30:,.1f} GiB of fp32 weights alone, more than "
                         f"the {have / 2 ** 30:,.1f} GiB free on {torch.device(device).type}: choose a smaller config")
    return n


def model_from_checkpoint(ckpt: dict, path, model_cls, cfg_cls, backend: str | None = None) -> torch.nn.Module:
    """``model_cls(cfg_cls.from_saved(ckpt["config"]))`` with the checkpoint's weights; ``backend``
    replaces the kernels' backend it was saved with. CheckpointError naming ``path`` for a config
    that is not a valid one, or weights that do not fit it."""
    try:
        cfg = cfg_cls.from_saved({**ckpt["config"], **({"backend": backend} if backend else {})})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its config is not a valid one ({e})") from None
    check_fits(model_cls, cfg, f"{path}'s model")
    model = model_cls(cfg)
    load_model_state(model, ckpt["model"], path)
    return model


def load_model_state(model: torch.nn.Module, state: dict, source="checkpoint") -> None:
    """``load_state_dict`` that names every missing, unexpected or mis-shaped tensor."""
    model.load_state_dict(check_model_state(model, state, source))


def weights_fingerprint(state: dict) -> str:
    """Hash of every tensor's name, dtype, shape and bytes: equal exactly for equal weights.

    The trainer records it for the weights a run starts from (``ancestor``); :mod:`fractus.merge`
    averages only checkpoints with the same ancestor."""
    h = hashlib.blake2b(digest_size=16)
    for k, v in sorted(strip_compile_prefix(state).items()):
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}".encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
