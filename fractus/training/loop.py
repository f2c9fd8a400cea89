"""The training core, and what its command line runs: ``python -m fractus.train --preset palier0 --data DIR --tokens N --out DIR``.

Each micro-step reads B windows of C tokens of the training split, shuffled, each from an empty
state (``--sampling windows``, the default), or the next C-token chunk of B contiguous streams,
the attention state carried, detached, across chunks (``--sampling streams``). An optimizer step accumulates ``--accum`` micro-steps. Validation reports cross-entropy in
nats/token, bits per byte and perplexity on the held-out split. Checkpoints hold model,
optimizer, scheduler, data position, every process's carried state and RNG, and the provenance
of each training session (rank 0's process) from the step it started at (``sessions``:
:mod:`fractus.training.records` writes a finished run's metrics with it), and are written atomically;
``--resume`` continues exactly, after the checks of :mod:`fractus.training.resume`.
``--grow-from CKPT`` starts from a checkpoint grown to the preset (:mod:`fractus.grow`: same
logits) with a fresh optimizer. SIGINT/SIGTERM save, then exit with code 128 + the signal's number
(130, 143); ``--stop-after`` saves and exits with 0. A run holds a lock on its directory
(``OUT/.lock``, released by the OS when the process ends: :mod:`fractus.training.runs`): a second run on it
is refused. Several processes:
``torchrun --nproc_per_node=N -m fractus.train …`` (:mod:`fractus.training.ddp`; gloo on CPU, NCCL on CUDA;
gradients are all-reduced once per optimizer step, on its last micro-step).

:func:`run` reads top-down: :func:`set_up` (processes, data, model, optimizer), :func:`start` (the
run directory; a fresh start or :func:`resume_run`), :func:`train_loop` (with :func:`skip_step`
and :func:`save`), :func:`finish` (final validation and samples).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fractus.allocator import keep_freed_memory
from fractus.baseline import Transformer, TransformerConfig
from fractus.checkpoint import load_checkpoint, load_model_state, save_checkpoint, weights_fingerprint
from fractus.cli import device_name, natural, non_negative, number, positive_int, run_command, seed_number
from fractus.data import ShuffledWindows, TokenStreams, load_meta, load_tokens
from fractus.training.ddp import agree, gather_states, leave, setup_distributed
from fractus.grow import grow
from fractus.ops.common import BACKENDS, check_available
from fractus.model import PRESETS, FractusConfig, FractusCTE
from fractus.training.records import provenance
from fractus.training.resume import (ADAMW_LR, DEFAULT_LR, SAMPLING, WARMUP_FRACTION, check_against_run, check_settings,
                            check_training_state, data_identity, load_optimizer_state, run_settings, warmup_steps)
from fractus.training.runs import (RunInUse, append_metrics, check_metrics_record, planned_steps, record_final,
                          remove_leftover_temps, run_lock, truncate_metrics)
from fractus.sample import PROMPTS, sample_text
from fractus.tokenizer import get_tokenizer, token_byte_lengths

# The largest --lr and --weight-decay: far above any useful value, and small enough that every
# factor the optimizers derive from them (lr · weight decay, AdamW's lr / (1 − β1)) fits in float32,
# which torch converts them to (beyond it: an overflow error inside the optimizer's step).
MAX_RATE = 1e6
rate = number(float, lambda x: 0 <= x <= MAX_RATE, f"≥ 0 and ≤ {MAX_RATE:g}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fractus.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--model", default="cte", choices=("cte", "transformer"),
      help="the Fractus CTE, or the Transformer++ it is measured against (fractus.baseline: the preset's "
           "width and depth, heads of 32, a context of --chunk-len, no carried state)")
    a("--preset", default="palier0", choices=sorted(PRESETS),
      help="the model's dimensions (docs/model.md, section 6); its vocabulary is the data's")
    a("--data", required=True, help="directory written by `python -m fractus.data prepare`")
    a("--out", required=True, help="run directory: checkpoints, metrics.csv")
    a("--tokens", type=positive_int, default=3_000_000, help="training tokens (all processes together)")
    a("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides, e.g. n_layers=4")
    a("--batch-size", type=positive_int, default=8, help="windows (or streams) per process (B)")
    a("--chunk-len", type=positive_int, default=256, help="positions per window or chunk (C)")
    a("--sampling", choices=SAMPLING, default="windows",
      help="windows: B non-overlapping windows of C tokens each micro-step, each from a fresh state, every "
           "window once an epoch in a random order; streams: B contiguous streams read chunk after chunk, "
           "the state carried from one to the next. Validation reads B contiguous streams, the state "
           "carried, either way (the transformer: sliding windows)")
    a("--accum", type=positive_int, default=1, help="micro-steps per optimizer step")
    a("--head-positions", default="all", choices=("all", "last"))
    a("--detach-kuramoto", action="store_true")
    a("--optimizer", default="adamw", choices=("sgd", "adamw", "rmsprop"))
    a("--lr", type=rate, default=None, help=f"peak learning rate (default: AdamW's tuned per model, {ADAMW_LR}; "
                                              f"SGD's {DEFAULT_LR['sgd']}, RMSprop's {DEFAULT_LR['rmsprop']})")
    a("--weight-decay", type=rate, default=0.1, help="weight decay of the matrices (the embedding included; not gains or biases)")
    a("--warmup", type=natural, default=None,
      help=f"linear warm-up, in optimizer steps (default: {WARMUP_FRACTION * 100:g} %% of the run's steps)")
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
    a("--schedule", metavar="PRESET:TOKENS,…",
      help="progressive growth in one run: train each stage's preset for its tokens, then grow into the next "
           "(e.g. palier0:3M,palier1:6M; a stage may add :lr=LR and :warmup=STEPS); replaces --preset and "
           "--tokens; stages in OUT/<i>-<preset>, one record in OUT/metrics.csv (fractus.training.schedule)")
    a("--sample-tokens", type=natural, default=40, help="tokens generated per prompt at the end (0 = none)")
    a("--seed", type=seed_number, default=1337)
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


# Settings with their own flag (config fields, and the chunk length, a training setting the config
# does not hold): --set refuses them, so that one setting has one way in.
FLAG_FIELDS = {"chunk_len": "--chunk-len", "backend": "--backend", "detach_kuramoto": "--detach-kuramoto",
               "lb_coef": "--lb-coef"}


def make_config(args, vocab_size: int) -> FractusConfig | TransformerConfig:
    """The model's config: the preset with ``--set``'s overrides and the data's vocabulary (for
    ``--model transformer``: the preset's d_model and n_layers, a context of ``--chunk-len``)."""
    over = parse_overrides(args.set)
    if args.model == "transformer":
        cte_only = [flag for flag, on in (("--detach-kuramoto", args.detach_kuramoto), ("--lb-coef", args.lb_coef),
                                          ("--active-blocks", args.active_blocks), ("--grow-from", args.grow_from),
                                          ("--head-positions last", args.head_positions == "last")) if on]
        if cte_only:
            raise ValueError(f"--model transformer has no {', '.join(cte_only)}: they are the Fractus CTE's")
        if "context" in over or "backend" in over:
            raise ValueError("set the transformer's context with --chunk-len and its backend with --backend, not --set")
        dims = {k: PRESETS[args.preset][k] for k in ("d_model", "n_layers")}
        return TransformerConfig.from_saved({**dims, "vocab_size": vocab_size, **over, "context": args.chunk_len,
                                    "backend": args.backend})
    flagged = {k: FLAG_FIELDS[k] for k in over if k in FLAG_FIELDS}
    if flagged:
        raise ValueError("set these with their own flags, not --set: "
                         + ", ".join(f"{k} → {f}" for k, f in flagged.items()))
    over.setdefault("vocab_size", vocab_size)
    over["backend"] = args.backend
    if args.detach_kuramoto:
        over["detach_kuramoto"] = True
    if args.lb_coef is not None:
        over["lb_coef"] = args.lb_coef
    cfg = FractusConfig.preset(args.preset, **over)
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"the model's vocab_size {cfg.vocab_size} differs from the data's {vocab_size}")
    return cfg


