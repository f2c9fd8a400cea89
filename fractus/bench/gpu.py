"""The GPU suite: ``python -m fractus.bench gpu --out results/gpu`` (one command; ``--time-limit-s`` bounds its time).

1. provenance and the device's ceilings (device-to-device copy GB/s, large bf16 matmul TFLOP/s);
   then every kernel compiled in parallel processes into Triton's cache (:func:`aot.precompile`);
2. every Triton kernel compiled for real and checked against its reference in fp32 and bf16
   (and the Kuramoto clock's kernels and fused path against plain autograd); the trainer's CLI
   on the device: a run stopped and resumed against an uninterrupted one;
3. end-to-end bf16 training throughput, peak memory and MFU per preset over a batch sweep
   (chunk 128, accum 1, SGD: the model's own cost, without AdamW's passes over the weights);
4. each kernel timed against its baselines (fla / Liger side by side when installed, and
   torch.compile: these compile and autotune, so they come after the training target), then
   tick-by-tick generation tokens/s, the optimization stack and the profiler breakdown (notebooks
   01, 02); last, every kernel once at offsets past 2³¹ elements (:mod:`fractus.verify.offsets`);
5. CSVs under ``results/gpu/`` (read by the notebooks), ``targets.csv`` (each of the project's
   targets: met, missed or not measured) and a summary printed last (a pass/fail table per kernel
   and dtype, the training sweep, generation, the targets).

A failing part is recorded in ``failures.csv`` and the suite goes on (after one that leaves
CUDA's context unusable, e.g. an illegal memory access, in a fresh process); with ``--time-limit-s`` a
part that would start after the time limit is spent is recorded as skipped, so the summary and the
CSVs are written before an outer time limit kills the run. ``--dry-run`` runs the same code paths
on CPU at tiny sizes (kernels through Triton's interpreter, which computes bf16 and tf32 there as
a GPU does: :mod:`fractus.ops.interpreter`); CI runs it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from fractus.atomic import atomic_open
from fractus.bench import (common, cross_entropy, decode, delta_rule, harness, linear_attention, moe, optimizations,
                           profile)
from fractus.bench.common import check_rows, cuda_context_lost, median_time, sync
from fractus.bench.costmodel import datasheet, flops_per_token, gpu_step
from fractus.bench.cpu_costmodel import host_op_seconds
from fractus.bench.setup import Setup
from fractus.bench.throughput import measure_training
from fractus.cli import CommandError
from fractus.data import prepare, write_toy_corpus
from fractus.ops import common as _backend
from fractus.ops.kuramoto import kuramoto_phase, kuramoto_phase_reference
from fractus.model import FractusConfig, FractusCTE
from fractus.training.records import cuda_name, provenance, write_csv
from fractus.training.runs import read_metrics
from fractus.training.command import train
from fractus.verify import aot, offsets
from fractus.verify.cases import GEN_PROMPT, kuramoto_case

KERNELS = ("linear_attention", "delta_rule", "moe", "cross_entropy")
OPS = {"linear_attention": linear_attention, "delta_rule": delta_rule, "moe": moe,
       "cross_entropy": cross_entropy}  # their modules
TRAIN_TARGET = ("1b", 150_000, 0.20)  # preset, tok/s and MFU it must reach in bf16 on one H200
COST_MODEL_TOLERANCE = 0.30  # the cost model's predicted step time against the measured one, on the GPU
# The original's only measured GPU throughput (TRAINING_LOG_1B.md of the Fractus CTE repository, "Live
# metrics (latest)"): the 1B
# model at B=2, sequence 128, bf16 autocast, SGD, each of 4 RTX 5090s training its own shard; tok/s per GPU.
ORIGINAL_1B_GPU = {"gpu": "RTX 5090", "batch_size": 2, "chunk_len": 128, "tok_s": (1012, 1077, 1083, 1083)}
# (preset, batch sizes, chunk_len) swept for end-to-end training on the GPU: the default architecture at
# every size, and the original one at 1b's; 1b at B=2 is the original's own setting (ORIGINAL_1B_GPU)
TRAIN_SWEEP = [("palier0", (8, 64, 256), 128), ("palier1", (8, 64, 256), 128),
               ("palier2", (8, 64, 128), 128), ("palier3", (8, 32, 64), 128), ("1b", (2, 8, 32, 64, 128), 128),
               ("original-1b", (2, 32, 128), 128)]
DRY_SWEEP = [("tiny", (1, 2), 16)]


def train_setup(preset: str, chunk_len: int, batch_size: int = 8) -> Setup:
    """The training sweep's configuration (the preset's own model, every position supervised,
    SGD, no accumulation) as a :class:`fractus.bench.setup.Setup`: :func:`train_rows` measures it, the
    precompile compiles it and notebook 04's cost model counts its launches."""
    return Setup(preset=preset, vocab_size=FractusConfig.preset(preset).vocab_size, tie_head=True, sparse_moe=True,
                 fused_ce=True, chunk_len=chunk_len, optimizer="sgd", batch_size=batch_size)


