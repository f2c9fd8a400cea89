"""Where the time of a training iteration goes: phases and forward components.

An iteration is one micro-step (forward + backward) and one optimizer step, as in the original
analysis. :func:`phase_times` times the three phases without a profiler (median over
iterations). :func:`forward_components` runs ``torch.profiler`` and attributes every op's self
time inside the forward to the model's ``record_function`` labels ("embedding", "attention",
"kuramoto", "moe", "head_loss"); LayerNorms count as "norms" wherever they sit (the original
lumped them with the embedding) and whatever no label covers (residual adds, load balance, the
routing bookkeeping) is "per-block overhead". The components add up to the profiled forward.

On CUDA the same code times with synchronisation and attributes kernel (device) time.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from fractus.bench.common import sync
from fractus.bench.setup import SMOKE_DIMS, Setup
from fractus.model import FractusCTE
from fractus.ops import common as ops_backend
from fractus.ops import kuramoto as kuramoto_op
from fractus.training.optim import make_optimizer
from fractus.training.steps import autocast
from fractus.verify import aot

PHASES = ("forward", "backward", "optimizer")
LABELS = ("embedding", "attention", "kuramoto", "moe", "head_loss")
COMPONENTS = ("attention", "kuramoto", "moe", "embedding", "norms", "head_loss", "per-block overhead")
# The profile of TRAINING_OPTIMIZATION.md of the Fractus CTE repository ("Profile": Ryzen 5 5500U, 12 threads;
# d=512, 4 blocks, 16 experts, chunk 32): its phases (ms) and its forward's rows ("~" ms). Its head
# row is "Output head (1 position, tied)"; our head_loss (head + cross-entropy) is compared with it.
ORIGINAL_PHASES_MS = {"forward": 166, "backward": 271, "optimizer": 176, "total": 613}
ORIGINAL_FORWARD_MS = {"Attention": 45, "Kuramoto": 0, "MoE": 60, "Embedding + norms": 20,
                       "Output head (1 position, tied)": 8, "Per-block overhead": 33}
# Our components → the original's rows (its table groups embedding and norms into one row).
ORIGINAL_ROWS = {"attention": "Attention", "kuramoto": "Kuramoto", "moe": "MoE",
                 "embedding": "Embedding + norms", "norms": "Embedding + norms",
                 "head_loss": "Output head (1 position, tied)", "per-block overhead": "Per-block overhead"}
_MARK = "fractus_phase:"


class _Iteration:
    """A model, its optimizer and a fixed random batch; ``run()`` does one iteration."""

    def __init__(self, setup: Setup, device: str = "cpu", bf16: bool = False, seed: int = 0):
        self.device = torch.device(device)
        self.setup, self.bf16 = setup, bf16
        torch.manual_seed(seed)
        self.model = FractusCTE(setup.config()).to(self.device)
        self.opt = make_optimizer(self.model, setup.optimizer, setup.lr(), 0.01)
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, self.model.cfg.vocab_size, (setup.batch_size, setup.chunk_len + 1), generator=g)
        self.x, self.y = x[:, :-1].to(self.device), x[:, 1:].to(self.device)
        self.state = None

    def run(self, mark: bool = False) -> tuple[float, float, float]:
        """One iteration; returns the seconds of forward, backward, optimizer."""
        ctx = (lambda name: record_function(_MARK + name)) if mark else (lambda name: nullcontext())
        times = []
        sync(self.device)
        t0 = time.perf_counter()
        with ctx("forward"), autocast(self.device, self.bf16):
            _, parts, state = self.model(self.x, self.state, self.y, self.setup.head_positions)
        sync(self.device)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ctx("backward"):
            parts["loss"].backward()
        sync(self.device)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ctx("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        times.append(time.perf_counter() - t0)
        self.state = FractusCTE.detach_state(state)
        return tuple(times)


def phase_times(setup: Setup, iters: int = 5, warmup: int = 2, device: str = "cpu",
                bf16: bool = False) -> dict[str, float]:
    """Median milliseconds of forward, backward and optimizer per iteration (and their total)."""
    it = _Iteration(setup, device, bf16)
    for _ in range(warmup):
        it.run()
    runs = [it.run() for _ in range(iters)]
    out = {p: 1e3 * statistics.median(r[i] for r in runs) for i, p in enumerate(PHASES)}
    out["total"] = sum(out[p] for p in PHASES)
    return out


def _component(ev) -> str:
    """The forward component an op belongs to: the nearest label above it (itself included)."""
    e = ev
    while e is not None:
        name = e.name
        if name == "aten::layer_norm":
            return "norms"
        if name in LABELS:
            return name
        if name.startswith(_MARK):
            return "per-block overhead"
        e = e.cpu_parent
    return "per-block overhead"


def attribute(events, device_time: bool = False) -> dict[str, float]:
    """Self time (ms) of every op under the profiled forward ranges, summed per component;
    also "forward" (the ranges' inclusive time) and the backward/optimizer ranges' times."""
    out = {c: 0.0 for c in COMPONENTS}
    ranges = {p: 0.0 for p in PHASES}

    def self_t(e):
        return (e.self_device_time_total if device_time else e.self_cpu_time_total) / 1e3

    def total_t(e):
        return (e.device_time_total if device_time else e.cpu_time_total) / 1e3

    def inside_forward(e):
        while e is not None:
            if e.name == _MARK + "forward":
                return True
            e = e.cpu_parent
        return False

    marking = {e.thread for e in events if e.name.startswith(_MARK) and e.device_type == DeviceType.CPU}
    for e in events:
        if e.device_type != DeviceType.CPU:  # on CUDA: the kernels' own events and the GPU's copies
            continue  # of the ranges (user annotations), already in their CPU events' device time
        if e.name.startswith(_MARK):
            ranges[e.name[len(_MARK):]] += total_t(e)
        if inside_forward(e):
            out[_component(e)] += self_t(e)
        elif device_time and e.thread not in marking:
            # CUDA tensors' backward runs on autograd's device thread, so its ops are not children
            # of the backward range (the profiler nests events per thread)
            ranges["backward"] += self_t(e)
    return {**out, **ranges}


def forward_components(setup: Setup, iters: int = 3, warmup: int = 2, device: str = "cpu",
                       bf16: bool = False) -> dict[str, float]:
    """Mean milliseconds per iteration of each forward component (:data:`COMPONENTS`) under
    ``torch.profiler``, plus the profiled "forward", "backward", "optimizer" and "ops" (ATen op
    calls per iteration, a proxy for kernel launches)."""
    it = _Iteration(setup, device, bf16)
    for _ in range(warmup):
        it.run()
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _quiet_native_stderr():
        with profile(activities=acts) as prof:
            for _ in range(iters):
                it.run(mark=True)
        events = prof.events()
    out = attribute(events, device_time=cuda)
    out = {k: v / iters for k, v in out.items()}
    out["ops"] = launched_ops(events) / iters
    return out


@contextmanager
def _quiet_native_stderr():
    """Kineto prints start/stop lines on the process's C-level stderr; keep them out of outputs."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_NO_KERNEL = {"aten::view", "aten::reshape", "aten::t", "aten::transpose", "aten::as_strided",
              "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::permute", "aten::slice",
              "aten::select", "aten::unbind", "aten::split", "aten::chunk", "aten::detach",
              "aten::alias", "aten::_unsafe_view", "aten::lift_fresh", "aten::empty",
              "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
              "aten::resolve_conj", "aten::resolve_neg",
              "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
              "aten::contiguous", "aten::to", "aten::_to_copy", "aten::numpy_T", "aten::narrow",
              "detach", "aten::set_", "aten::flatten", "aten::view_as", "aten::expand_as"}