def train(argv=None) -> dict:
    """Run the CLI; returns the final metrics. Raises :class:`Interrupted` after a SIGINT/SIGTERM stop
    (checkpoint saved; ``main`` exits with 128 + the signal's number)."""
    args = build_parser().parse_args(argv)
    if args.schedule:
        from fractus.training.schedule import run_schedule
        return run_schedule(args)
    with contextlib.ExitStack() as held:  # the run directory's lock (rank 0), released however the run ends
        return run(args, held)


def run(args: argparse.Namespace, held: contextlib.ExitStack) -> dict:
    """:func:`train` with the parsed arguments; rank 0 enters the run directory's lock into ``held``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    r = set_up(args)
    p = start(r, held)
    # where and with what this run trains (rank 0's process under DDP), from which step on:
    # fractus.training.records gives each row of metrics.csv the provenance of the process that logged it
    p.sessions.append({"from_step": p.step, **provenance(r.device)})
    net = r.model
    if r.world > 1:
        ids = [r.device.index] if r.device.type == "cuda" else None
        net = torch.nn.parallel.DistributedDataParallel(r.model, device_ids=ids)
    fwd = torch.compile(net) if args.compile else net
    token_bytes = token_byte_lengths(get_tokenizer(r.cfg.vocab_size))
    if r.master:
        announce(r)
    with Stop() as stop:
        last, stopped, signalled = train_loop(r, p, fwd, net, token_bytes, stop)
        save(r, p)  # before a caller's SIGTERM handler runs (Stop's exit)
    if stopped:
        if r.master:
            print(f"stopped at step {p.step} of {r.total_steps}: checkpoint saved to {r.ckpt_path}; "
                  f"rerun with --resume")
    elif r.master:
        last.update(finish(r, p, token_bytes))
    if r.world > 1:
        leave(signalled)
    if signalled:
        raise Interrupted(stop.signum or signal.SIGTERM)
    return last


@dataclass
class Run:
    """A training run as its arguments set it up: fixed from its first step to its last."""
    args: argparse.Namespace
    rank: int
    world: int  # processes
    device: torch.device
    meta: dict  # the data directory's meta.json
    streams: TokenStreams | ShuffledWindows  # this process's training data; its position is the run's data position
    val_tokens: torch.Tensor
    cfg: FractusConfig | TransformerConfig
    settings: dict  # run_settings: what a resume must match
    total_steps: int
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR

    @property
    def master(self) -> bool:  # rank 0: writes the checkpoint and metrics.csv, validates
        return self.rank == 0

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    @property
    def ckpt_path(self) -> Path:
        return self.out / "ckpt.pt"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.csv"

    @property
    def bf16(self) -> bool:
        return self.settings["bf16"]

    @property
    def tokens_per_step(self) -> int:
        return self.world * self.args.batch_size * self.args.chunk_len * self.args.accum

    @property
    def val_streams(self) -> int:  # rank 0 validates as one process with every process's streams
        return self.world * self.args.batch_size


@dataclass
class Progress:
    """What changes as a run trains and its checkpoint keeps, beside the model, the optimizer, the
    schedule and the data position."""
    step: int = 0  # optimizer steps taken
    state: list | None = None  # this process's carried state
    elapsed: float = 0.0  # seconds of training steps
    nan_run: int = 0  # non-finite steps in a row
    skipped: int = 0  # non-finite steps in all
    ancestor: str | None = None  # the fingerprint of the weights the run started from: what merge checks
    sessions: list = field(default_factory=list)  # the provenance of each training process, from its first step


def set_up(args: argparse.Namespace) -> Run:
    """The processes, the data, the model, its optimizer and its schedule, once the arguments are
    checked against the data; ValueError naming what cannot make a run."""
    rank, world, device = setup_distributed(args.device)
    meta = load_meta(args.data)
    train_tok, val_tok = load_tokens(args.data, "train", meta), load_tokens(args.data, "val", meta)
    settings = run_settings(vars(args))
    if settings["sampling"] == "streams":
        streams = TokenStreams(train_tok, args.batch_size, args.chunk_len, rank=rank, world=world)
    else:
        streams = ShuffledWindows(train_tok, args.batch_size, args.chunk_len, rank=rank, world=world, seed=args.seed)
    try:  # a too-short split fails now, not at evaluation
        TokenStreams(val_tok, world * args.batch_size, args.chunk_len)
    except ValueError as e:
        raise ValueError(f"the validation split ({world} process(es) × {args.batch_size} streams): {e}") from None
    cfg = make_config(args, meta["vocab_size"])
    check_available(cfg.backend, device)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a run directory")
    total_steps = planned_steps(vars(args), world)
    if args.active_blocks and (args.active_blocks > cfg.n_layers or world > 1):
        raise ValueError("--active-blocks must be ≤ n_layers, and is single-process only")

    torch.manual_seed(args.seed)
    if args.model == "transformer":
        model = Transformer(cfg)
    else:
        model = grow(args.grow_from, cfg) if args.grow_from and not args.resume else FractusCTE(cfg)
    model = model.to(device)
    opt = make_optimizer(model, args.optimizer, settings["lr"], args.weight_decay)
    warmup = warmup_steps(args.warmup, total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total_steps, args.min_lr_ratio))
    return Run(args, rank, world, device, meta, streams, val_tok, cfg, settings, total_steps, model, opt, sched)


def start(r: Run, held: contextlib.ExitStack) -> Progress:
    """Take the run directory (rank 0: its lock into ``held``, then the temporary files a killed
    write left) and say where training starts: with ``--resume``, where the checkpoint stopped;
    else at step 0, in a directory that holds no other run's checkpoint or metrics."""
    if r.args.resume and not r.ckpt_path.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {r.ckpt_path}")
    if r.master:  # one run at a time in a directory; then nothing else writes its files
        held.enter_context(run_lock(r.out))
        remove_leftover_temps([r.ckpt_path, r.metrics_path])
    if r.args.resume:
        return resume_run(r)
    if r.master and r.ckpt_path.exists():
        raise FileExistsError(f"{r.ckpt_path} exists: pass --resume to continue it, or choose another --out")
    if r.master and r.metrics_path.exists():
        raise FileExistsError(f"{r.metrics_path} exists (a run that wrote no checkpoint): choose another --out "
                              f"or remove it")
    return Progress(ancestor=weights_fingerprint(r.model.state_dict()))


