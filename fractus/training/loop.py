"""One training run, from its parsed options (:mod:`fractus.training.options`) to its final
validation.

:func:`run` reads top-down: :func:`set_up` (processes, data, model, optimizer), :func:`start` (the
run directory; a fresh start or :func:`resume_run`), :func:`train_loop` (with :func:`skip_step`
and :func:`save`), :func:`finish` (final validation and samples). A step's parts are
:mod:`fractus.training.steps`', the optimizer :mod:`fractus.training.optim`'s, validation
:mod:`fractus.training.evaluation`'s; a signal or a run that cannot go on ends it with
:mod:`fractus.training.stopping`'s exceptions.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from fractus.baseline import Transformer, TransformerConfig
from fractus.checkpoint import check_fits, load_checkpoint, load_model_state, save_checkpoint, weights_fingerprint
from fractus.data import ShuffledWindows, TokenStreams, load_meta, load_tokens
from fractus.grow import grow
from fractus.model import FractusConfig, FractusCTE
from fractus.ops.common import check_available
from fractus.sample import PROMPTS, sample_text
from fractus.tokenizer import get_tokenizer, token_byte_lengths
from fractus.training.ddp import agree, gather_states, leave, setup_distributed
from fractus.training.evaluation import evaluate_text
from fractus.training.optim import lr_lambda, make_optimizer, warmup_steps
from fractus.training.options import make_config
from fractus.training.records import provenance
from fractus.training.resume import (check_against_run, check_settings, check_training_state, data_identity,
                                     load_optimizer_state, run_settings)
from fractus.training.runs import (append_metrics, check_metrics_record, planned_steps, record_final,
                                   remove_leftover_temps, run_lock, truncate_metrics)
from fractus.training.steps import micro_steps, rng_state, set_active_blocks, set_rng_state
from fractus.training.stopping import Interrupted, NonFiniteLoss, Stop


def run(args: argparse.Namespace, held: contextlib.ExitStack) -> dict:
    """Train the run the parsed options ``args`` set (a single run, or a schedule's stage); returns
    its last step's metrics, with its final validation if it reached its last step. Rank 0 enters the
    run directory's lock into ``held``. Raises :class:`Interrupted` after a SIGINT/SIGTERM stop
    (checkpoint saved)."""
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

    check_fits(Transformer if args.model == "transformer" else FractusCTE, cfg, "--preset and --set's model", device)
    torch.manual_seed(args.seed)
    if args.model == "transformer":
        model = Transformer(cfg)
    else:
        model = grow(args.grow_from, cfg, args.grow_depth) if args.grow_from and not args.resume else FractusCTE(cfg)
    model = model.to(device)
    opt = make_optimizer(model, args.optimizer, settings["lr"], args.weight_decay)
    warmup = warmup_steps(args.warmup, total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total_steps, args.min_lr_ratio, args.lr_shape,
                                                             args.decay_fraction, args.lr_offset, args.lr_span,
                                                             args.lr_decay_start))
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