# what CPU kernels call inside one op for its output (zeros: fill_; clone: copy_; a large sum: fill_ and copy_)
_HELPERS = {"aten::fill_", "aten::zero_", "aten::copy_"}


def _works(e) -> bool:
    return e.name.startswith("aten::") and e.name not in _NO_KERNEL


def launched_ops(events) -> int:
    """A kernel-launch proxy: each outermost ATen op that does work (no view/metadata op) and
    calls no working op other than output helpers (fill_, zero_, copy_) counts once. So stack
    and cat, zeros, clone and sum count one whatever CPU's kernels call inside them for large
    inputs (cat narrows them, sum buffers them); index_add (clone, then index_add_) counts two."""
    helpers = {}  # id(event) -> whether its subtree holds only helpers: each subtree walked once

    def helpers_only(e) -> bool:
        if id(e) not in helpers:
            helpers[id(e)] = all((not _works(c) or c.name in _HELPERS) and helpers_only(c) for c in e.cpu_children)
        return helpers[id(e)]

    def counted(e) -> bool:
        return _works(e) and helpers_only(e)

    def under_counted(e) -> bool:
        e = e.cpu_parent
        while e is not None:
            if counted(e):
                return True
            e = e.cpu_parent
        return False
    return sum(1 for e in events if counted(e) and not under_counted(e))


