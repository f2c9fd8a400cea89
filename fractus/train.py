"""Trainer and CLI: ``python -m fractus.train --preset palier0 --data DIR --tokens N --out DIR``.

The training split is cut into B contiguous streams; each micro-step reads the next C-token
chunk of every stream and carries the attention state (S, z), detached, across chunks. An
optimizer step accumulates ``--accum`` micro-steps. Validation reports cross-entropy in
nats/token, bits per byte and perplexity on the held-out split. Checkpoints hold model,
optimizer, scheduler, data position, every process's carried state and RNG, and the provenance
of each training session (rank 0's process) from the step it started at (``sessions``:
:mod:`fractus.records` writes a finished run's metrics with it), and are written atomically;
``--resume`` continues exactly.
``--grow-from CKPT`` starts from a checkpoint grown to the preset (:mod:`fractus.grow`: same
logits) with a fresh optimizer. SIGINT/SIGTERM save, then exit with code 128 + the signal's number
(130, 143); ``--stop-after`` saves and exits with 0. A run holds a lock on its directory
(``OUT/.lock``, released by the OS when the process ends): a second run on it is refused.
Several processes:
``torchrun --nproc_per_node=N -m fractus.train …`` (DDP; gloo on CPU, NCCL on CUDA; gradients are
all-reduced once per optimizer step, on its last micro-step).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from fractus.allocator import keep_freed_memory
from fractus.atomic import atomic_open, leftover_temps
from fractus.checkpoint import (CheckpointError, describe, load_checkpoint, load_model_state, save_checkpoint,
                                weights_fingerprint)
from fractus.cli import device_name, natural, non_negative, number, positive_int
from fractus.data import TokenStreams, load_meta, load_tokens
from fractus.grow import grow
from fractus.kernels.backend import BACKENDS, check_available
from fractus.baseline import GPT, GPTConfig
from fractus.model import PRESETS, FractusConfig, FractusCTE
from fractus.records import provenance
from fractus.sample import PROMPTS, sample_text
from fractus.tokenizer import get_tokenizer, token_byte_lengths

METRIC_FIELDS = ("step", "tokens", "lr", "train_ce", "train_lb", "grad_norm", "tok_s", "skipped",
                 "val_ce", "val_bpb", "val_ppl", "elapsed_s")
# Arguments that must match when resuming: those that shape the run (--tokens may change: it
# lengthens or shortens the schedule; so may the device, logging, evaluation and checkpoint cadence).
# The model's config is compared as resolved (--set's overrides on the preset), except the backend.
RESUME_KEYS = ("model", "preset", "data", "batch_size", "chunk_len", "accum", "optimizer", "seed", "lr",
               "weight_decay", "warmup", "min_lr_ratio", "grad_clip", "lb_coef", "head_positions",
               "detach_kuramoto", "active_blocks", "bf16")
DEFAULT_LR = {"sgd": 0.1, "adamw": 2e-3, "rmsprop": 2e-3}
# The largest --lr and --weight-decay: far above any useful value, and small enough that every
# factor the optimizers derive from them (lr · weight decay, AdamW's lr / (1 − β1)) fits in float32,
# which torch converts them to (beyond it: an overflow error inside the optimizer's step).
MAX_RATE = 1e6
rate = number(float, lambda x: 0 <= x <= MAX_RATE, f"≥ 0 and ≤ {MAX_RATE:g}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fractus.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--model", default="cte", choices=("cte", "gpt"),
      help="the Fractus CTE, or the softmax-attention transformer it is measured against (fractus.baseline: "
           "the preset's width, depth and heads, a context of --chunk-len, no carried state)")
    a("--preset", default="palier0", choices=sorted(PRESETS),
      help="the model's dimensions (README's table); its vocabulary is the data's")
    a("--data", required=True, help="directory written by `python -m fractus.data prepare`")
    a("--out", required=True, help="run directory: checkpoints, metrics.csv")
    a("--tokens", type=positive_int, default=3_000_000, help="training tokens (all processes together)")
    a("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides, e.g. n_layers=4")
    a("--batch-size", type=positive_int, default=8, help="streams per process (B)")
    a("--chunk-len", type=positive_int, default=32, help="positions per chunk (C)")
    a("--accum", type=positive_int, default=8, help="micro-steps per optimizer step")
    a("--head-positions", default="all", choices=("all", "last"))
    a("--detach-kuramoto", action="store_true")
    a("--optimizer", default="adamw", choices=("sgd", "adamw", "rmsprop"))
    a("--lr", type=rate, default=None, help=f"peak learning rate (default: {DEFAULT_LR})")
    a("--weight-decay", type=rate, default=0.01)
    a("--warmup", type=natural, default=50, help="warm-up optimizer steps")
    a("--min-lr-ratio", type=number(float, lambda x: 0 <= x <= 1, "≥ 0 and ≤ 1"), default=0.1,
      help="cosine decay floor, as a fraction of --lr")
    a("--grad-clip", type=non_negative, default=1.0, help="gradient norm clip (0 = none)")
    a("--lb-coef", type=float, default=None, help="load-balance coefficient (default: config's)")
    a("--active-blocks", type=natural, default=0, help="PGSU: blocks that get weight gradients per step (0 = all)")
    a("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast (default: on for CUDA)")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    a("--backend", default="auto", choices=BACKENDS)
    a("--eval-every", type=natural, default=200, help="optimizer steps between validations (0 = end only)")
    a("--eval-tokens", type=positive_int, default=65_536,
      help="validation tokens per periodic evaluation (whole chunks of every stream, at least one)")
    a("--ckpt-every", type=natural, default=200, help="optimizer steps between checkpoints (0 = end only)")
    a("--max-nan", type=positive_int, default=3,
      help="stop after this many consecutive non-finite steps (loss or gradient)")
    a("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    a("--stop-after", type=positive_int, default=None, metavar="STEPS",
      help="save and stop after STEPS optimizer steps of this invocation, as on SIGTERM (for jobs "
           "with a time limit; continue with --resume)")
    a("--grow-from", metavar="CKPT",
      help="start from CKPT's model grown to the preset (fresh optimizer; ignored with --resume)")
    a("--sample-tokens", type=natural, default=40, help="tokens generated per prompt at the end (0 = none)")
    a("--seed", type=int, default=1337)
    a("--threads", type=natural, default=0, help="torch CPU threads (0 = torch's default)")
    a("--no-progress", action="store_true", help="no tqdm bar")
    return ap


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for kv in pairs:
        if "=" not in kv:
            raise ValueError(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        if k in out:
            raise ValueError(f"--set {k} given twice")
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


# Config fields with their own flag: --set refuses them, so that one setting has one way in.
FLAG_FIELDS = {"chunk_len": "--chunk-len", "backend": "--backend", "detach_kuramoto": "--detach-kuramoto",
               "lb_coef": "--lb-coef"}


def make_config(args, vocab_size: int) -> FractusConfig | GPTConfig:
    """The model's config: the preset with ``--set``'s overrides and the data's vocabulary (for
    ``--model gpt``: the preset's d_model, n_heads and n_layers, a context of ``--chunk-len``)."""
    over = parse_overrides(args.set)
    if args.model == "gpt":
        cte_only = [flag for flag, on in (("--detach-kuramoto", args.detach_kuramoto), ("--lb-coef", args.lb_coef),
                                          ("--active-blocks", args.active_blocks), ("--grow-from", args.grow_from),
                                          ("--head-positions last", args.head_positions == "last")) if on]
        if cte_only:
            raise ValueError(f"--model gpt has no {', '.join(cte_only)}: they are the Fractus CTE's")
        if "context" in over or "backend" in over:
            raise ValueError("set the transformer's context with --chunk-len and its backend with --backend, not --set")
        dims = {k: PRESETS[args.preset][k] for k in ("d_model", "n_heads", "n_layers")}
        return GPTConfig.from_dict({**dims, "vocab_size": vocab_size, **over, "context": args.chunk_len,
                                    "backend": args.backend})
    flagged = {k: FLAG_FIELDS[k] for k in over if k in FLAG_FIELDS}
    if flagged:
        raise ValueError("set these with their own flags, not --set: "
                         + ", ".join(f"{k} → {f}" for k, f in flagged.items()))
    over.setdefault("vocab_size", vocab_size)
    over.update(chunk_len=args.chunk_len, backend=args.backend)
    if args.detach_kuramoto:
        over["detach_kuramoto"] = True
    if args.lb_coef is not None:
        over["lb_coef"] = args.lb_coef
    cfg = FractusConfig.preset(args.preset, **over)
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"the model's vocab_size {cfg.vocab_size} differs from the data's {vocab_size}")
    return cfg