def resume_run(r: Run) -> Progress:
    """The checkpoint's progress, once its training state is complete, its run is this one and it
    fits this model and optimizer (:mod:`fractus.training.resume`), and metrics.csv holds its every step:
    model, optimizer, schedule, data position and RNG restored, metrics.csv cut back to its step."""
    ck = load_checkpoint(r.ckpt_path)  # on the CPU: RNG states must stay there
    check_training_state(ck, r.ckpt_path)
    check_settings(ck, r.settings, r.cfg, r.meta, r.world, r.ckpt_path)
    if ck["step"] > r.total_steps:
        raise ValueError(f"--tokens {r.args.tokens:,} makes {r.total_steps} steps, but {r.ckpt_path} is already at "
                         f"step {ck['step']} ({ck['step'] * r.tokens_per_step:,} tokens): give at least that many "
                         f"--tokens, or evaluate the checkpoint as it is (python -m fractus.evaluate)")
    check_against_run(ck, r.world, r.model, r.opt, r.args.batch_size, r.ckpt_path)
    if r.master:
        check_metrics_record(r.metrics_path, ck["step"])
    load_model_state(r.model, ck["model"], r.ckpt_path)
    load_optimizer_state(r.opt, ck["optimizer"], r.ckpt_path)
    r.sched.load_state_dict(ck["scheduler"])
    r.streams.position = ck["data_position"]
    step = ck["step"]
    p = Progress(step=step, state=FractusCTE.detach_state(ck["states"][r.rank], r.device), elapsed=ck["elapsed_s"],
                 nan_run=ck["counters"]["nan_run"], skipped=ck["counters"]["skipped"], ancestor=ck["ancestor"],
                 sessions=[s for s in ck.get("sessions", []) if s["from_step"] < step])
    set_rng_state(ck["rng"])
    if r.master:
        truncate_metrics(r.metrics_path, step)
        print(f"resumed from {r.ckpt_path} at step {step} ({step * r.tokens_per_step:,} tokens)")
    return p


