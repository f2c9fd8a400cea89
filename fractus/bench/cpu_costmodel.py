"""The cost model of a training step on this CPU, fitted on micro-benchmarks and checked against
measured steps: ``python -m fractus.bench costmodel --out results``.

A training step (the trainer's, :class:`fractus.bench.throughput.TrainingStep`: forward and
backward of one micro-step, then AdamW's step) is predicted as

    step time = Σ over the step's ATen ops of the op's time alone  +  ops × the per-op overhead

- the ops: one step traced at the case's size (:class:`Trace`: every ATen call that is not a view,
  with its operands' shapes, strides and dtypes), nothing timed;
- an op's time alone: the op called by itself on random operands of those shapes and layouts, each
  distinct call timed once (:func:`time_alone`): the matmul rate at that shape, the elementwise
  bandwidth at that size, AdamW's traffic. An operand that the step last touched more than the
  last-level cache ago (a reuse-distance model of that cache: the weights, their gradients, AdamW's
  moments, and at large batches the activations the backward reads) is read from a pool larger
  than the cache (:class:`_ColdPool`), as cold as in the step; the others are warm;
- the per-op overhead (autograd's bookkeeping, the modules' Python, the views): the same model's
  structure at tiny widths (:data:`TINY`, B = 1), where the work is negligible: its measured step
  time less its ops' times alone, per op (:func:`per_op_overhead`).

The check measures the steps themselves (:func:`fractus.bench.throughput.measure_training`, each
case in its own processes) and never feeds the fit. Fit and check run in three rounds, preset by
preset, so that each prediction is checked against steps measured minutes after it (:func:`rounds`):
the prediction is the median of the rounds' fits, the measurement the median of their runs. The
terms reported:
``matmul`` (mm, addmm, bmm, baddbmm, and the fused softmax attention of the window level),
``other`` (every other op of the forward and backward),
``optimizer`` (the ops of AdamW's step) and ``overhead`` (ops × per-op overhead).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from fractus.bench.common import cpu_ceilings, in_fresh_process
from fractus.bench.setup import SMOKE_DIMS
from fractus.bench.throughput import TrainingStep, measure_training
from fractus.training.records import write_csv

PRESETS = ("palier0", "palier1", "palier2")  # each also as the original architecture, original-<name>
BATCHES = (1, 8, 32)
CHUNK = 32  # positions per micro-step: the CPU targets' chunk length (fractus.bench.throughput.CPU_TARGETS)
STEP = dict(chunk_len=CHUNK, accum=1, optimizer="adamw", lr=1e-3)  # the trainer's step as checked
TINY = dict(SMOKE_DIMS, vocab_size=512)  # the per-op overhead's widths (the 'tiny' preset's)
# the sizes of a run: FRACTUS_SMOKE's checks its code at tiny widths on one thread (tiny models are
# overhead-bound, and one thread is immune to a busy CPU), in this process
SMOKE = dict(presets=("palier0",), batches=(1, 2), dims=TINY, runs=1, steps=1, reps=2, tiny_steps=3, threads=1)
FULL = dict(presets=PRESETS, batches=BATCHES, dims={}, runs=3, steps=5, reps=5, tiny_steps=15, threads=None)
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}  # ATen's matrix products at the dispatch level (and their _ / out forms)
ATTENTION = "scaled_dot_product"  # in the names of ATen's fused softmax attention, forward and backward
FLOOR_S = 2e-4  # an op's timing repeats the call until it takes this long


def cases(smoke: bool = False) -> list[tuple[str, int]]:
    """(preset, batch size) of the check: each preset, the default and the original architecture."""
    plan = SMOKE if smoke else FULL
    return [(f"{arch}{p}", b) for p in plan["presets"] for arch in ("", "original-") for b in plan["batches"]]


def last_level_cache_bytes() -> int:
    """This CPU's last-level cache (glibc's sysconf), 32 MiB where it is not reported."""
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        size = 0
    return size if size > 0 else 32 << 20


# ----------------------------------------------------------------------------- the trace
def _bytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements, once each (a broadcast dimension once)."""
    return math.prod(n for n, s in zip(t.shape, t.stride()) if s) * t.element_size()