def run_settings(args: dict) -> dict:
    """The arguments that shape a run (RESUME_KEYS), defaults resolved: the data directory as an
    absolute path, the optimizer's default lr, the config's lb coefficient, bf16 on for CUDA."""
    d = {k: args.get(k) for k in RESUME_KEYS}
    d["model"] = d["model"] or "cte"  # checkpoints of earlier trainers: the CTE
    d["data"] = str(Path(d["data"]).resolve())
    d["lr"] = DEFAULT_LR[d["optimizer"]] if d["lr"] is None else d["lr"]
    d["lb_coef"] = FractusConfig.lb_coef if d["lb_coef"] is None else d["lb_coef"]
    d["bf16"] = torch.device(args["device"]).type == "cuda" if d["bf16"] is None else d["bf16"]
    return d


def data_identity(meta: dict) -> dict:
    """What a checkpoint records of its data directory's meta.json, and a resume compares."""
    return {"vocab_size": meta["vocab_size"], "source": meta["source"], "encoding": meta.get("encoding"),
            "train_tokens": meta["train"]["tokens"], "val_tokens": meta["val"]["tokens"]}


def make_optimizer(model, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def lr_lambda(warmup: int, total: int, floor: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def autocast(device: torch.device, bf16: bool):
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_steps(fwd, batches, state, accum: int, head_positions: str, device: torch.device, bf16: bool,
                no_sync=None):
    """Forward + backward over ``accum`` chunks of ``batches`` ((x, y, new_epoch) triples),
    carrying the detached state; gradients accumulate, scaled by 1/accum. ``no_sync``: DDP's
    ``no_sync`` (gradients are all-reduced on the last micro-step only).

    Returns (mean CE, mean lb, state, finite); with a non-finite loss the gradients are garbage
    and the caller drops them. Every micro-step runs its backward, finite or not, so that under
    DDP every rank makes the same all-reduces; the losses are read once per micro-step, after
    the backward is queued.
    """
    ce_sum, lb_sum, finite = 0.0, 0.0, True
    for i, (x, y, new_epoch) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        if new_epoch:
            state = None
        with no_sync() if no_sync is not None and i < accum - 1 else contextlib.nullcontext():
            with autocast(device, bf16):
                _, parts, state = fwd(x, state, y, head_positions)
            (parts["loss"] / accum).backward()
        state = FractusCTE.detach_state(state)
        loss, ce, lb = torch.stack([parts["loss"].detach(), parts["ce"].detach(), parts["lb"].detach()]).tolist()
        finite = finite and math.isfinite(loss)
        ce_sum, lb_sum = ce_sum + ce, lb_sum + lb
    if not finite:
        return float("nan"), float("nan"), state, False
    return ce_sum / accum, lb_sum / accum, state, True


@torch.no_grad()
def evaluate(model: FractusCTE, tokens, batch_size: int, chunk_len: int, max_tokens: int | None,
             token_bytes: torch.Tensor, device: torch.device, bf16: bool = False) -> dict:
    """Held-out CE (nats/token), bits per byte and perplexity over up to ``max_tokens`` targets,
    read as ``batch_size`` contiguous streams with carried state."""
    was = model.training
    model.eval()
    streams = TokenStreams(tokens, batch_size, chunk_len)
    n_chunks = streams.chunks_per_epoch
    if max_tokens:
        n_chunks = max(1, min(n_chunks, max_tokens // (batch_size * chunk_len)))
    ce_sum, n_tok, n_bytes, state = 0.0, 0, 0, None
    for _ in range(n_chunks):
        x, y, _ = streams.next()
        x, y = x.to(device), y.to(device)
        with autocast(device, bf16):
            _, parts, state = model(x, state, y)
        ce_sum += parts["ce"].item() * y.numel()
        n_tok += y.numel()
        n_bytes += int(token_bytes[y.cpu()].sum())
    model.train(was)
    ce = ce_sum / n_tok
    return {"val_ce": ce, "val_bpb": ce_sum / math.log(2) / max(1, n_bytes), "val_ppl": math.exp(ce),
            "val_tokens": n_tok}


class NonFiniteLoss(RuntimeError):
    pass


class Interrupted(BaseException):
    """Training stopped by a signal (this process's ``signum``, else SIGTERM: a peer's), after the
    checkpoint was saved. A BaseException, as KeyboardInterrupt: ``except Exception`` lets it pass."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stop:
    """Set by SIGINT/SIGTERM: the trainer finishes its step, saves and exits. A SIGTERM that a
    caller's own Python handler was waiting for (e.g. the GPU suite's) is handed on to it then."""

    def __init__(self):
        self.requested = False
        self.signum = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested, self.signum = True, signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        old = self._old.get(self.signum)
        if self.signum == signal.SIGTERM and callable(old):
            old(self.signum, None)


def setup_distributed(device: str):
    """(rank, world, device) — from torchrun's environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    rank = int(os.environ["RANK"])
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo")
    return rank, world, torch.device(device)


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def gather_states(state, rank: int, world: int) -> list | None:
    """Every process's carried state (CPU), indexed by rank, on rank 0 (None elsewhere)."""
    if world == 1:
        return [state]
    states = [None] * world if rank == 0 else None
    dist.gather_object(state, states, dst=0)
    return states


def agree(finite: bool, stop: bool, ce: float, lb: float, device: torch.device,
          world: int) -> tuple[bool, bool, float, float]:
    """(every process's loss finite, any process asked to stop, CE and lb averaged over the
    processes): all take the same decisions and log the same numbers (one all-reduce)."""
    if world == 1:
        return finite, stop, ce, lb
    t = torch.tensor([float(not finite), float(stop), ce if finite else 0.0, lb if finite else 0.0],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t)
    bad, stop_any, ce_sum, lb_sum = t.tolist()
    if bad:
        return False, bool(stop_any), float("nan"), float("nan")
    return True, bool(stop_any), ce_sum / world, lb_sum / world


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def append_metrics(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in METRIC_FIELDS})
        f.flush()
        os.fsync(f.fileno())


def read_metrics(path: Path) -> list[dict]:
    """metrics.csv's complete rows (a row cut by a kill is dropped); ValueError naming the file
    unless it is a CSV with a ``step`` column of integers and no row longer than its header."""
    if not path.exists():
        return []
    rows = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is not None and "step" not in reader.fieldnames:
                raise ValueError("its header has no step column")
            for r in reader:
                if None in r:
                    raise ValueError(f"line {reader.line_num} has more values than the header has columns")
                if None in r.values():  # cut short
                    continue
                if not (r["step"].isascii() and r["step"].isdigit()):
                    raise ValueError(f"line {reader.line_num}: step {r['step']!r} is not a step number")
                rows.append(r)
    except (UnicodeDecodeError, csv.Error, ValueError) as e:
        raise ValueError(f"{path} is not a metrics file of this trainer: {e}") from None
    return rows


def write_metrics(path: Path, rows: list[dict]) -> None:
    """Replace metrics.csv with ``rows``, atomically."""
    with atomic_open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in METRIC_FIELDS} for r in rows)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after the checkpoint we resume from (they will be produced again)."""
    if path.exists():
        write_metrics(path, [r for r in read_metrics(path) if int(r["step"]) <= last_step])


def record_final(path: Path, step: int, final: dict) -> None:
    """Put the final validation into step ``step``'s row (one row per step; a rerun replaces it)."""
    rows = read_metrics(path)
    if not rows or int(rows[-1]["step"]) != step:
        rows.append({"step": step})
    rows[-1].update({k: final[k] for k in ("val_ce", "val_bpb", "val_ppl")})
    write_metrics(path, rows)


