"""One harness for the op benchmarks: each benchmark is declared as data (:class:`Bench`), and one
function (:func:`run`) measures every declaration into rows of one schema (:data:`COLUMNS`).

A declaration names the op and its case, the x axis (its name and values: a sequence length, a
token count), the providers (the implementations compared: ``triton``, ``torch``, ``reference``,
``fla``, ``liger``, …), the modes (``fwd``, ``fwd+bwd``, ``decode``), the metrics (``time``,
``memory``), the baseline provider, the fixed shape and dtype, how to time (:class:`Timing`), and
the targets (:class:`Target`). What runs is the declaration's: ``setup(x)`` builds the inputs at
x, ``call(provider, mode, inputs)`` returns the timed call.

Each measured point (provider, x, mode) gives rows: ``time`` (seconds), ``memory`` (peak bytes: on
CUDA the allocator's peak above what was allocated before the call; on CPU the rise of a fresh
process's resident high-water mark, :func:`fractus.bench.common.cpu_peak_bytes`), the rates
derived from the compared time (``tflops``: the declaration's model FLOPs, ``gbps``: its compulsory
bytes) and the declaration's checks (``rel_err…``: the output against a truth, named in
``baseline``). A point that fails, or a provider that is absent, is one ``time`` row with the
reason in ``note``.

Ratios: ``ratio_vs_baseline`` is a point's value over the baseline provider's at the same x and
mode (time and memory; memory over at least one byte), of the statistic named in ``compared``
(``median``, or ``low`` where a declaration compares best rounds). Where the declaration does not
measure the baseline provider at that x (``only``), the point is compared with its own provider at
the first x: a scaling check, ``baseline`` reading e.g. ``torch@T=1024``.

On CPU, a point timed alone is :func:`fractus.bench.common.call_times`' ``reps`` calls after
``warmup``; the points of the providers in ``Timing.interleave`` are timed together in
``Timing.rounds`` alternating rounds (:func:`fractus.bench.common.interleaved_times`), after the
points timed alone. On CUDA every point is ``triton.testing.do_bench``'s median, whose own
repetitions are not reported (``low``, ``high`` and ``rounds`` empty).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from fractus.bench import common

# The one schema of every op benchmark's rows (the CSV adds the provenance columns).
COLUMNS = ("op", "case", "provider", "mode", "metric", "unit", "x_name", "x_value", "shape", "dtype", "threads",
           "median", "low", "high", "rounds", "compared", "baseline", "ratio_vs_baseline", "target", "target_met",
           "note")
UNITS = {"time": "s", "memory": "bytes", "tflops": "TFLOP/s", "gbps": "GB/s"}


@dataclass(frozen=True)
class Timing:
    """How a declaration's points are timed on CPU: ``warmup`` calls first, then ``reps`` timed calls
    of each point alone, except the points of the providers in ``interleave``, timed together in
    ``rounds`` alternating rounds. On CUDA, ``do_bench`` (its own warm-up and repetitions)."""
    warmup: int = 1
    reps: int = 3
    rounds: int = 0
    interleave: tuple[str, ...] = ()


class Results:
    """What a target reads: the measured values of one declaration, seen from one point (its x and
    mode unless given)."""

    def __init__(self, points: dict, x, mode: str):
        self._points, self._x, self._mode = points, x, mode

    def value(self, provider: str, metric: str = "time", x=None, mode: str | None = None) -> float | None:
        """``provider``'s compared statistic of ``metric`` (None when it was not measured)."""
        p = self._points.get((provider, self._x if x is None else x, mode or self._mode))
        return None if p is None else p.compared_value(metric)

    def note(self, provider: str, x=None, mode: str | None = None) -> str | None:
        """Why ``provider``'s point was not measured (its error or absence), None when it was."""
        p = self._points.get((provider, self._x if x is None else x, mode or self._mode))
        return None if p is None else p.note


@dataclass(frozen=True)
class Target:
    """A goal on the ``time`` row of ``provider``'s points (those of ``mode`` and ``x`` when given).
    ``met(results)`` judges it from the measured values (:class:`Results`): True or False, None when
    it cannot (nothing written), or a string saying why it was not measured (``note``). Judged only
    where the point itself was timed."""
    provider: str
    text: str
    met: Callable[[Results], bool | str | None]
    mode: str | None = None
    x: object = None

    def applies(self, provider: str, x, mode: str) -> bool:
        return provider == self.provider and self.mode in (None, mode) and self.x in (None, x)