def _tiny(setup: Setup, **dims) -> Setup:
    """``setup``'s structure at tiny widths (d=32, vocabulary 512)."""
    keep = dict(setup.dims)
    keep.update(d_model=32, n_heads=2, expert_d_ff=32,
                expert_rank=8 if setup.config().expert_rank else 0, **dims)
    return replace(setup, vocab_size=512, dims=tuple(keep.items()))


def _count_ops(setup: Setup, warmup: int = 1) -> float:
    it = _Iteration(setup)
    for _ in range(warmup):
        it.run()
    return _profiled_ops(it)


def _profiled_ops(it: _Iteration) -> float:
    """Kernel-launching ATen ops of one forward + backward of ``it`` (the optimizer excluded)."""
    with _quiet_native_stderr():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            it.run(mark=True)
        events = prof.events()

    def in_step(e):
        while e is not None:
            if e.name in (_MARK + "forward", _MARK + "backward"):
                return True
            e = e.cpu_parent
        return False
    return float(launched_ops([e for e in events if in_step(e)]))


def op_count(setup: Setup, timed: bool = False, iters: int = 3) -> dict[str, float]:
    """Kernel-launching ATen ops of one micro-step (forward + backward) of ``setup``, counted
    on CPU at tiny widths (d=32, vocabulary 512): the count depends on the structure (layers,
    experts, Kuramoto steps, chunks), not on the widths. Deep or many-expert structures are
    counted at (1 layer, 4 experts), (2, 4) and (1, 8) and extrapolated (ops are affine in the
    layers and, per layer, in the experts that receive tokens: an upper estimate when routing
    leaves experts idle).

    ``timed`` also returns "step_s", the median wall time of the tiny micro-step, and
    "op_s" = step_s / ops: the per-op cost of eager PyTorch on this machine.
    """
    cfg = setup.config()
    L, E = cfg.n_layers, cfg.n_experts
    if L * E <= 64:
        ops = _count_ops(_tiny(setup))
    else:
        c11, c21, c12 = (_count_ops(_tiny(setup, n_layers=l, n_experts=e)) for l, e in ((1, 4), (2, 4), (1, 8)))
        per_expert = (c12 - c11) / 4
        per_layer = c21 - c11 - 4 * per_expert
        ops = c11 - per_layer - 4 * per_expert + L * (per_layer + E * per_expert)
    out = {"ops": ops}
    if timed:
        it = _Iteration(_tiny(setup))
        for _ in range(2):
            it.run()
        out["step_s"] = statistics.median(sum(it.run()[:2]) for _ in range(iters))
        out["op_s"] = out["step_s"] / _count_ops(_tiny(setup)) if L * E <= 64 else out["step_s"] / ops
    return out


def gpu_launch_count(setup: Setup) -> int:
    """Kernel launches of one bf16 micro-step (forward + backward) on the GPU's path: the ATen
    ops that launch a kernel plus the Triton kernels' launches, counted on CPU at tiny widths
    with the Triton path forced and its launches captured instead of run
    (:func:`fractus.verify.aot.capture_model`). Unlike :func:`op_count` (the CPU path, whose sorted MoE
    runs ops per expert) nothing here grows with the experts."""
    tiny = _tiny(setup)
    tiny = replace(tiny, dims=tuple({**dict(tiny.dims), "backend": "triton"}.items()))
    launches = []
    with aot.capture_model("model", launches):
        it = _Iteration(tiny, bf16=True)
        it.run()
        launches.clear()
        aten = _profiled_ops(it)
    return int(aten) + len(launches)