def set_active_blocks(model: FractusCTE, k: int, seed: int, step: int) -> list[int]:
    """PGSU: only ``k`` of ``model``'s blocks, drawn from ``seed`` and ``step``, train this step
    (the others' parameters stop requiring gradients; a detached clock stays frozen); returns
    their indices."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    active = sorted(torch.randperm(len(model.blocks), generator=g)[:k].tolist())
    for i, blk in enumerate(model.blocks):
        blk.requires_grad_(i in active)
        if blk.clock is not None and model.cfg.detach_kuramoto:
            blk.clock.requires_grad_(False)
    return active


# -- the run directory: one run at a time, no leftovers, a complete record ----------------------
class RunInUse(RuntimeError):
    """The run directory is locked by another process's run."""


@contextlib.contextmanager
def run_lock(out: Path):
    """Hold an exclusive ``flock`` on ``out/.lock`` (``out`` created if absent) until the block
    ends: two runs writing one directory would interleave metrics.csv and overwrite each other's
    checkpoints. The OS drops the lock when its process dies, so a killed run never blocks the
    ``--resume`` that continues it."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUse(f"{out} is in use by another run (the process holding the lock {out / '.lock'}): wait "
                           "for that run to end, or choose another --out") from None
        yield


def remove_leftover_temps(paths) -> None:
    """Remove the temporary files a process killed while writing one of ``paths`` left beside it
    (:func:`fractus.atomic.atomic_open`'s); only safe while holding the run's lock."""
    temps = [t for p in paths for t in leftover_temps(p)]
    for t in temps:
        t.unlink(missing_ok=True)
    if temps:
        print(f"removed {len(temps)} temporary file(s) of an interrupted write: {', '.join(t.name for t in temps)}")


def check_metrics_record(path: Path, step: int) -> None:
    """ValueError unless metrics.csv holds a row for each of steps 1 … ``step`` (the checkpoint's),
    in order: resuming from an incomplete record would leave the run's record silently incomplete."""
    steps = [int(r["step"]) for r in read_metrics(path) if int(r["step"]) <= step]
    if steps == list(range(1, step + 1)):
        return
    missing = sorted(set(range(1, step + 1)) - set(steps))
    if not path.exists():
        what = "does not exist"
    elif missing:
        what = f"lacks the rows of {len(missing)} of them (the first: step {missing[0]})"
    else:
        what = "holds them out of order or more than once"
    raise ValueError(f"refusing to resume: the checkpoint is at step {step}, but {path}, the record of steps "
                     f"1–{step}, {what}; restore it, or train again in another --out")


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


# What a checkpoint's training state holds (what :func:`train`'s ``save`` writes): name → (test, what
# it must be). Optional entries are absent from checkpoints of earlier trainers.
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
    **{k: (_int, "an integer ≥ 0") for k in ("warmup", "active_blocks")},
    **{k: (_real, "a finite number") for k in ("weight_decay", "min_lr_ratio", "grad_clip")},
    **{k: (lambda v: v is None or _real(v), "None or a finite number") for k in ("lr", "lb_coef")},
    "seed": (lambda v: _int(v, -2**63), "an integer"),
    "optimizer": (lambda v: v in DEFAULT_LR, f"one of {sorted(DEFAULT_LR)}"),
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


def planned_steps(args: dict, world: int) -> int:
    """Optimizer steps of a run with the flags ``args`` (as ``vars`` of the parsed CLI, which a
    checkpoint records) on ``world`` processes."""
    return max(1, math.ceil(args["tokens"] / (world * args["batch_size"] * args["chunk_len"] * args["accum"])))


def train(argv=None) -> dict:
    """Run the CLI; returns the final metrics. Raises :class:`Interrupted` after a SIGINT/SIGTERM stop
    (checkpoint saved; ``main`` exits with 128 + the signal's number)."""
    args = build_parser().parse_args(argv)
    with contextlib.ExitStack() as held:  # the run directory's lock (rank 0), released however the run ends
        return run(args, held)


def run(args: argparse.Namespace, held: contextlib.ExitStack) -> dict:
    """:func:`train` with the parsed arguments; rank 0 enters the run directory's lock into ``held``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world, device = setup_distributed(args.device)
    master = rank == 0
    out = Path(args.out)
    ckpt_path, metrics_path = out / "ckpt.pt", out / "metrics.csv"
    meta = load_meta(args.data)
    train_tok, val_tok = load_tokens(args.data, "train", meta), load_tokens(args.data, "val", meta)
    streams = TokenStreams(train_tok, args.batch_size, args.chunk_len, rank=rank, world=world)
    val_streams = world * args.batch_size  # rank 0 validates as one process with every process's streams
    try:  # a too-short split fails now, not at evaluation
        TokenStreams(val_tok, val_streams, args.chunk_len)
    except ValueError as e:
        raise ValueError(f"the validation split ({world} process(es) × {args.batch_size} streams): {e}") from None
    cfg = make_config(args, meta["vocab_size"])
    check_available(cfg.backend, device)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a run directory")
    settings = run_settings(vars(args))
    bf16, lr = settings["bf16"], settings["lr"]
    tokens_per_step = world * args.batch_size * args.chunk_len * args.accum
    total_steps = planned_steps(vars(args), world)
    if args.active_blocks and (args.active_blocks > cfg.n_layers or world > 1):
        raise ValueError("--active-blocks must be ≤ n_layers, and is single-process only")

    torch.manual_seed(args.seed)
    if args.model == "gpt":
        model = GPT(cfg)
    else:
        model = grow(args.grow_from, cfg) if args.grow_from and not args.resume else FractusCTE(cfg)
    ancestor = None if args.resume else weights_fingerprint(model.state_dict())  # what merge checks
    model = model.to(device)
    opt = make_optimizer(model, args.optimizer, lr, args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, total_steps, args.min_lr_ratio))
    step, state, elapsed, nan_run, skipped, sessions = 0, None, 0.0, 0, 0, []
    if args.resume and not ckpt_path.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
    if master:  # one run at a time in a directory; then nothing else writes its files
        held.enter_context(run_lock(out))
        remove_leftover_temps([ckpt_path, metrics_path])
    if args.resume:
        ck = load_checkpoint(ckpt_path)  # on the CPU: RNG states must stay there
        check_training_state(ck, ckpt_path)
        saved, now = run_settings(ck["args"]), settings
        if not os.path.isabs(ck["args"]["data"]) and ck.get("meta"):
            # an earlier trainer's path, relative to a working directory it did not record: the
            # data's identity (compared below) decides
            saved["data"] = now["data"]
        diff = {k: (saved[k], now[k]) for k in RESUME_KEYS if saved[k] != now[k]}
        if "model" not in diff:  # the same kind of model: its configs compare
            now_cfg = cfg.to_dict()
            try:
                saved_cfg = type(cfg).from_dict({**ck["config"], "backend": cfg.backend}).to_dict()
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{ckpt_path}: its config is not a valid one ({e})") from None
            diff.update({f"config {k}": (v, now_cfg[k]) for k, v in saved_cfg.items() if v != now_cfg[k]})
        if ck.get("world", 1) != world:
            diff["processes"] = (ck.get("world", 1), world)
        now_data = data_identity(meta)  # the same path may hold another corpus since
        diff.update({f"data {k}": (v, now_data[k]) for k, v in ck.get("meta", {}).items() if now_data.get(k, v) != v})
        if diff:
            raise ValueError(f"--resume with different settings than the checkpoint: {diff}")
        check_against_run(ck, world, model, opt, args.batch_size, ckpt_path)
        if master:
            check_metrics_record(metrics_path, ck["step"])
        load_model_state(model, ck["model"], ckpt_path)
        load_optimizer_state(opt, ck["optimizer"], ckpt_path)
        sched.load_state_dict(ck["scheduler"])
        step, elapsed, streams.position = ck["step"], ck["elapsed_s"], ck["data_position"]
        state = FractusCTE.detach_state(ck["states"][rank], device)
        nan_run, skipped, ancestor = ck["counters"]["nan_run"], ck["counters"]["skipped"], ck["ancestor"]
        set_rng_state(ck["rng"])
        sessions = [sess for sess in ck.get("sessions", []) if sess["from_step"] < step]
        if master:
            truncate_metrics(metrics_path, step)
            print(f"resumed from {ckpt_path} at step {step} ({step * tokens_per_step:,} tokens)")
    elif master and ckpt_path.exists():
        raise FileExistsError(f"{ckpt_path} exists: pass --resume to continue it, or choose another --out")
    elif master and metrics_path.exists():
        raise FileExistsError(f"{metrics_path} exists (a run that wrote no checkpoint): choose another --out "
                              f"or remove it")

    # where and with what this run trains (rank 0's process under DDP), from which step on:
    # fractus.records gives each row of metrics.csv the provenance of the process that logged it
    sessions.append({"from_step": step, **provenance(device)})

    net = model
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    fwd = torch.compile(net) if args.compile else net
    token_bytes = token_byte_lengths(get_tokenizer(cfg.vocab_size))

    def save():
        """Every process calls it: each one's carried state goes into the checkpoint. Non-finite
        weights are never written: the last checkpoint stays."""
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise NonFiniteLoss(f"the weights became non-finite by step {step} (an update overflowed: lower "
                                f"--lr, or clip with --grad-clip); {ckpt_path} is left as it was")
        states = gather_states(FractusCTE.detach_state(state, "cpu"), rank, world)
        if master:
            save_checkpoint(ckpt_path, {
                "arch": args.model, "config": cfg.to_dict(), "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": step, "data_position": streams.position,
                "states": states, "rng": rng_state(), "elapsed_s": elapsed,
                "counters": {"nan_run": nan_run, "skipped": skipped}, "ancestor": ancestor,
                "args": {**vars(args), "data": settings["data"]}, "world": world, "sessions": sessions,
                "meta": data_identity(meta)})
        if world > 1:  # none leaves before the file is written: torchrun stops the rest once one exits non-zero
            dist.barrier()

    if master:
        name = f"Fractus CTE {args.preset}" if args.model == "cte" else f"transformer baseline ({args.preset}'s dims)"
        print(f"{name}: {model.num_params():,} parameters "
              f"({model.num_params(active=True):,} active per token), vocab {cfg.vocab_size}, "
              f"{device}{' bf16' if bf16 else ''}, {world} process(es)")
        print(f"global batch {world}×{args.batch_size} streams × {args.chunk_len} × accum {args.accum} = "
              f"{tokens_per_step:,} tokens/step, lr {lr:g} ({args.optimizer}), {total_steps} steps")
    bar = tqdm(total=total_steps, initial=step, disable=not master or args.no_progress,
               unit="step", dynamic_ncols=True)
    last, signalled, stopping, first_step = {}, False, False, step
    with Stop() as stop:
        while step < total_steps and not stopping:
            t0 = time.perf_counter()
            if args.active_blocks:
                set_active_blocks(model, args.active_blocks, args.seed, step)
            state_before, pos_before = state, streams.position
            batches = (streams.next() for _ in range(args.accum))
            ce, lb, state, finite = micro_steps(fwd, batches, state, args.accum, args.head_positions,
                                                device, bf16, net.no_sync if world > 1 else None)
            finite, signalled, ce, lb = agree(finite, stop.requested, ce, lb, device, world)
            stopping = signalled
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            grad_norm = float(norm) if finite else float("nan")
            if not math.isfinite(grad_norm):  # a finite loss can still overflow in the backward
                what = "loss" if not finite else "gradient"
                opt.zero_grad(set_to_none=True)
                state = state_before
                streams.position = pos_before + args.accum  # skip the bad data, keep the state
                nan_run += 1
                skipped += 1
                tqdm.write(f"step {step}: non-finite {what}, step skipped ({nan_run}/{args.max_nan} in a row)")
                if nan_run >= args.max_nan:
                    save()
                    raise NonFiniteLoss(f"{nan_run} consecutive non-finite steps (the last: {what}) at step "
                                        f"{step}; last good state saved to {ckpt_path}")
                continue
            nan_run = 0
            if args.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip, norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            stopping = stopping or (args.stop_after is not None and step - first_step >= args.stop_after
                                    and step < total_steps)
            dt = time.perf_counter() - t0
            elapsed += dt
            last = {"step": step, "tokens": step * tokens_per_step, "lr": sched.get_last_lr()[0],
                    "train_ce": ce, "train_lb": lb, "grad_norm": grad_norm,
                    "tok_s": tokens_per_step / dt, "skipped": skipped, "elapsed_s": elapsed}
            bar.update(1)
            bar.set_postfix(ce=f"{last['train_ce']:.3f}", tok_s=f"{last['tok_s']:,.0f}")
            if args.eval_every and step % args.eval_every == 0 and step < total_steps and master:
                last.update(evaluate(model, val_tok, val_streams, args.chunk_len, args.eval_tokens,
                                     token_bytes, device, bf16))
                tqdm.write(f"step {step}: val CE {last['val_ce']:.4f} nats/token, "
                           f"{last['val_bpb']:.4f} bits/byte, ppl {last['val_ppl']:.1f}")
            if master:
                append_metrics(metrics_path, last)
            if args.ckpt_every and step % args.ckpt_every == 0:
                save()
        if not signalled:  # a signal during the last step: no final validation either
            signalled = agree(True, stop.requested, 0.0, 0.0, device, world)[1]
        stopping = stopping or signalled
        bar.close()
        save()  # before a caller's SIGTERM handler runs (Stop's exit)
    if stopping:
        if master:
            print(f"stopped at step {step} of {total_steps}: checkpoint saved to {ckpt_path}; "
                  f"rerun with --resume")
    elif master:
        final = evaluate(model, val_tok, val_streams, args.chunk_len, None, token_bytes, device, bf16)
        last.update(final)
        record_final(metrics_path, step, final)
        unigram = meta["val"]["unigram_entropy_nats"]
        print(f"validation ({final['val_tokens']:,} tokens): CE {final['val_ce']:.4f} nats/token, "
              f"{final['val_bpb']:.4f} bits/byte, perplexity {final['val_ppl']:.1f}; "
              f"unigram entropy of the split {unigram:.4f} nats/token")
        if args.sample_tokens:
            for p in PROMPTS:
                print(f"--- {p!r} →{sample_text(model, p, args.sample_tokens, seed=args.seed)!r}")
    if world > 1:
        if signalled:  # each exits non-zero, and torchrun terminates the rest after the first: let them finish
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            dist.barrier()
        dist.destroy_process_group()  # also after a stop: without it a process can abort (torch 2.11, gloo)
    if signalled:
        raise Interrupted(stop.signum or signal.SIGTERM)
    return last


def main(argv=None) -> None:
    keep_freed_memory()
    try:
        train(argv)
    except (ValueError, OSError, NonFiniteLoss, CheckpointError, RunInUse) as e:  # OSError: e.g. a full disk
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:  # saved; not 0, so that `train && evaluate` does not go on
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:  # outside the training loop (set-up, final validation, samples)
        print("interrupted; --resume continues from the last checkpoint, if one was written", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