def announce(r: Run) -> None:
    args = r.args
    name = f"Fractus CTE {args.preset}" if args.model == "cte" else f"Transformer++ ({args.preset}'s width and depth)"
    print(f"{name}: {r.model.num_params():,} parameters "
          f"({r.model.num_params(active=True):,} active per token), vocab {r.cfg.vocab_size}, "
          f"{r.device}{' bf16' if r.bf16 else ''}, {r.world} process(es)")
    print(f"global batch {r.world}×{args.batch_size} {r.settings['sampling']} × {args.chunk_len} × accum {args.accum} = "
          f"{r.tokens_per_step:,} tokens/step, lr {r.settings['lr']:g} ({args.optimizer}), {r.total_steps} steps, "
          f"warm-up {warmup_steps(args.warmup, r.total_steps)}")


def train_loop(r: Run, p: Progress, fwd, net, token_bytes: torch.Tensor, stop: Stop) -> tuple[dict, bool, bool]:
    """Optimizer steps until the run's last, or until a signal (on any process) or ``--stop-after``
    stops it after a step; periodic validation, metrics.csv's rows and checkpoints on the way.
    ``fwd``: the model as called (wrapped for DDP, compiled); ``net``: the DDP wrapper, if any.
    Returns (the last step's metrics, stopped before the last step, stopped by a signal)."""
    args = r.args
    bar = tqdm(total=r.total_steps, initial=p.step, disable=not r.master or args.no_progress,
               unit="step", dynamic_ncols=True)
    last, signalled, stopping, first_step = {}, False, False, p.step
    while p.step < r.total_steps and not stopping:
        t0 = time.perf_counter()
        if args.active_blocks:
            set_active_blocks(r.model, args.active_blocks, args.seed, p.step)
        state_before, pos_before = p.state, r.streams.position
        batches = (r.streams.next() for _ in range(args.accum))
        ce, lb, p.state, finite = micro_steps(fwd, batches, p.state, args.accum, args.head_positions,
                                              r.device, r.bf16, net.no_sync if r.world > 1 else None)
        finite, signalled, ce, lb = agree(finite, stop.requested, ce, lb, r.device, r.world)
        stopping = signalled
        norm = torch.nn.utils.get_total_norm([q.grad for q in r.model.parameters() if q.grad is not None])
        grad_norm = float(norm) if finite else float("nan")
        if not math.isfinite(grad_norm):  # a finite loss can still overflow in the backward
            skip_step(r, p, state_before, pos_before, "loss" if not finite else "gradient")
            continue
        p.nan_run = 0
        if args.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(r.model.parameters(), args.grad_clip, norm)
        r.opt.step()
        r.opt.zero_grad(set_to_none=True)
        r.sched.step()
        p.step += 1
        stopping = stopping or (args.stop_after is not None and p.step - first_step >= args.stop_after
                                and p.step < r.total_steps)
        dt = time.perf_counter() - t0
        p.elapsed += dt
        last = {"step": p.step, "tokens": p.step * r.tokens_per_step, "lr": r.sched.get_last_lr()[0],
                "train_ce": ce, "train_lb": lb, "grad_norm": grad_norm,
                "tok_s": r.tokens_per_step / dt, "skipped": p.skipped, "elapsed_s": p.elapsed}
        bar.update(1)
        bar.set_postfix(ce=f"{last['train_ce']:.3f}", tok_s=f"{last['tok_s']:,.0f}")
        if args.eval_every and p.step % args.eval_every == 0 and p.step < r.total_steps and r.master:
            last.update(evaluate_text(r.model, r.val_tokens, r.val_streams, args.chunk_len, args.eval_tokens,
                                      token_bytes, r.device, r.bf16))
            tqdm.write(f"step {p.step}: val CE {last['val_ce']:.4f} nats/token, "
                       f"{last['val_bpb']:.4f} bits/byte, ppl {last['val_ppl']:.1f}")
        if r.master:
            append_metrics(r.metrics_path, last)
        if args.ckpt_every and p.step % args.ckpt_every == 0:
            save(r, p)
    if not signalled:  # a signal during the last step: no final validation either
        signalled = agree(True, stop.requested, 0.0, 0.0, r.device, r.world)[1]
    bar.close()
    return last, stopping or signalled, signalled