@dataclass(frozen=True)
class Bench:
    """One op benchmark, declared: what is measured, on what, and against what (see the module's
    docstring). ``setup(x)`` returns the inputs every provider at x runs on; ``call(provider, mode,
    inputs)`` a thunk doing one call; ``check(provider, mode, inputs, output)`` (in ``check_modes``)
    the output's errors, {metric: value}, against ``check_vs``; ``flops(x, mode)`` and
    ``min_bytes(x, mode)`` a call's model FLOPs and compulsory bytes; ``leaves(inputs)`` the tensors
    whose gradients are freed before a CUDA peak; ``peak_case`` the ``"module:function"`` that
    builds a point's call in a fresh process for its CPU peak (called with ``provider``, ``mode``,
    x by ``x_name`` and ``shape``); ``memory_x`` the x values where memory is measured (all when
    None); ``only(provider, x, mode)`` whether a point is measured; ``absent`` providers not
    measured, with the reason; ``by_provider`` each provider's modes in turn (else each mode's
    providers); ``threads`` the torch threads the CPU timings run on."""
    op: str
    case: str
    x_name: str
    x_values: tuple
    providers: tuple[str, ...]
    setup: Callable[[object], object]
    call: Callable[[str, str, object], Callable[[], object]]
    modes: tuple[str, ...] = ("fwd+bwd",)
    metrics: tuple[str, ...] = ("time",)
    baseline: str | None = None
    shape: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    timing: Timing = Timing()
    compared: str = "median"
    targets: tuple[Target, ...] = ()
    check: Callable[[str, str, object, object], dict[str, float]] | None = None
    check_modes: tuple[str, ...] = ()
    check_vs: str = ""
    flops: Callable[[object, str], float] | None = None
    min_bytes: Callable[[object, str], float] | None = None
    leaves: Callable[[object], Iterable[torch.Tensor]] | None = None
    peak_case: str | None = None
    memory_x: tuple | None = None
    only: Callable[[str, object, str], bool] | None = None
    absent: dict = field(default_factory=dict)
    by_provider: bool = False
    threads: int | None = None

    def measured(self, provider: str, x, mode: str) -> bool:
        return self.only is None or self.only(provider, x, mode)

    def points(self, x) -> list[tuple[str, object, str]]:
        """The (provider, x, mode) measured at ``x``, in the declaration's loop order."""
        pairs = ([(p, m) for p in self.providers for m in self.modes] if self.by_provider else
                 [(p, m) for m in self.modes for p in self.providers])
        return [(p, x, m) for p, m in pairs if self.measured(p, x, m)]


class _Point:
    """One measured point's values: the time's statistics, memory, checks, or why it failed."""

    def __init__(self, bench: Bench):
        self.bench = bench
        self.times: list[float] | None = None  # CPU: every timed call or round
        self.median: float | None = None
        self.memory: float | None = None
        self.checks: dict[str, float] = {}
        self.note: str | None = None

    def compared_value(self, metric: str) -> float | None:
        """The value of ``metric`` that ratios and targets take (the time's statistic in ``compared``)."""
        if metric == "time":
            if self.median is None:
                return None
            return min(self.times) if self.bench.compared == "low" and self.times else self.median
        return self.memory if metric == "memory" else self.checks.get(metric)


def peer(load) -> tuple:
    """A peer library's wrapper for a bench: ``load()`` gives (wrapper, a note naming its version);
    (None, why) when it is not installed or fails at import (e.g. probing the device), so that the
    bench records the reason in its rows instead of failing."""
    try:
        return load()
    except ImportError as exc:
        return None, f"not installed ({exc})"
    except Exception as exc:  # installed but failing at import: recorded
        return None, f"failed at import: {type(exc).__name__}: {exc}"[:300]


def _failure(exc: Exception) -> str:
    if isinstance(exc, ImportError):
        return f"not installed ({exc})"
    return f"error: {type(exc).__name__}: {exc}"[:300]


def _cpu_peaks(bench: Bench, points: list[tuple], values: dict) -> None:
    """Each point's CPU peak, measured in a fresh process before any timing."""
    if bench.device != "cpu" or "memory" not in bench.metrics or bench.peak_case is None:
        return
    for p, x, m in points:
        if p not in bench.absent and (bench.memory_x is None or x in bench.memory_x):
            values[(p, x, m)].memory = common.cpu_peak_bytes(bench.peak_case, provider=p, mode=m,
                                                             **{bench.x_name: x}, **bench.shape)