class _Operand:
    """A traced tensor operand: shape, strides, dtype, and whether it was cold in the step."""
    __slots__ = ("shape", "stride", "dtype", "cold")

    def __init__(self, t: torch.Tensor, cold: bool):
        self.shape, self.stride, self.dtype, self.cold = tuple(t.shape), tuple(t.stride()), t.dtype, cold

    def key(self) -> tuple:
        return self.shape, self.stride, self.dtype, self.cold

    def extent(self) -> int:
        """Elements of the storage its strides span."""
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0

    def warm(self) -> torch.Tensor:
        """A tensor of its layout: floats drawn in [0.5, 1.5) (no sign a square root or a log would
        take amiss, no denormals), integers zero (valid indices), booleans true (a mask that hides
        nothing: an attention's scores stay finite)."""
        n = max(self.extent(), 1)
        if self.dtype.is_floating_point:
            base = torch.rand(n).add_(0.5).to(self.dtype)
        else:
            base = torch.full((n,), self.dtype == torch.bool, dtype=self.dtype)
        return base.as_strided(self.shape, self.stride)


class Op:
    """One traced ATen call: the function, its flattened arguments (tensors as :class:`_Operand`),
    how to rebuild them, the step's phase ("step" or "optimizer"), its matmul FLOPs and bytes."""
    __slots__ = ("func", "args", "spec", "phase", "flops", "bytes")

    def __init__(self, func, args, spec, phase, flops, nbytes):
        self.func, self.args, self.spec, self.phase, self.flops, self.bytes = func, args, spec, phase, flops, nbytes

    def key(self) -> tuple:
        """What its time alone depends on: the function and its operands' layouts and values."""
        return (str(self.func), tuple(a.key() if isinstance(a, _Operand) else
                                      "generator" if isinstance(a, torch.Generator) else repr(a) for a in self.args))

    def is_matmul(self) -> bool:
        """A matrix product, or a fused softmax attention (its products inside)."""
        name = self.func._schema.name.removeprefix("aten::")
        return name.rstrip("_") in MATMULS or ATTENTION in name