def skip_step(r: Run, p: Progress, state_before, pos_before: int, what: str) -> None:
    """Drop a step whose ``what`` (loss or gradient) is not finite: its gradients and its data go,
    the carried state stays as before it, the weights are never touched. After ``--max-nan`` such
    steps in a row: save and raise :class:`NonFiniteLoss`."""
    r.opt.zero_grad(set_to_none=True)
    p.state = state_before
    r.streams.position = pos_before + r.args.accum  # skip the bad data, keep the state
    p.nan_run += 1
    p.skipped += 1
    tqdm.write(f"step {p.step}: non-finite {what}, step skipped ({p.nan_run}/{r.args.max_nan} in a row)")
    if p.nan_run >= r.args.max_nan:
        save(r, p)
        raise NonFiniteLoss(f"{p.nan_run} consecutive non-finite steps (the last: {what}) at step "
                            f"{p.step}; last good state saved to {r.ckpt_path}")


def save(r: Run, p: Progress) -> None:
    """Write the checkpoint (atomically: :func:`fractus.checkpoint.save_checkpoint`). Every process
    calls it: each one's carried state goes into it. Non-finite weights are never written: the last
    checkpoint stays."""
    if not all(bool(torch.isfinite(q).all()) for q in r.model.parameters()):
        raise NonFiniteLoss(f"the weights became non-finite by step {p.step} (an update overflowed: lower "
                            f"--lr, or clip with --grad-clip); {r.ckpt_path} is left as it was")
    states = gather_states(FractusCTE.detach_state(p.state, "cpu"), r.rank, r.world)
    if r.master:
        args = r.args
        save_checkpoint(r.ckpt_path, {
            "arch": args.model, "config": r.cfg.to_dict(), "model": r.model.state_dict(),
            "optimizer": r.opt.state_dict(), "scheduler": r.sched.state_dict(), "step": p.step,
            "data_position": r.streams.position, "states": states, "rng": rng_state(), "elapsed_s": p.elapsed,
            "counters": {"nan_run": p.nan_run, "skipped": p.skipped}, "ancestor": p.ancestor,
            "args": {**vars(args), **{k: r.settings[k] for k in ("data", "lr", "sampling")}}, "world": r.world, "sessions": p.sessions,
            "meta": data_identity(r.meta)})
    if r.world > 1:  # none leaves before the file is written: torchrun stops the rest once one exits non-zero
        torch.distributed.barrier()