def clock_ops(cfg, rows: int = 256) -> dict[str, int]:
    """Kernel launches of one block's Kuramoto clock, forward + backward, on [rows, N] phases:
    as plain autograd (the reference), on the fused PyTorch path (hand-written RK4 backward) and
    on the Triton path (its ATen ops plus its kernels, captured on CPU instead of run)."""
    def count(backend: str) -> int:
        g = torch.Generator().manual_seed(0)
        args = [torch.randn(s, generator=g).requires_grad_()
                for s in ((rows, cfg.n_oscillators), (cfg.n_oscillators,), (cfg.n_oscillators, cfg.coupling_rank),
                          (cfg.coupling_rank,))]
        launches = []
        with (aot.capture(kuramoto_op, "kuramoto", torch.float32, launches), aot.triton_on_cpu(ops_backend),
              _quiet_native_stderr()):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                psi = kuramoto_op.kuramoto_phase(*args, cfg.kuramoto_dt, cfg.kuramoto_steps, cfg.kuramoto_damping,
                                                 backend=backend)
                psi.sum().backward()
        return launched_ops(prof.events()) + len(launches)
    return {backend: count(backend) for backend in ("reference", "torch", "triton")}


def breakdown_rows(name: str, setup: Setup, iters: int = 5, prof_iters: int = 3,
                   device: str = "cpu", bf16: bool = False) -> list[dict]:
    """Rows {config, table, component, ms, pct} of both tables for one configuration: phases
    (unprofiled, % of the iteration) and forward components (profiled, % of the forward)."""
    ph = phase_times(setup, iters=iters, device=device, bf16=bf16)
    fc = forward_components(setup, iters=prof_iters, device=device, bf16=bf16)
    rows = [{"config": name, "table": "phase", "component": p, "ms": ph[p], "pct": 100 * ph[p] / ph["total"]}
            for p in PHASES]
    rows.append({"config": name, "table": "phase", "component": "total", "ms": ph["total"], "pct": 100.0})
    fwd = sum(fc[c] for c in COMPONENTS)
    rows += [{"config": name, "table": "forward", "component": c, "ms": fc[c], "pct": 100 * fc[c] / fwd}
             for c in COMPONENTS]
    rows.append({"config": name, "table": "forward", "component": "forward (profiled)", "ms": fwd,
                 "pct": 100.0})
    rows.append({"config": name, "table": "profiled", "component": "ops per iteration",
                 "ms": float("nan"), "pct": float("nan"), "count": fc["ops"]})
    for p in PHASES:
        rows.append({"config": name, "table": "profiled", "component": p, "ms": fc[p],
                     "pct": float("nan")})
    return rows


def gpu_setups(cuda: bool) -> list[tuple[str, Setup]]:
    """The configurations :func:`gpu_rows` profiles: palier0 and palier2 at B=8, C=32, tied
    8192-word head, sparse MoE, fused cross-entropy (smoke dims off CUDA)."""
    dims = () if cuda else tuple(SMOKE_DIMS.items())
    return [(preset, Setup(preset=preset, vocab_size=8192, tie_head=True, sparse_moe=True, chunk_len=32,
                           batch_size=8, fused_ce=True, dims=dims)) for preset in ("palier0", "palier2")]


def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """Both tables for :func:`gpu_setups` (AdamW, bf16) on CUDA, for the GPU suite →
    results/gpu/profile.csv, a preset at a time. With ``smoke`` (or without CUDA): CPU, smoke
    dims, fp32."""
    cuda = torch.cuda.is_available() and not smoke
    for preset, r in gpu_setups(cuda):
        yield from breakdown_rows(preset, r, iters=5 if cuda else 1, prof_iters=3 if cuda else 1,
                                  device="cuda" if cuda else "cpu", bf16=cuda)