class Trace(TorchDispatchMode):
    """Inside, every ATen call that is not a view is recorded as an :class:`Op` (and run). An
    operand is warm when fewer than ``cache_bytes`` bytes were touched since it was last touched
    (a view by where it starts: one expert's slice of the experts' weights is not another's) or
    since its storage was last written (the q, k and v slices of one projection's output); else
    it is cold, as are the step's inputs from before (weights, AdamW's moments, the carried state)."""

    def __init__(self, cache_bytes: int):
        super().__init__()
        self.cache_bytes, self.ops, self.phase = cache_bytes, [], "step"
        self.touched = 0  # bytes touched so far; the count when last touched, per view start and per storage written
        self.read, self.written = {}, {}

    def _recent(self, when: dict, key: int) -> bool:
        return key in when and self.touched - when[key] < self.cache_bytes

    def _input(self, t: torch.Tensor) -> bool:
        """Count ``t``'s bytes as touched now; whether it was cold before."""
        cold = not (self._recent(self.read, t.data_ptr()) or self._recent(self.written, t.untyped_storage().data_ptr()))
        self.touched += _bytes(t)
        self.read[t.data_ptr()] = self.touched
        return cold

    def _output(self, t: torch.Tensor) -> None:
        self.touched += _bytes(t)
        self.read[t.data_ptr()] = self.written[t.untyped_storage().data_ptr()] = self.touched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view:
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        operands = [_Operand(a, self._input(a)) if isinstance(a, torch.Tensor) else a for a in flat]
        out = func(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        for o in outs:
            self._output(o)
        nbytes = sum(_bytes(a) for a in flat + outs if isinstance(a, torch.Tensor))
        op = Op(func, operands, spec, self.phase, 0.0, nbytes)
        if op.is_matmul():
            op.flops = _matmul_flops(func._schema.name, [a for a in flat if isinstance(a, torch.Tensor)], outs)
        self.ops.append(op)
        return out


def _matmul_flops(name: str, tensors: list, outs: list) -> float:
    """A product's FLOPs: 2·(output elements)·K, K the first matrix operand's last dimension; a
    fused attention's 4·(query elements)·keys, twice that for its backward (the convention of
    :mod:`fractus.bench.costmodel`: a backward costs two forwards)."""
    if ATTENTION in name:  # (q, k, v, …), the backward's (grad_out, q, k, v, …)
        q, k = tensors[1:3] if name.endswith("backward") else tensors[:2]
        return (8.0 if name.endswith("backward") else 4.0) * q.numel() * k.shape[-2]
    return 2.0 * outs[0].numel() * tensors[1 if "add" in name else 0].shape[-1]


def trace_step(step: TrainingStep, cache_bytes: int, i: int = 1) -> list[Op]:
    """The ops of optimizer step ``i`` of ``step`` (its forward and backward, then the optimizer's)."""
    trace = Trace(cache_bytes)
    with trace:
        step.forward_backward(i)
        trace.phase = "optimizer"
        step.update()
    return trace.ops


# ----------------------------------------------------------------------------- ops timed alone
class _ColdPool:
    """Storage for cold operands: views into a buffer four times the last-level cache, each next
    one further on, so that an operand was last touched a cache's worth of bytes ago. The buffer is
    drawn afresh each time it wraps (in-place ops write into it)."""

    def __init__(self, cache_bytes: int):
        self.buf = torch.empty(cache_bytes).uniform_(0.5, 1.5)  # 4 bytes per element: 4 × the cache
        self.at = 0

    def holds(self, a: _Operand) -> bool:
        """Whether ``a`` comes from the pool: a floating operand up to half its size (a larger one
        is larger than the cache, and so cold every time anyway)."""
        return a.dtype.is_floating_point and max(a.extent(), 1) * 2 <= self.buf.numel()

    def operand(self, a: _Operand) -> torch.Tensor:
        n = max(a.extent(), 1)
        if self.at + n > self.buf.numel():
            self.buf.uniform_(0.5, 1.5)
            self.at = 0
        view = self.buf[self.at:self.at + n]
        self.at += n + 16
        return (view if a.dtype == torch.float32 else view.to(a.dtype)).as_strided(a.shape, a.stride)


def time_alone(op: Op, pool: _ColdPool, reps: int) -> float:
    """Seconds of one call of ``op`` by itself: the median over ``reps`` repeats, each calling it
    enough times to last :data:`FLOOR_S`. Cold operands come fresh from ``pool`` at every call; an
    op that writes into its operands gets fresh warm ones at every call too (repeated in place, its
    values would drift to infinities)."""
    cold = [i for i, a in enumerate(op.args) if isinstance(a, _Operand) and a.cold and pool.holds(a)]
    fresh = op.func._schema.is_mutable

    def arguments(warm=None):
        flat = list(warm) if warm is not None else [a.warm() if isinstance(a, _Operand) else a for a in op.args]
        for i in cold:
            flat[i] = pool.operand(op.args[i])
        return tree_unflatten(flat, op.spec)
    warm = [a.warm() if isinstance(a, _Operand) else a for a in op.args]
    args, kwargs = arguments(warm)
    op.func(*args, **kwargs)
    args, kwargs = arguments(None if fresh else warm)
    t0 = time.perf_counter()
    op.func(*args, **kwargs)
    first = time.perf_counter() - t0
    calls = max(1, min(200 if cold or fresh else 1000, math.ceil(FLOOR_S / max(first, 1e-7))))
    times = []
    for _ in range(reps):
        sets = [arguments(None if fresh else warm) for _ in range(calls)]
        t0 = time.perf_counter()
        for a, k in sets:
            op.func(*a, **k)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def times_alone(ops: list[Op], pool: _ColdPool, reps: int, cache: dict) -> tuple[list[float], int]:
    """Each op's time alone (``cache``: by :meth:`Op.key`, filled as they are timed) and how many
    distinct calls could not be replayed (counted as 0 s)."""
    failed = 0
    torch.set_flush_denormal(True)  # repeated calls must not drift into denormals
    try:
        for op in ops:
            key = op.key()
            if key not in cache:
                try:
                    cache[key] = time_alone(op, pool, reps)
                except Exception:  # an op refusing random operands: counted in replay_failures
                    cache[key] = 0.0
                    failed += 1
    finally:
        torch.set_flush_denormal(False)  # torch's default, which the measured steps run with
    return [cache[op.key()] for op in ops], failed


def predict(ops: list[Op], alone: list[float], overhead_s: float) -> dict:
    """The model's terms (seconds) and counts for one step from its ops' times alone."""
    mm = [(op, t) for op, t in zip(ops, alone) if op.phase == "step" and op.is_matmul()]
    other = [(op, t) for op, t in zip(ops, alone) if op.phase == "step" and not op.is_matmul()]
    opt = [(op, t) for op, t in zip(ops, alone) if op.phase == "optimizer"]
    terms = {"matmul_s": sum(t for _, t in mm), "other_s": sum(t for _, t in other),
             "optimizer_s": sum(t for _, t in opt), "overhead_s": len(ops) * overhead_s}
    return {**terms, "predicted_step_s": sum(terms.values()), "ops": len(ops),
            "cold_ops": sum(any(isinstance(a, _Operand) and a.cold for a in op.args) for op in ops),
            "matmul_ops": len(mm), "matmul_gflop": sum(op.flops for op, _ in mm) / 1e9,
            "other_gb": sum(op.bytes for op, _ in other) / 1e9, "optimizer_gb": sum(op.bytes for op, _ in opt) / 1e9}


# ----------------------------------------------------------------------------- the fit
def _tiny_step(preset: str, steps: int) -> tuple[TrainingStep, float]:
    """``preset``'s structure at :data:`TINY` widths and B = 1 on CPU, and its measured step time
    (the median of ``steps`` after two warm-up steps)."""
    step = TrainingStep(preset, batch_size=1, **STEP, **TINY)
    for i in range(2):
        step.forward_backward(i)
        step.update()
    times = []
    for i in range(2, 2 + steps):
        t0 = time.perf_counter()
        step.forward_backward(i)
        step.update()
        times.append(time.perf_counter() - t0)
    return step, statistics.median(times)


def host_op_seconds(preset: str, steps: int = 5) -> float:
    """This host's whole cost per op (``host_op_us`` of :func:`per_op_overhead`, in seconds): the
    tiny-width step's measured time / its ops. The GPU suite's predictions take it as the host's
    cost of a kernel launch."""
    step, measured = _tiny_step(preset, steps)
    return measured / len(trace_step(step, last_level_cache_bytes(), 2 + steps))


def per_op_overhead(preset: str, pool: _ColdPool, cache_bytes: int, reps: int, steps: int, cache: dict) -> dict:
    """The per-op overhead of ``preset``'s structure: its step at :data:`TINY` widths and B = 1,
    measured (:func:`_tiny_step`), less its ops' times alone, per op; and the host's whole cost per
    op there (``host_op_us``: measured time / ops)."""
    step, measured = _tiny_step(preset, steps)
    ops = trace_step(step, cache_bytes, 2 + steps)
    alone, _ = times_alone(ops, pool, reps, cache)
    return {"tiny_ops": len(ops), "tiny_step_s": measured, "tiny_alone_s": sum(alone),
            "overhead_us": 1e6 * max(measured - sum(alone), 0.0) / len(ops), "host_op_us": 1e6 * measured / len(ops)}


def fit_rows(preset: str, batches: tuple, dims: dict, reps: int, tiny_steps: int) -> list[dict]:
    """The model's prediction for ``preset`` at each batch size, fitted in this process: the per-op
    overhead of its structure, then each batch's traced step and its ops timed alone (a distinct call
    once across the batches)."""
    cache_bytes = last_level_cache_bytes()
    pool, cache = _ColdPool(cache_bytes), {}
    over = per_op_overhead(preset, pool, cache_bytes, reps, tiny_steps, cache)
    rows = []
    for b in batches:
        step = TrainingStep(preset, batch_size=b, **STEP, **dims)
        step.forward_backward(0)  # the state carried into the traced step, as in a measured one
        step.update()
        ops = trace_step(step, cache_bytes)
        alone, failed = times_alone(ops, pool, reps, cache)
        terms = predict(ops, alone, over["overhead_us"] / 1e6)
        rows.append({"preset": preset, "batch_size": b, "chunk_len": CHUNK, "tokens": b * CHUNK, **terms, **over,
                     "replay_failures": failed, "cache_bytes": cache_bytes, "threads": torch.get_num_threads(),
                     **{f"dim_{k}": v for k, v in dims.items()}})
    return rows


def rounds(smoke: bool = False) -> tuple[list[dict], dict[tuple[str, int], list[dict]]]:
    """The fit and the measured steps, in ``runs`` rounds: in each, preset by preset, the preset's
    fit (:func:`fit_rows`, in a fresh process, with this CPU's 1024² fp32 matmul rate just before
    it) and then each of its cases' steps (:func:`fractus.bench.throughput.measure_training`, each
    in a fresh process), so that a prediction and the steps it is checked against are measured
    minutes apart, whatever the machine's drift. Smoke: everything in this process. Returns (the
    fit rows, each with its ``round``; {(preset, batch): [the rounds' measured rows]})."""
    plan = SMOKE if smoke else FULL
    kw = dict(dims=plan["dims"], reps=plan["reps"], tiny_steps=plan["tiny_steps"])
    fitted, measured = [], {c: [] for c in cases(smoke)}
    for r in range(plan["runs"]):
        for preset in dict.fromkeys(p for p, _ in measured):
            gflops = cpu_ceilings(n=256 if smoke else 1024)["matmul_flops"] / 1e9
            rows = (fit_rows(preset, plan["batches"], **kw) if smoke else
                    in_fresh_process("fractus.bench.cpu_costmodel:fit_rows", preset=preset, batches=plan["batches"], **kw))
            fitted += [{**row, "round": r, "matmul_gflops": gflops} for row in rows]
            for b in plan["batches"]:
                step = dict(preset=preset, batch_size=b, steps=plan["steps"], warmup=2, **STEP, **plan["dims"])
                measured[(preset, b)].append(measure_training(**step) if smoke else
                                             in_fresh_process("fractus.bench.throughput:measure_training", **step))
    return fitted, measured


def check_rows(fitted: list[dict], measured: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """Per case: the prediction (the median of the rounds' fits, with the lowest and highest), the
    measured step time (the median of the runs' medians, with the lowest and highest run and the
    fastest and slowest step) and the prediction's error on the step time, over the measured runs'
    range."""
    rows = []
    for (preset, b), runs in measured.items():
        fits = [f for f in fitted if (f["preset"], f["batch_size"]) == (preset, b)]
        preds = sorted(f["predicted_step_s"] for f in fits)
        pred = statistics.median(preds)
        meds = sorted(r["step_s"] for r in runs)
        m = statistics.median(meds)
        rows.append({"preset": preset, "architecture": "original" if preset.startswith("original-") else "default",
                     "batch_size": b, "chunk_len": fits[0]["chunk_len"], "predicted_step_s": pred,
                     "predicted_low_s": preds[0], "predicted_high_s": preds[-1],
                     "predicted_tok_s": fits[0]["tokens"] / pred,
                     "measured_step_s": m, "measured_low_s": meds[0], "measured_high_s": meds[-1],
                     "step_min_s": min(r["step_s_min"] for r in runs), "step_max_s": max(r["step_s_max"] for r in runs),
                     "measured_tok_s": fits[0]["tokens"] / m, "runs": len(runs), "steps_per_run": runs[0]["steps_timed"],
                     "error": pred / m - 1, "error_low": pred / meds[-1] - 1, "error_high": pred / meds[0] - 1,
                     "within_15pct": abs(pred / m - 1) <= 0.15})
    return rows


def run(out: Path, smoke: bool = False) -> tuple[list[dict], list[dict]]:
    """Fit and measure this CPU in rounds (:func:`rounds`, at the run's threads: torch's own, one
    when smoke); write ``out/costmodel_cpu_fit.csv`` (a row per case and round) and
    ``costmodel_cpu_check.csv`` (a row per case). Returns (fit rows, check rows)."""
    threads = torch.get_num_threads()
    torch.set_num_threads((SMOKE if smoke else FULL)["threads"] or threads)
    try:
        fitted, measured = rounds(smoke)
    finally:
        torch.set_num_threads(threads)
    checked = check_rows(fitted, measured)
    write_csv(out / "costmodel_cpu_fit.csv", fitted)
    write_csv(out / "costmodel_cpu_check.csv", checked)
    return fitted, checked