def _measure(bench: Bench, points: list[tuple], inputs: dict, values: dict) -> tuple[list[tuple], bool]:
    """Time (and check, and on CUDA measure the memory of) ``points``; returns those it measured or
    tried, and whether a failure lost CUDA's context (nothing more can run then: the failed point is
    the last tried)."""
    cuda = torch.device(bench.device).type == "cuda"
    thunks, together = {}, []
    for i, key in enumerate(points):
        p, x, m = key
        v = values[key]
        if p in bench.absent:
            v.note = bench.absent[p]
            continue
        try:
            thunk = thunks[key] = bench.call(p, m, inputs[x])
            if bench.check is not None and m in bench.check_modes:
                v.checks = bench.check(p, m, inputs[x], thunk())
            if p in bench.timing.interleave and not cuda:
                together.append(key)
                continue
            if cuda:
                v.median = common.median_time(thunk, device=bench.device)
            else:
                v.times = common.call_times(thunk, bench.timing.warmup, bench.timing.reps)
                v.median = statistics.median(v.times)
            if cuda and "memory" in bench.metrics:
                v.memory = common.cuda_peak_bytes(thunk, leaves=tuple(bench.leaves(inputs[x])) if bench.leaves else ())
        except Exception as exc:  # recorded: the other points still run
            v.median, v.note = None, _failure(exc)
            if common.cuda_context_lost(bench.device):  # every later call would fail too
                return points[:i + 1], True
            if cuda:
                torch.cuda.empty_cache()
    if together:
        runs = common.interleaved_times([thunks[k] for k in together], bench.timing.rounds, bench.timing.warmup)
        for key, ts in zip(together, runs):
            values[key].times, values[key].median = ts, statistics.median(ts)
    return points, False


def _baseline(bench: Bench, provider: str, x, mode: str, values: dict) -> tuple[str, object] | None:
    """(label, the baseline's point) of a point: the baseline provider at its x and mode, or, where
    the declaration does not measure that, its own provider at the first x."""
    if bench.baseline is None:
        return None
    if bench.measured(bench.baseline, x, mode):
        return bench.baseline, values.get((bench.baseline, x, mode))
    x0 = bench.x_values[0]
    return f"{provider}@{bench.x_name}={x0}", values.get((provider, x0, mode))


def _rows(bench: Bench, key: tuple, values: dict, threads: int | None) -> list[dict]:
    """One point's rows: its time (with its targets, or why it was not measured), its memory, the
    rates derived from the compared time, its checks."""
    p, x, m = key
    v = values[key]
    meta = dict(op=bench.op, case=bench.case or None, provider=p, mode=m, x_name=bench.x_name, x_value=x,
                shape=" ".join(f"{k}={val}" for k, val in bench.shape.items()), dtype=common.dtype_name(bench.dtype),
                threads=threads, compared=bench.compared)
    time_row = dict(meta, metric="time", unit=UNITS["time"], median=v.median, rounds=None)
    if v.times is not None:
        time_row.update(low=min(v.times), high=max(v.times), rounds=len(v.times))
    rows = [time_row]
    if v.median is not None and v.memory is not None:
        rows.append(dict(meta, metric="memory", unit=UNITS["memory"], median=v.memory, rounds=1))
    base = _baseline(bench, p, x, m, values)
    if base is not None:
        label, b = base
        for row in rows:
            row["baseline"] = label
            ours, theirs = v.compared_value(row["metric"]), None if b is None else b.compared_value(row["metric"])
            if ours is not None and theirs is not None:
                row["ratio_vs_baseline"] = ours / (max(theirs, 1) if row["metric"] == "memory" else theirs)
    for t in bench.targets:
        if t.applies(p, x, m):
            time_row["target"] = t.text
            if v.median is not None:
                met = t.met(Results(values, x, m))
                if isinstance(met, str):
                    time_row["note"] = f"target not measured: {met}"
                elif met is not None:
                    time_row["target_met"] = bool(met)
    if v.note is not None:
        time_row["note"] = v.note
    if v.median is not None:
        seconds = v.compared_value("time")
        for metric, count, scale in (("tflops", bench.flops, 1e12), ("gbps", bench.min_bytes, 1e9)):
            if count is not None:
                rows.append(dict(meta, metric=metric, unit=UNITS[metric], median=count(x, m) / seconds / scale))
        rows += [dict(meta, metric=name, unit="", median=err, rounds=1, baseline=bench.check_vs)
                 for name, err in v.checks.items()]
    return [{c: row.get(c) for c in COLUMNS} for row in rows]


def run(benches: Iterable[Bench]) -> Iterator[dict]:
    """Every declaration's rows (:data:`COLUMNS`), yielded an x at a time (a declaration that
    interleaves providers across its x values at once); after a failure that loses CUDA's context,
    the rows measured so far and nothing more."""
    for bench in benches:
        values: dict = {}
        groups = ([list(bench.x_values)] if bench.timing.interleave else [[x] for x in bench.x_values])
        all_points = [pt for x in bench.x_values for pt in bench.points(x)]
        for key in all_points:
            values[key] = _Point(bench)
        _cpu_peaks(bench, all_points, values)
        saved = torch.get_num_threads()
        if bench.threads is not None:
            torch.set_num_threads(bench.threads)
        try:
            for xs in groups:
                points = [pt for x in xs for pt in bench.points(x)]
                inputs = {x: bench.setup(x) for x in xs}
                done, lost = _measure(bench, points, inputs, values)
                threads = torch.get_num_threads() if torch.device(bench.device).type == "cpu" else None
                del inputs
                yield from (row for key in done for row in _rows(bench, key, values, threads))
                if lost:
                    return
        finally:
            if bench.threads is not None:
                torch.set_num_threads(saved)