def finish(r: Run, p: Progress, token_bytes: torch.Tensor) -> dict:
    """Rank 0's end of a run that reached its last step: validation on the whole held-out split
    (into metrics.csv's last row), printed beside the split's unigram entropy, then samples."""
    args = r.args
    final = evaluate_text(r.model, r.val_tokens, r.val_streams, args.chunk_len, None, token_bytes, r.device, r.bf16)
    record_final(r.metrics_path, p.step, final)
    unigram = r.meta["val"]["unigram_entropy_nats"]
    how = (f"sliding windows of {args.chunk_len} every {args.chunk_len // 2}" if args.model == "transformer"
           else f"{r.val_streams} streams, state carried")
    print(f"validation ({final['val_tokens']:,} tokens, {how}): CE {final['val_ce']:.4f} nats/token, "
          f"{final['val_bpb']:.4f} bits/byte, perplexity {final['val_ppl']:.1f}; "
          f"unigram entropy of the split {unigram:.4f} nats/token")
    if args.model == "transformer":  # the CTE's reading of the split, for the record: chunks without context
        chunks = evaluate_text(r.model, r.val_tokens, r.val_streams, args.chunk_len, None, token_bytes, r.device,
                               r.bf16, read="chunks")
        final.update({f"{k}_chunks": v for k, v in chunks.items()})
        print(f"read as {r.val_streams} streams of {args.chunk_len}-token chunks: CE {chunks['val_ce']:.4f} "
              f"nats/token, {chunks['val_bpb']:.4f} bits/byte")
    if args.sample_tokens:
        for prompt in PROMPTS:
            print(f"--- {prompt!r} →{sample_text(r.model, prompt, args.sample_tokens, seed=args.seed)!r}")
    return final


# -- the steps' parts, which the benchmarks and the vision trainer share ------------------------
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


READS = ("auto", "carried", "chunks", "sliding")