def ceilings(device: torch.device, dry_run: bool) -> dict:
    """Measured device-to-device copy bandwidth and bf16 (fp32 on a CPU dry run) matmul rate."""
    n_copy = (1 << 20) if dry_run else (1 << 30)
    src = torch.empty(n_copy, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = median_time(lambda: dst.copy_(src), device=device)
    n = 256 if dry_run else 8192
    dtype = torch.float32 if dry_run else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t_mm = median_time(lambda: a @ b, device=device)
    return {"copy_gbs": 2 * n_copy / t_copy / 1e9, "matmul_tflops": 2 * n ** 3 / t_mm / 1e12,
            "matmul_n": n, "matmul_dtype": common.dtype_name(dtype), "copy_bytes": n_copy}


def model_runs() -> list[tuple[str, dict]]:
    """What the suite's model parts launch, as (preset, :func:`aot._run_model`'s keywords), for
    :func:`precompile_rows`. The training sweep: palier0, palier2 and a one-layer 1b stand for
    every preset (their kernels take the same specialisations), B=8 and B=16 for every batch
    (Triton specialises integers on divisibility by 16), two steps (the second with the carried
    state); the optimizations' setups and the profile's on the Triton kernels; generation."""
    stand_ins = (("palier0", ()), ("palier2", ()), ("1b", (("n_layers", 1),)))
    setups = [(replace(train_setup(p, chunk, b), dims=dims), True) for p, dims in stand_ins
              for b in (8, 16) for chunk in {c for _, _, c in TRAIN_SWEEP}]
    setups += [(r, bf16) for _, _, r, bf16, backend in optimizations.gpu_plan(cuda=True) if backend != "torch"]
    setups += [(r, True) for _, r in profile.gpu_setups(cuda=True)]
    runs = [(r.preset, dict(batch_size=r.batch_size, chunk_len=r.chunk_len, head_positions=r.head_positions,
                            active_blocks=r.active_blocks, bf16=bf16, steps=2, **r.model_overrides()))
            for r, bf16 in setups]
    generate = [(p, dict(steps=0, **dict(dims))) for p, dims in stand_ins]
    return list({repr(run): run for run in runs + generate}.values())  # setups alike once


def precompile_rows(dry_run: bool) -> list[dict]:
    """Every kernel the suite launches (the ops', :func:`model_runs`', the timings' and fla's when
    installed, every autotune config) compiled in parallel processes into
    Triton's cache first, so that later parts and autotuning load binaries instead of compiling
    one at a time. Dry run: two workers compile the clock's kernels offline for sm_90 (no time
    limit that a loaded CI machine could reach)."""
    if dry_run:
        return aot.precompile(2, ops=("kuramoto",), presets=(), arch=90, timeout_s=1800)
    return aot.precompile(max(1, min(16, (os.cpu_count() or 2) - 1)), presets=model_runs(),
                          extras=tuple(aot.EXTRAS))


def train_rows(device: torch.device, dry_run: bool, peaks: dict) -> Iterator[dict]:
    """A row per configuration of the sweep as it is measured; a failing one is an error row.
    Each row also holds the cost model's prediction of its step (:func:`costmodel.gpu_step` at
    ``peaks``, the device's bf16 TFLOP/s and memory GB/s, with the preset's launches counted on
    its GPU path and this host's cost per op, :func:`cpu_costmodel.host_op_seconds`) and the
    prediction's error on the measured step time."""
    peak_tflops = peaks["bf16_tflops"]
    for preset, batches, chunk in (DRY_SWEEP if dry_run else TRAIN_SWEEP):
        rec = train_setup(preset, chunk)
        flops = sum(flops_per_token(rec.config(), training=True, chunk_len=rec.chunk_len,
                                    head_positions=rec.head_positions).values())
        try:
            launches, host_op_s = profile.gpu_launch_count(rec), host_op_seconds(preset)
        except Exception as e:  # the measurements go on without the predictions
            launches, host_op_s, unpredicted = None, None, f"prediction: {type(e).__name__}: {e}"[:300]
        for b in batches:
            kw = dict(train_setup(preset, chunk, b).trainer_kwargs(), steps=3, warmup=2, device=str(device),
                      bf16=True)
            if dry_run:
                kw.update(backend="triton", steps=1, warmup=0)
            failed = {"preset": preset, "batch_size": b, "chunk_len": chunk, "tok_s": None, "mfu": None}
            try:
                r = measure_training(preset, **kw)
                r["train_flops_per_token"] = flops
                r.update(peak_tflops=peak_tflops, peak_gbs=peaks["hbm_gbs"], peaks=peaks["peaks"])
                r["mfu"] = r["tok_s"] * flops / (peak_tflops * 1e12)
                if launches is None:
                    r["note"] = unpredicted
                else:
                    setup = train_setup(preset, chunk, b)
                    pred = gpu_step(setup.config(), batch_size=b, chunk_len=chunk, launches=launches,
                                    host_op_s=host_op_s, accum=setup.accum, optimizer=setup.optimizer,
                                    head_positions=setup.head_positions, peak_flops=peak_tflops * 1e12,
                                    peak_bw=peaks["hbm_gbs"] * 1e9)
                    r.update(launches=launches, host_op_us=1e6 * host_op_s, predicted_step_s=pred["step_s"],
                             predicted_bound=pred["bound"], prediction_error=pred["step_s"] / r["step_s"] - 1)
            except torch.cuda.OutOfMemoryError:
                yield {**failed, "error": "out of memory"}
                torch.cuda.empty_cache()
                break
            except Exception as e:  # recorded: the sweep's other configurations (the 1b target last) still run
                yield {**failed, "error": f"{type(e).__name__}: {e}"[:300]}
                if cuda_context_lost(device):  # every later one would fail too: the part ends here
                    return
            else:
                yield r


def kuramoto_rows(device: torch.device, dry_run: bool, timing: bool) -> list[dict]:
    """The clock's Triton kernels and its fused PyTorch path (hand-written RK4 backward) in fp32 vs
    plain autograd in fp64 on the device, ψ and every gradient: error ≤ fp32 autograd's + 1e-4
    (atan2's gradient is ill-conditioned where the phases cancel; ``timing``: forward+backward
    times of all three in fp32 instead, :func:`kuramoto_bench`)."""
    args, dy = kuramoto_case(device, small=dry_run)
    if timing:
        return list(harness.run([kuramoto_bench(device, args, dy)]))
    same = _clock_run(kuramoto_phase_reference, args, dy)
    args64 = [a.detach().double().requires_grad_() for a in args]
    psi64 = kuramoto_phase_reference(*args64, *CLOCK)
    truth = (psi64, *torch.autograd.grad(psi64, args64, dy.double()))
    return [r for name in ("triton", "torch") for r in check_rows(
        f"kuramoto_phase[{name}]", torch.float32, ("psi", "dtheta", "domega", "dU", "dlambda"),
        _clock_run(CLOCK_FNS[name], args, dy), truth, same, margin=1e-4, truth_name="fp64 autograd")]


CLOCK = (0.1, 2, 0.1)  # the clock's (dt, steps, damping) in its checks and timings
CLOCK_FNS = {"triton": lambda *a: kuramoto_phase(*a, backend="triton"),
             "torch": lambda *a: kuramoto_phase(*a, backend="torch"), "reference": kuramoto_phase_reference}


def _clock_run(fn, args, dy):
    """ψ and the gradients of θ⁰, ω, U, λ for the upstream gradient ``dy``."""
    psi = fn(*args, *CLOCK)
    return (psi, *torch.autograd.grad(psi, args, dy))


def kuramoto_bench(device: torch.device, args, dy) -> harness.Bench:
    """The clock's forward+backward in fp32 on ``args`` (:func:`fractus.verify.cases.kuramoto_case`):
    Triton, the fused PyTorch path and plain autograd (the baseline), with TFLOP/s (two N×N
    coupling products per RK4 part, the backward 2× the forward) and GB/s (θ⁰ read and dθ⁰
    written, ψ written and dψ read)."""
    (M, N), steps = args[0].shape, CLOCK[1]
    return harness.Bench(
        op="kuramoto", case="", x_name="tokens", x_values=(M,), providers=tuple(CLOCK_FNS),
        setup=lambda M: (args, dy), call=lambda p, m, case: lambda: _clock_run(CLOCK_FNS[p], *case),
        baseline="reference", shape=dict(oscillators=N), device=device.type, timing=harness.Timing(warmup=2, reps=5),
        flops=lambda M, m: 3 * steps * 4 * (4 * N * N + 8 * N) * M, min_bytes=lambda M, m: 4 * (2 * M * N + 2 * M))


RESUME_FIELDS = ("step", "tokens", "lr", "train_ce", "train_lb", "grad_norm", "val_ce", "val_bpb")
RESUME_RTOL = 1e-3  # CUDA's atomic adds (the PyTorch path's index_add_) reorder fp32 sums between runs


def trainer_rows(device: torch.device) -> list[dict]:
    """``python -m fractus.train`` on the device (tiny preset, a toy corpus, bf16 autocast on CUDA;
    the PyTorch kernels' path, which compiles nothing: the Triton path's training is timed by
    ``train_throughput``): 6 steps in one go, and 3 steps then ``--resume`` from the checkpoint saved
    on the device; every metric of every step must agree within ``RESUME_RTOL``."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare(str(write_toy_corpus(tmp / "corpus.txt")), tmp / "data", vocab_size=512)
        args = ["--preset", "tiny", "--data", str(tmp / "data"), "--tokens", str(6 * 4 * 32), "--batch-size", "4",
                "--chunk-len", "32", "--accum", "1", "--eval-every", "2", "--eval-tokens", "256",
                "--sample-tokens", "4", "--no-progress", "--backend", "torch", "--device", str(device)]
        t0 = time.perf_counter()
        train([*args, "--out", str(tmp / "full")])
        train([*args, "--out", str(tmp / "run"), "--stop-after", "3"])
        train([*args, "--out", str(tmp / "run"), "--resume"])
        seconds = time.perf_counter() - t0
        runs = [[{k: float(r[k]) if r[k] else None for k in RESUME_FIELDS}
                 for r in read_metrics(tmp / name / "metrics.csv")] for name in ("full", "run")]
    full, resumed = runs
    diff = 0.0 if len(full) == len(resumed) else float("inf")
    for a, b in zip(full, resumed):
        for k in RESUME_FIELDS:
            if (a[k] is None) != (b[k] is None):
                diff = float("inf")
            elif a[k] is not None:
                diff = max(diff, abs(a[k] - b[k]) / max(abs(a[k]), 1e-12))
    return [{"check": "stopped after 3 of 6 steps and resumed vs one run", "rows": len(full),
             "max_rel_diff": diff, "rtol": RESUME_RTOL, "passed": diff <= RESUME_RTOL,
             "final_val_ce": full[-1]["val_ce"], "seconds": seconds}]


def generation_rows(device: torch.device, dry_run: bool) -> Iterator[dict]:
    """Tick-by-tick generation tokens/s (batch 1, a 16-token prompt), a row per preset: new tokens
    over the seconds of one ``generate`` call, whose chunked prefill of the prompt (about one
    tick's launches) is included."""
    for preset in (("tiny",) if dry_run else ("palier0", "palier2", "1b")):
        cfg = FractusConfig.preset(preset, backend="triton" if dry_run else "auto")
        with device:
            model = FractusCTE(cfg).eval()
        n_new = 4 if dry_run else 64
        with torch.autocast(device.type, dtype=torch.bfloat16):
            model.generate(GEN_PROMPT, 2, temperature=0)  # compile / warm up: the timed prompt's shapes
            sync(device)
            t0 = time.perf_counter()
            model.generate(GEN_PROMPT, n_new, temperature=0.9, top_k=50, seed=0)
            sync(device)
        yield {"preset": preset, "batch_size": 1, "new_tokens": n_new, "tok_s": n_new / (time.perf_counter() - t0),
               "dtype": common.dtype_name(torch.bfloat16)}


def nvidia_driver() -> str:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it, or why it is unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split("\n")[0].strip() or f"unknown (nvidia-smi: {out.stderr.strip()[:100]})"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"


def baseline_versions() -> dict:
    """The installed version of each baseline package timed side by side, or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("fla-core", "liger-kernel"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _part_fns(out: Path, device: torch.device, dry_run: bool) -> dict[str, Callable[[], Iterable[dict]]]:
    """The suite's parts in the order they run: name → a function returning its rows, or yielding
    them one by one as they are measured (those measured before a failure or a stop are kept)."""
    ceil: dict = {}

    def measure_ceilings() -> list[dict]:
        ceil.update(ceilings(device, dry_run))
        return [ceil]

    def peaks() -> dict:
        """The device's dense bf16 TFLOP/s and memory GB/s: its datasheet's
        (:func:`costmodel.datasheet`), or, on a CPU dry run or a GPU without one, the measured
        ceilings."""
        sheet = None if dry_run else datasheet(cuda_name(device.index))
        if sheet is not None:
            return {"bf16_tflops": sheet["bf16_tflops"], "hbm_gbs": sheet["hbm_gbs"], "peaks": "datasheet"}
        if not ceil and (out / "ceilings.csv").exists():  # measured by an earlier process of this run
            ceil.update(pd.read_csv(out / "ceilings.csv").iloc[0].to_dict())
        return {"bf16_tflops": max(ceil.get("matmul_tflops", 1e-3), 1e-3), "hbm_gbs": max(ceil.get("copy_gbs", 1e-3), 1e-3),
                "peaks": "measured"}

    fns = {"ceilings": measure_ceilings, "precompile": lambda: precompile_rows(dry_run)}
    def poisoned(rows: Callable[[], Iterable[dict]]) -> Iterator[dict]:
        """The checks run with NaN-filled kernel outputs, so that unwritten elements fail them."""
        with _backend.poisoned():
            yield from rows()
    for k in KERNELS:
        fns[f"correctness_{k}"] = lambda k=k: poisoned(lambda: OPS[k].correctness_rows(device, smoke=dry_run))
    fns["correctness_kuramoto"] = lambda: poisoned(lambda: kuramoto_rows(device, dry_run, timing=False))
    fns["trainer_resume"] = lambda: trainer_rows(device)
    # the training target before the kernels' timings: those also compile and autotune the baselines
    fns["train_throughput"] = lambda: train_rows(device, dry_run, peaks())
    for k in KERNELS:
        fns[f"timing_{k}"] = lambda k=k: OPS[k].gpu_rows(smoke=dry_run)
    fns["timing_kuramoto"] = lambda: kuramoto_rows(device, dry_run, timing=True)
    fns["generation"] = lambda: generation_rows(device, dry_run)
    fns["decode"] = lambda: decode.gpu_rows(device, smoke=dry_run)
    fns["optimizations"] = lambda: optimizations.gpu_rows(smoke=dry_run)
    fns["profile"] = lambda: profile.gpu_rows(smoke=dry_run)
    # last: tens of GB per case, and the suite's other checks do not wait for it
    fns["correctness_offsets"] = lambda: poisoned(lambda: offsets.correctness_rows(device, smoke=dry_run))
    return fns


def run_parts(out: Path, names: list[str], dry_run: bool, t_start: float,
               time_limit_s: float | None = None,
               after_part: Callable[[dict, list], None] | None = None) -> tuple[dict[str, pd.DataFrame], list[dict]]:
    """Run the parts ``names`` in order, writing each one's ``out/NAME.csv``; none starts after
    ``time_limit_s`` seconds from ``t_start`` (a ``time.time()``). A failing part is recorded and the
    next one runs; after a failure that lost CUDA's context the remaining parts run in a fresh
    process. ``after_part(tables, failures)`` is called after each part that ran. Returns the
    tables and the failures."""
    device = torch.device("cpu" if dry_run else "cuda")
    fns = _part_fns(out, device, dry_run)
    tables, failures = {}, []
    for i, name in enumerate(names):
        t0, n_failures = time.time(), len(failures)
        if time_limit_s is not None and t0 - t_start > time_limit_s:
            failures.append({"part": name, "error": f"skipped: the time limit of {time_limit_s:.0f} s was spent",
                             "trace": ""})
            print(f"[{t0 - t_start:6.1f}s] {name}: skipped (time limit)")
            continue
        fresh = None  # set once the part (and, when True, the rest in a fresh process) has run
        try:
            fresh = _run_part(name, i, names, fns, out, device, dry_run, t_start, t0, time_limit_s, tables, failures)
            if after_part is not None:
                after_part(tables, failures)
            if fresh:
                break
        except Stopped as e:  # SIGTERM (an outer time limit): this part (unless it failed or had
            if fresh:  # ended) and the rest are listed; a fresh process ran the rest already
                break
            rest = names[i + 1:] if fresh is not None or len(failures) > n_failures else names[i:]
            failures += [{"part": n, "error": f"stopped: {e}", "trace": ""} for n in rest]
            print(f"[{time.time() - t_start:6.1f}s] {name}: stopped ({e}); no further part runs")
            break
    return tables, failures


def _run_part(name, i, names, fns, out, device, dry_run, t_start, t0, time_limit_s, tables, failures) -> bool:
    """One part of :func:`run_parts` (its rows into ``tables``, a failure into ``failures``);
    True when the remaining parts ran in a fresh process. The part's CSV is rewritten after every
    row it yields, so a process that dies inside the part leaves the rows measured before."""
    rows: list[dict] = []

    def keep() -> None:  # the rows measured so far, whatever comes next
        if rows:
            write_csv(out / f"{name}.csv", rows, device)
            tables[name] = pd.DataFrame(rows)
    try:
        for row in fns[name]():
            rows.append(row)
            keep()
        if device.type == "cuda":  # errors of its last kernels surface here, in their part
            torch.cuda.synchronize(device)
        print(f"[{time.time() - t_start:6.1f}s] {name}: {len(rows)} rows ({time.time() - t0:.1f}s)")
        if device.type == "cuda":  # its cached blocks back to the device: a fresh process may need them
            torch.cuda.empty_cache()
    except Stopped:  # the signal may have come between a row and its writing
        keep()
        raise
    except Exception as e:  # a failing part is recorded and the suite goes on
        failures.append({"part": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)})
        print(f"[{time.time() - t_start:6.1f}s] {name}: FAILED {type(e).__name__}: {e}")
        if i + 1 < len(names) and cuda_context_lost(device):
            print("CUDA's context is lost: the remaining parts run in a fresh process")
            more, more_failures = _run_in_fresh_process(out, names[i + 1:], dry_run, t_start, time_limit_s)
            tables.update(more)
            failures += more_failures
            return True
    return False


RESULT_FILE = ".parts.json"  # what a fresh process of run_parts hands back
LAST_PART_S = 45  # what a part started just before the time limit ran out may take (docs/benchmarks.md's
# command stops the suite 80 s after its --time-limit-s; the process starts up to ~20 s before t_start)
STOP_GRACE_S = 10  # a fresh process told to stop (SIGTERM) has this long to hand back its results


class Stopped(BaseException):
    """SIGTERM received (``timeout``'s signal): the running part stops, the results so far are
    written. A BaseException, so that the parts' own ``except Exception`` do not swallow it."""


@contextmanager
def stop_on_sigterm():
    """Inside the block, the first SIGTERM raises :class:`Stopped` and later ones are ignored
    (``timeout`` signals the process and then its group; a stop must not be cut short by a second
    signal). Main thread only."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped(f"signal {signal.Signals(signum).name}")
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_in_fresh_process(out: Path, names: list[str], dry_run: bool, t_start: float,
                          time_limit_s: float | None) -> tuple[dict[str, pd.DataFrame], list[dict]]:
    result = out / RESULT_FILE
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "fractus.bench", "gpu", "--out", str(out), "--started-at", repr(t_start),
           "--resume-parts", *names] + (["--dry-run"] if dry_run else [])
    launched, timeout = time.time(), None
    if time_limit_s is not None:  # it must end before an outer limit stops this process and leaves it running
        cmd += ["--time-limit-s", repr(time_limit_s)]
        timeout = max(t_start + time_limit_s + LAST_PART_S - time.time(), 1.0)
    proc = subprocess.Popen(cmd)
    try:
        ended = f"exited with code {proc.wait(timeout=timeout)}"
    except (subprocess.TimeoutExpired, Stopped) as e:  # told to stop, it hands back what it has
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ended = (f"was stopped after {timeout:.0f} s (the time limit)" if isinstance(e, subprocess.TimeoutExpired)
                 else f"was stopped ({e})")
    try:  # written whole or not at all (atomic_open), but a killed child may leave none
        done = json.loads(result.read_text())
        result.unlink()
        return {n: pd.read_csv(out / f"{n}.csv") for n in done["parts"]}, done["failures"]
    except (OSError, ValueError):
        pass
    written = [n for n in names if (out / f"{n}.csv").exists() and (out / f"{n}.csv").stat().st_mtime >= launched]
    return ({n: pd.read_csv(out / f"{n}.csv") for n in written},
            [{"part": n, "error": f"no result: the fresh process for the parts from {names[0]} {ended}",
              "trace": ""} for n in names if n not in written])


def resume_parts(out: Path, names: list[str], dry_run: bool, t_start: float, time_limit_s: float | None) -> None:
    """The fresh process's side of :func:`run_parts`: run ``names``, hand back what they gave."""
    with stop_on_sigterm():
        tables, failures = run_parts(out, names, dry_run, t_start, time_limit_s)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what ran is handed back, whatever comes now
        with atomic_open(out / RESULT_FILE) as f:
            f.write(json.dumps({"parts": list(tables), "failures": failures}))


def run_suite(out: Path, dry_run: bool = False, time_limit_s: float | None = None) -> dict[str, pd.DataFrame]:
    """Run every part (none that would start after ``time_limit_s`` seconds); write ``out/*.csv``;
    return the tables."""
    device = torch.device("cpu" if dry_run else "cuda")
    if not dry_run and not torch.cuda.is_available():
        raise CommandError("the GPU suite needs a CUDA device (this torch sees none); --dry-run runs its code "
                           "paths on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    for name in _part_fns(out, device, dry_run):  # an earlier run's tables: the notebooks must not
        (out / f"{name}.csv").unlink(missing_ok=True)  # read them beside this run's (a part skipped)
    t_start = time.time()
    prov = provenance(device)
    if device.type == "cuda":
        prov.update(driver=nvidia_driver(), cuda_runtime=torch.version.cuda or "")
    prov["baselines"] = baseline_versions()
    (out / "provenance.json").write_text(json.dumps(prov, indent=1))
    print("provenance:", prov)
    def write_outcome(tables: dict, failures: list) -> None:
        """targets.csv and failures.csv as they stand (after every part: a process killed in a
        stuck CUDA call still leaves them)."""
        write_csv(out / "targets.csv", target_rows(tables), device)
        if failures:
            write_csv(out / "failures.csv", failures, device)
        elif (out / "failures.csv").exists():
            (out / "failures.csv").unlink()

    write_outcome({}, [])  # none measured yet; a stale failures.csv of an earlier run goes
    with stop_on_sigterm():
        tables, failures = run_parts(out, list(_part_fns(out, device, dry_run)), dry_run, t_start, time_limit_s,
                                      after_part=write_outcome)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the final files are written, whatever comes now
        write_outcome(tables, failures)
        tables["targets"] = pd.DataFrame(target_rows(tables))
        tables["failures"] = pd.DataFrame(failures)
        print_summary(tables, time.time() - t_start)
    return tables


def target_rows(tables: dict[str, pd.DataFrame]) -> list[dict]:
    """The targets in one table: every kernel check passed, each timing table's target rows, and the training target (best tok/s and MFU of the sweep for its preset);
    ``met`` is empty where it was not measured."""
    checks = [t for name, t in tables.items() if name.startswith("correctness_") and name != "correctness_offsets"]
    c = pd.concat(checks, ignore_index=True) if checks else pd.DataFrame({"passed": []})
    complete = len(checks) == len(KERNELS) + 1
    rows = [{"target": "every kernel correct (fp32 and bf16 vs the fp32 truth)",
             "case": f"{int(c['passed'].sum())}/{len(c)} checks in {len(checks)}/{len(KERNELS) + 1} parts",
             "met": bool(c["passed"].all()) and complete if checks else None}]
    t = tables.get("correctness_offsets")
    rows.append({"target": "every kernel correct at offsets past 2^31 elements (the last rows vs the reference)",
                 "case": "" if t is None else f"{int(t['passed'].sum())}/{len(t)} checks",
                 "met": None if t is None else bool(t["passed"].all()), "note": "not measured" if t is None else ""})
    for name, t in tables.items():
        if not name.startswith("timing_") or "target" not in t:
            continue
        for _, r in t[t["target"].notna()].iterrows():
            case = ", ".join([f"{k}={r[k]}" for k in ("provider", "case", "mode", "dtype") if pd.notna(r.get(k))]
                             + [f"{r['x_name']}={r['x_value']}"])
            met = r.get("target_met")
            rows.append({"target": f"{name.removeprefix('timing_')}: {r['target']}", "case": case,
                         "met": None if pd.isna(met) else bool(met),
                         "note": r["note"] if "note" in r and pd.notna(r["note"]) else ""})
    t = tables.get("trainer_resume")
    rows.append({"target": "the trainer on the device: stopped + --resume equals one run",
                 "met": None if t is None else bool(t["passed"].all()),
                 "note": "" if t is None else f"max rel. diff {t['max_rel_diff'].max():.1e}"})
    preset, tok_s, mfu = TRAIN_TARGET
    t = tables.get("train_throughput")
    runs = t[(t["preset"] == preset) & t["tok_s"].notna()] if t is not None and "tok_s" in t else pd.DataFrame()
    for what, col, goal in ((f"{tok_s:,} tok/s", "tok_s", tok_s), (f"{mfu:.0%} MFU", "mfu", mfu)):
        row = {"target": f"train {preset} in bf16: >= {what}", "met": None}
        if len(runs):
            best = runs.loc[runs[col].idxmax()]
            row.update(case=f"best of the sweep: B={int(best['batch_size'])}", value=float(best[col]),
                       met=bool(best[col] >= goal))
        else:
            row["note"] = "not measured"
        rows.append(row)
    errors = t["prediction_error"].dropna() if t is not None and "prediction_error" in t else pd.Series([], dtype=float)
    row = {"target": f"cost model within ±{COST_MODEL_TOLERANCE:.0%} of the measured training step times", "met": None}
    if len(errors):
        row.update(case=f"{len(errors)} steps of the sweep, errors {errors.min():+.0%} to {errors.max():+.0%}",
                   value=float(errors.abs().max()), met=bool((errors.abs() <= COST_MODEL_TOLERANCE).all()))
    else:
        row["note"] = "not measured"
    rows.append(row)
    return rows


def pass_fail_table(checks: pd.DataFrame) -> pd.DataFrame:
    """Per (kernel, dtype): checks passed, checks made, and the worst rel_err / tol."""
    return (checks.assign(err_over_tol=checks["rel_err"] / checks["tol"])
            .groupby(["kernel", "dtype"], sort=False)
            .agg(passed=("passed", "sum"), checks=("passed", "size"), worst_err_over_tol=("err_over_tol", "max")))


def print_summary(tables: dict[str, pd.DataFrame], seconds: float) -> None:
    print(f"\n===== GPU suite summary ({seconds:.0f} s) =====")
    checks = [t for name, t in tables.items() if name.startswith("correctness_")]
    if checks:
        c = pd.concat(checks, ignore_index=True)
        print(f"kernel checks: {int(c['passed'].sum())}/{len(c)} passed")
        print(pass_fail_table(c).to_string(float_format=lambda x: f"{x:.2g}"))
        bad = c[~c["passed"].astype(bool)]
        if len(bad):
            print(bad.to_string(index=False, max_colwidth=40))
    if "train_throughput" in tables:
        t = tables["train_throughput"]
        cols = [k for k in ("preset", "batch_size", "chunk_len", "tok_s", "mfu", "peak_mem_bytes", "error") if k in t]
        print(t[cols].to_string(index=False))
    if "generation" in tables:
        print(tables["generation"].to_string(index=False))
    if "targets" in tables:
        print(tables["targets"].astype(object).fillna("").to_string(index=False, max_colwidth=60))
    f = tables.get("failures")
    print("failed parts: " + (", ".join(f["part"]) if f is not None and len(f) else "none"))
