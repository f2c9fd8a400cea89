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
(130, 143); ``--stop-after`` saves and exits with 0.
Several processes:
``torchrun --nproc_per_node=N -m fractus.train …`` (DDP; gloo on CPU, NCCL on CUDA; gradients are
all-reduced once per optimizer step, on its last micro-step).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
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
from fractus.atomic import atomic_open
from fractus.checkpoint import CheckpointError, load_checkpoint, load_model_state, save_checkpoint, weights_fingerprint
from fractus.cli import device_name, natural, non_negative, number, positive_int
from fractus.data import TokenStreams, load_meta, load_tokens
from fractus.grow import grow
from fractus.kernels.backend import BACKENDS, check_available
from fractus.model import PRESETS, FractusConfig, FractusCTE
from fractus.records import provenance
from fractus.sample import PROMPTS, sample_text
from fractus.tokenizer import get_tokenizer, token_byte_lengths

METRIC_FIELDS = ("step", "tokens", "lr", "train_ce", "train_lb", "grad_norm", "tok_s", "skipped",
                 "val_ce", "val_bpb", "val_ppl", "elapsed_s")
# Arguments that must match when resuming: those that shape the run (--tokens may change: it
# lengthens or shortens the schedule; so may the device, logging, evaluation and checkpoint cadence).
# The model's config is compared as resolved (--set's overrides on the preset), except the backend.
RESUME_KEYS = ("preset", "data", "batch_size", "chunk_len", "accum", "optimizer", "seed", "lr",
               "weight_decay", "warmup", "min_lr_ratio", "grad_clip", "lb_coef", "head_positions",
               "detach_kuramoto", "active_blocks", "bf16")
DEFAULT_LR = {"sgd": 0.1, "adamw": 2e-3, "rmsprop": 2e-3}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fractus.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
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
    a("--lr", type=non_negative, default=None, help=f"peak learning rate (default: {DEFAULT_LR})")
    a("--weight-decay", type=non_negative, default=0.01)
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


def make_config(args, vocab_size: int) -> FractusConfig:
    over = parse_overrides(args.set)
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
    """metrics.csv's complete rows (a row cut by a kill is dropped)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if None not in r.values()]


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


def planned_steps(args: dict, world: int) -> int:
    """Optimizer steps of a run with the flags ``args`` (as ``vars`` of the parsed CLI, which a
    checkpoint records) on ``world`` processes."""
    return max(1, math.ceil(args["tokens"] / (world * args["batch_size"] * args["chunk_len"] * args["accum"])))


def train(argv=None) -> dict:
    """Run the CLI; returns the final metrics. Raises :class:`Interrupted` after a SIGINT/SIGTERM stop
    (checkpoint saved; ``main`` exits with 128 + the signal's number)."""
    args = build_parser().parse_args(argv)
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
    model = grow(args.grow_from, cfg) if args.grow_from and not args.resume else FractusCTE(cfg)
    ancestor = None if args.resume else weights_fingerprint(model.state_dict())  # what merge checks
    model = model.to(device)
    opt = make_optimizer(model, args.optimizer, lr, args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, total_steps, args.min_lr_ratio))
    step, state, elapsed, nan_run, skipped, sessions = 0, None, 0.0, 0, 0, []
    if args.resume:
        if not ckpt_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        ck = load_checkpoint(ckpt_path)  # on the CPU: RNG states must stay there
        lacking = sorted({"args", "optimizer", "scheduler", "states", "rng", "counters", "ancestor"} - set(ck))
        if lacking:
            raise CheckpointError(f"{ckpt_path} holds a model but no training state (no {', '.join(lacking)}): "
                                  f"start a new run from it with --grow-from")
        saved, now = run_settings(ck["args"]), settings
        diff = {k: (saved[k], now[k]) for k in RESUME_KEYS if saved[k] != now[k]}
        now_cfg = cfg.to_dict()
        saved_cfg = FractusConfig.from_dict({**ck["config"], "backend": cfg.backend}).to_dict()
        diff.update({f"config {k}": (v, now_cfg[k]) for k, v in saved_cfg.items() if v != now_cfg[k]})
        if ck.get("world", 1) != world:
            diff["processes"] = (ck.get("world", 1), world)
        now_data = data_identity(meta)  # the same path may hold another corpus since
        diff.update({f"data {k}": (v, now_data[k]) for k, v in ck.get("meta", {}).items() if now_data.get(k, v) != v})
        if diff:
            raise ValueError(f"--resume with different settings than the checkpoint: {diff}")
        load_model_state(model, ck["model"], ckpt_path)
        opt.load_state_dict(ck["optimizer"])
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
                "config": cfg.to_dict(), "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": step, "data_position": streams.position,
                "states": states, "rng": rng_state(), "elapsed_s": elapsed,
                "counters": {"nan_run": nan_run, "skipped": skipped}, "ancestor": ancestor,
                "args": vars(args), "world": world, "sessions": sessions,
                "meta": data_identity(meta)})
        if world > 1:  # none leaves before the file is written: torchrun stops the rest once one exits non-zero
            dist.barrier()

    if master:
        out.mkdir(parents=True, exist_ok=True)
        print(f"Fractus CTE {args.preset}: {model.num_params():,} parameters "
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
    except (ValueError, OSError, NonFiniteLoss, CheckpointError) as e:  # OSError: e.g. a full disk while saving
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:  # saved; not 0, so that `train && evaluate` does not go on
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:  # outside the training loop (set-up, final validation, samples)
        print("interrupted; --resume continues from the last checkpoint, if one was written", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