@torch.no_grad()
def evaluate_text(model, tokens, batch_size: int, chunk_len: int, max_tokens: int | None,
             token_bytes: torch.Tensor, device: torch.device, bf16: bool = False, read: str = "auto") -> dict:
    """Held-out CE (nats/token), bits per byte and perplexity over up to ``max_tokens`` targets of
    ``tokens``, read as ``read`` says:

    - "carried": ``batch_size`` contiguous streams of ``chunk_len``-token chunks, each stream from an
      empty state that is then carried from chunk to chunk (the CTE's own reading);
    - "chunks": the same chunks, each read on its own from an empty state;
    - "sliding": windows of the transformer's ``context`` every ``context / 2`` tokens, ``batch_size``
      at a time; the first window scores all its targets, each later one the targets no earlier
      window scored, so every scored target but the first window's sees at least ``context / 2``
      tokens (the reading of a model that carries no state);
    - "auto": "carried" for a model with a state, "sliding" for one without (:class:`Transformer`).
    """
    if read not in READS:
        raise ValueError(f"read must be one of {READS}, got {read!r}")
    if read == "auto":
        read = "sliding" if isinstance(model, Transformer) else "carried"
    was = model.training
    model.eval()
    if read == "sliding":
        batches = _windows(tokens, model.cfg.context, model.cfg.context // 2, batch_size, max_tokens)
    else:
        batches = _chunks(tokens, batch_size, chunk_len, max_tokens)
    ce_sum, n_tok, n_bytes, state = 0.0, 0, 0, None
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device, bf16):
            _, parts, state = model(x, state if read == "carried" else None, y)
        n = int(parts["n"])
        ce_sum += parts["ce"].item() * n
        n_tok += n
        n_bytes += int(token_bytes[y[y != -100].cpu()].sum())
    model.train(was)
    ce = ce_sum / n_tok
    return {"val_ce": ce, "val_bpb": ce_sum / math.log(2) / max(1, n_bytes), "val_ppl": math.exp(ce),
            "val_tokens": n_tok}


def _chunks(tokens, batch_size: int, chunk_len: int, max_tokens: int | None):
    """(x, y) [batch_size, chunk_len]: the next chunk of every stream, up to ``max_tokens`` targets."""
    streams = TokenStreams(tokens, batch_size, chunk_len)
    n_chunks = streams.chunks_per_epoch
    if max_tokens:
        n_chunks = max(1, min(n_chunks, max_tokens // (batch_size * chunk_len)))
    for _ in range(n_chunks):
        yield streams.next()[:2]


def _windows(tokens, context: int, stride: int, batch_size: int, max_tokens: int | None):
    """(x, y) [≤ batch_size, L] (L = context, or the split's length if shorter): sliding windows of
    ``tokens`` every ``stride`` positions and one ending at the split's end; y is -100 (not scored)
    at the targets an earlier window scored. Stops once ``max_tokens`` targets are scored."""
    n = len(tokens) - 1  # targets: tokens[1:]
    L = min(context, n)
    starts = list(range(0, n - L + 1, stride))
    if starts[-1] != n - L:
        starts.append(n - L)
    windows, scored_to, total = [], 0, 0
    for s in starts:
        windows.append((s, scored_to - s))  # (start, offset of its first target to score)
        total += s + L - scored_to
        scored_to = s + L
        if max_tokens and total >= max_tokens:
            break
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        rows = torch.from_numpy(np.stack([np.asarray(tokens[s:s + L + 1], dtype=np.int64) for s, _ in group]))
        x, y = rows[:, :-1], rows[:, 1:].clone()
        for j, (_, first) in enumerate(group):
            y[j, :first] = -100
        yield x, y


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



# -- stopping -------------------------------------------------------------------------------------
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


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])



RESUME_HINT = "interrupted; --resume continues from the last checkpoint, if one was written"


def main(argv=None) -> None:
    keep_freed_memory()

    def body():
        try:
            train(argv)
        except Interrupted as e:  # saved; not 0, so that `train && evaluate` does not go on
            sys.exit(128 + e.signum)
    # Ctrl-C outside the training loop (set-up, final validation, samples): RESUME_HINT
    run_command(body, errors=(NonFiniteLoss, RunInUse), interrupted=RESUME_HINT)

