"""Multi-level causal linear attention benchmark.

CPU (fp32): (a) the chunked PyTorch path vs the token-by-token reference; (b) the chunked path
vs the materialising formulation (cumulative sum of [B, T, H, D, D] outer products) at B=1,
T=1024, H=16, D=64, one level, no decay: forward+backward time and peak RSS; targets ≥ 30×
faster and ≤ 1/4 of the memory; and chunked time(T=4096) / time(T=1024) ≤ 4.5 (linear in T).
GPU (bf16): the recurrences the models run (:data:`fractus.verify.cases.RECURRENCES`: the
default's multiscale decay per (level, head), fixed, and the original's none, both with the carried state and the
denominator), forward and forward+backward at B=8, T ∈ {512, 2048, 8192}, 2 levels × 20 heads
(40 level·heads), D=64: Triton vs the PyTorch chunked path (fp32 inside) and
flash-linear-attention's ``chunk_simple_gla`` when importable (on the same featured q and k, the
same decay and initial state: :func:`fractus.verify.cases.fla_attention`; also on the numerator
alone, ``fla_numerator``, fla's kernels at their own width: a bound on its cost), each forward's
output compared with the PyTorch path's; target: the default's forward+backward within 1.25× of
fla's on the same recurrence at T=2048. Decode step (B=1, T=1, each recurrence): Triton vs the PyTorch path, target ≥ 10× (the
default's). Each timing has derived TFLOP/s (model FLOPs) and GB/s (compulsory traffic).
Forward+backward also times the Triton backward on chunks of 64 (``triton_bwd64``) against its
default 32, chosen ahead of time for register pressure (``python -m fractus.bench aot``): the
first GPU run says which is faster.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fractus.bench import common
from fractus.ops.linear_attention import linear_attention
from fractus.model import level_omegas
from fractus.verify import cases
from fractus.verify.cases import attention_case

CPU_THREADS = 1  # CPU timings on one thread: OpenMP threads on busy cores make timings erratic
SMOKE_GPU = dict(B=1, H=2, D=32, levels=2)  # the dry run's shape (Triton's interpreter on CPU), at T=40


def materialising(q, k, v, w, oms, eps=1e-6):
    """The naive formulation (no decay, zero initial state): S_t = cumsum of the [B, T, H, D, D]
    outer products f(k)vᵀ, z_t = cumsum f(k), y = f(q)S_t / (f(q)·z_t + eps), in fp32."""
    q, k, v = q.float(), k.float(), v.float()
    o = 0.0
    for l, om in enumerate(oms):
        fq, fk = F.elu(q + om) + 1, F.elu(k + om) + 1
        S = torch.cumsum(fk[..., :, None] * v[..., None, :], dim=1)
        z = torch.cumsum(fk, dim=1)
        num = torch.einsum("bthd,bthde->bthe", fq, S)
        o = o + w[l] * num / ((fq * z).sum(-1, keepdim=True) + eps)
    return o


def _fwd_bwd(impl, q, k, v, w):
    """The CPU rows' forward+backward from a zero state without decay: the PyTorch path or the
    materialising formulation."""
    if impl == "materialising":
        cases.fwd_bwd(lambda: materialising(q, k, v, w, level_omegas(w.numel())), (q, k, v, w))
    else:
        cases.attention_fwd_bwd(impl, q, k, v, w)


def peak_case(impl, B, T, H, D, levels):
    """For cpu_peak_bytes: inputs, then a forward+backward thunk."""
    q, k, v, w, _, _ = attention_case(B, T, H, D, levels)
    return lambda: _fwd_bwd(impl, q, k, v, w)


# ----------------------------------------------------------------------------- CPU
def cpu_rows(smoke: bool = False) -> list[dict]:
    """(a) chunked vs reference; (b) chunked vs materialising + the T-scaling check (fp32); peak
    RSS of each in a fresh process. Timings run on CPU_THREADS threads (OpenMP threads on busy cores
    make timings erratic)."""
    b = dict(B=1, T=256, H=2, D=16) if smoke else dict(B=1, T=1024, H=16, D=64)
    peaks = {impl: common.cpu_peak_bytes("fractus.bench.linear_attention:peak_case", impl=impl, **b, levels=1)
             for impl in ("torch", "materialising")}
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        return _cpu_timings(smoke, b, peaks)
    finally:
        torch.set_num_threads(threads)


def _cpu_timings(smoke, b, peaks):
    reps = dict(warmup=1, reps=2 if smoke else 3)
    common_cols = dict(bench="linear_attention", mode="fwd+bwd", dtype=common.dtype_name(torch.float32),
                       threads=CPU_THREADS)
    rows = []
    # (a) chunked PyTorch path vs the token-by-token reference, 2 levels with decay
    a = dict(B=1, T=64, H=2, D=32) if smoke else dict(B=1, T=512, H=4, D=64)
    q, k, v, w, g, _ = attention_case(**a, levels=2, decay=True)
    times = {impl: common.median_time(lambda impl=impl: cases.attention_fwd_bwd(impl, q, k, v, w, g), **reps)
             for impl in ("torch", "reference")}
    for impl in ("torch", "reference"):
        rows.append(dict(common_cols, case="vs_reference", impl=impl, **a, levels=2, decay=True,
                         time_s=times[impl], speedup_vs_baseline=times["reference"] / times[impl],
                         baseline="reference"))
    del q, k, v, w, g
    # (b) chunked vs materialising at T=1024, D=64, 16 heads, B=1, one level
    q, k, v, w, _, _ = attention_case(**b, levels=1)
    tm_ = common.median_time(lambda: _fwd_bwd("materialising", q, k, v, w), **reps)
    # linear in T: the chunked path at T and 4·T, timed alternately (the shared machine's load
    # drifts; interleaving exposes both sizes to the same drift)
    b4 = dict(b, T=4 * b["T"])
    q4, k4, v4, w4, _, _ = attention_case(**b4, levels=1)
    tc, t4 = (statistics.median(ts) for ts in common.interleaved_times(
        [lambda: _fwd_bwd("torch", q, k, v, w), lambda: _fwd_bwd("torch", q4, k4, v4, w4)],
        rounds=3 if smoke else 7))
    times = {"torch": tc, "materialising": tm_}
    pc, pm = peaks["torch"], peaks["materialising"]
    for impl in ("torch", "materialising"):
        row = dict(common_cols, case="vs_materialising", impl=impl, **b, levels=1, decay=False,
                   time_s=times[impl], peak_rss_bytes=peaks[impl], speedup_vs_baseline=tm_ / times[impl],
                   mem_vs_baseline=peaks[impl] / max(pm, 1), baseline="materialising")
        if impl == "torch":
            row["target"] = "speedup >= 30x and memory <= 1/4 of materialising"
            row["target_met"] = tm_ / tc >= 30 and 0 < pc <= pm / 4
        rows.append(row)
    rows.append(dict(common_cols, case="T_scaling", impl="torch", **b4, levels=1, decay=False,
                     time_s=t4, baseline=f"torch at T={b['T']}", time_ratio_vs_baseline=t4 / tc,
                     target="time(4T)/time(T) <= 4.5", target_met=t4 / tc <= 4.5))
    return rows


# ----------------------------------------------------------------------------- GPU
def _flops(B, T, H, D, levels, backward=False):
    """Model FLOPs: the recurrent form's 4·D·(D + 1) per token and level·head (state update, q·S,
    the denominator), the backward 2× the forward; a chunked kernel does more (intra-chunk products)."""
    return (3 if backward else 1) * 4 * D * (D + 1) * B * T * H * levels


def _min_bytes(B, T, H, D, levels, elt, backward=False, state=False):
    """Compulsory traffic: q, k, v read and o written once (the levels share them; the backward
    also reads q, k, v, dO and writes dq, dk, dv); ``state``: the fp32 (S, z) read and written."""
    return (11 if backward else 4) * B * T * H * D * elt + (8 * B * levels * H * D * (D + 1) if state else 0)


def _fla_status():
    """(fla's wrapper or None, a note saying which fla it is or why it is absent)."""
    try:
        return cases.fla_attention()
    except ImportError as exc:
        return None, f"not installed ({exc})"
    except Exception as exc:  # installed but failing at import (e.g. probing the device): recorded
        return None, f"failed at import: {type(exc).__name__}: {exc}"[:300]


def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """bf16 timings on CUDA (smoke: tiny, Triton's interpreter on CPU), yielded a comparison at a
    time: per recurrence and length, the forward and then the forward+backward of every
    implementation; then each recurrence's decode step. After a failure that loses CUDA's
    context, the rows so far are yielded and nothing more runs."""
    device, shape, Ts = ("cpu", SMOKE_GPU, (40,)) if smoke else ("cuda", cases.ATTENTION_GPU, cases.ATTENTION_TS)
    timer = (lambda f: common.median_time(f, warmup=1, reps=2, device=device)) if smoke else \
        (lambda f: common.median_time(f, device=device))
    fla, fla_note = _fla_status()
    for recurrence in cases.RECURRENCES:
        for T in Ts:
            inputs = cases.timed_attention(recurrence, T=T, dtype=torch.bfloat16, device=device, **shape)
            with torch.no_grad():  # fp32 inside: the outputs' agreement is judged against it
                truth = {n: cases.attention("torch", *inputs, normalize=n) for n in (True, False)}
            for mode in ("fwd", "fwd+bwd"):
                meta = dict(bench="linear_attention", kind=recurrence, mode=mode,
                            dtype=common.dtype_name(torch.bfloat16), T=T, **shape)
                ours = ("triton", "triton_bwd64", "torch") if mode == "fwd+bwd" else ("triton", "torch")
                rows = [_timed_row(impl, inputs, truth[impl != "fla_numerator"], timer, meta,
                                   fla_note if impl.startswith("fla") and fla is None else None)
                        for impl in ours + ("fla", "fla_numerator")]
                _compare(rows, recurrence == cases.RECURRENCES[0] and mode == "fwd+bwd" and T == Ts[len(Ts) // 2],
                         fla_note if fla is None else "failed")
                yield from rows
                if any("note" in r for r in rows) and common.cuda_context_lost(device):
                    return  # every later call would fail too
    for recurrence in cases.RECURRENCES:
        yield from _decode_rows(recurrence, shape, timer, device)


def _timed_row(impl, inputs, truth, timer, meta, absent=None) -> dict:
    """One implementation timed on ``inputs`` in ``meta["mode"]``, its forward's output compared
    with ``truth`` (a failure is a row with its error, as is a baseline that is ``absent``)."""
    row = dict(meta, impl=impl)
    if absent is not None:
        return dict(row, note=absent)
    B, T, H, D, Lv = (meta[k] for k in ("B", "T", "H", "D", "levels"))
    q = inputs[0]
    backward = meta["mode"] == "fwd+bwd"
    try:
        if backward:
            def thunk():
                cases.attention_fwd_bwd(impl, *inputs)
        else:
            def thunk():
                with torch.no_grad():
                    return cases.attention(impl, *inputs)
            row["rel_err_vs_torch"] = common.rel_err(thunk(), truth)
        tm = timer(thunk)
        row.update(time_s=tm, tflops=_flops(B, T, H, D, Lv, backward) / tm / 1e12,
                   gbps=_min_bytes(B, T, H, D, Lv, q.element_size(), backward, state=True) / tm / 1e9)
        if q.is_cuda:
            row["peak_bytes"] = common.cuda_peak_bytes(thunk, leaves=(*inputs[:4], *inputs[5]))
    except Exception as exc:  # a baseline failing (out of memory, fla on CPU) is recorded
        row["note"] = f"error: {type(exc).__name__}: {exc}"[:300]
        if q.is_cuda and not common.cuda_context_lost(q.device):
            torch.cuda.empty_cache()
    return row


def _compare(rows: list[dict], target: bool, fla_missing: str) -> None:
    """Each timed row's speedups over the PyTorch path and fla's (on the whole recurrence, and on
    its numerator alone); ``target``: the Triton row's target (forward+backward within 1.25× of
    fla's time on the same recurrence), not measured, for ``fla_missing``'s reason, when fla was
    not timed."""
    timed = {r["impl"]: r["time_s"] for r in rows if "time_s" in r}
    for r in rows:
        if "time_s" in r:
            r.update({f"speedup_vs_{other}": timed[other] / r["time_s"]
                      for other in ("torch", "fla", "fla_numerator") if other in timed and other != r["impl"]})
        if target and r["impl"] == "triton":
            r["target"] = f"fwd+bwd <= 1.25x fla's time at T={r['T']}"
            if "time_s" in r and "fla" in timed:
                r["target_met"] = r["time_s"] <= 1.25 * timed["fla"]
            elif "time_s" in r:
                r["note"] = f"target not measured: fla {fla_missing}"


def _decode_rows(recurrence: str, shape: dict, timer, device) -> list[dict]:
    """The decode step (B=1, T=1, the carried state, no autograd): Triton vs the PyTorch path; the
    default recurrence's Triton row carries the target (≥ 10×)."""
    q, k, v, w, g, st = cases.timed_attention(recurrence, 1, 1, shape["H"], shape["D"], shape["levels"],
                                              device=device, grad=False)
    H, D, Lv = shape["H"], shape["D"], shape["levels"]
    dec, rows = {}, []
    for impl in ("triton", "torch"):
        def thunk(impl=impl):
            with torch.no_grad():
                linear_attention(q, k, v, w, level_omegas(Lv), g, st, cases.EPS, backend=impl)
        row = dict(bench="linear_attention", kind=recurrence, dtype=common.dtype_name(q.dtype), B=1, T=1, H=H,
                   levels=Lv, D=D, mode="decode", impl=impl)
        try:
            tm = dec[impl] = timer(thunk)
            row.update(time_s=tm, tflops=_flops(1, 1, H, D, Lv) / tm / 1e12,
                       gbps=_min_bytes(1, 1, H, D, Lv, q.element_size(), state=True) / tm / 1e9)
        except Exception as exc:  # recorded: the rows above are kept
            row["note"] = f"error: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    for row in rows:
        if "time_s" in row and "torch" in dec:
            row["speedup_vs_torch"] = dec["torch"] / row["time_s"]
        if row["impl"] == "triton" and recurrence == cases.RECURRENCES[0]:
            row["target"] = "decode >= 10x the PyTorch path"
            if "speedup_vs_torch" in row:
                row["target_met"] = row["speedup_vs_torch"] >= 10
    return rows


# ----------------------------------------------------------------------------- correctness
NAMES = ("o", "S", "z", "dq", "dk", "dv", "dw", "dS0", "dz0")


def _outputs(backend, inputs, dtype, grad, loss_mean=0.0, normalize=True):
    """Run on copies in dtype (state, weights, decay fp32; fp64 for the truth): o, S, z (+ grads of
    q, k, v, w, a decay per position, S0, z0 for a fixed random loss on o, S and z with a state, on
    o alone without (training's), its weights drawn around loss_mean); ``normalize=False``: the
    attention without its denominator."""
    q, k, v, w, g, st = inputs
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    per_position = g is not None and g.dim() > 2
    leaves = [x.detach().to(dtype).requires_grad_(grad) for x in (q, k, v)]
    leaves += [w.detach().to(sdt).requires_grad_(grad)]
    decay = None if g is None else g.detach().to(sdt).requires_grad_(grad and per_position)
    leaves += [decay] if per_position else []
    states = [x.detach().to(sdt).requires_grad_(grad) for x in st or ()]
    leaves += states
    with torch.set_grad_enabled(grad):
        o, (S, z) = linear_attention(*leaves[:4], level_omegas(w.numel()), decay, tuple(states) or None,
                                     backend=backend, normalize=normalize)
    outs = [o, S, z]
    if grad:
        gen = torch.Generator().manual_seed(1)
        loss = sum((x.double() * (loss_mean + torch.randn(x.shape, generator=gen, dtype=torch.float64))
                    .to(x.device)).sum() for x in (outs if st else outs[:1]))
        outs += list(torch.autograd.grad(loss, leaves))
    return outs


def correctness_rows(device, smoke: bool = False) -> Iterator[dict]:
    """Triton (chunked with gradients, and the decode kernel) vs the reference run in fp64 on the
    same rounded inputs, with decay and a random state, without decay after a long history with v
    around a mean (training's carried state, where dq cancels: see the kernels' note on the state
    dots), and over one long call from no state with v and dO around a mean (the numerator and
    the denominator must round alike). fp32: rel_err < 1e-4 (over the long call, like low
    precision with a margin of 1e-4: fp32 accumulation alone errs by ~1e-4 there). bf16 (on CPU
    through the interpreter, which :mod:`fractus.verify.interpret` makes round it as a GPU does):
    rel_err ≤ that of the PyTorch path in bf16 + 1e-2 (dw, a sum of B·T·H·D mostly cancelling
    terms, 3e-2). The interpreter's bf16 exceeds the PyTorch path's error at these sizes by at most
    3.6e-3 (dq over the long call), dw by 1.7e-2 (T = 300). A decay per (level, head) runs with the
    denominator and without it; a decay per position (the decay gate) from no state, its gradient
    checked too. Recorded, never raised; yielded a case
    and dtype at a time."""
    device = torch.device(device)
    random_state, carried = dict(decay=True, state=True), dict(history=1024 if smoke else 16384, v_mean=1.0)
    per_level, unnormalized = dict(decay="level", state=True), dict(decay="level", state=True, normalize=False)
    gated = dict(decay="position")  # the decay gate's: from no state, the loss on o (training's)
    one_call = dict(v_mean=1.0, loss_mean=3.0)
    if smoke:
        checks = [("chunked", dict(B=2, T=40, H=2, D=48, **random_state), True),
                 ("chunked", dict(B=1, T=40, H=2, D=32, **carried), True),
                 ("chunked", dict(B=1, T=160, H=1, D=32, **one_call), True),
                 ("chunked", dict(B=2, T=40, H=2, D=32, **per_level), True),
                 ("chunked", dict(B=2, T=40, H=2, D=32, **unnormalized), True),
                 ("chunked", dict(B=2, T=40, H=2, D=32, **gated), True),
                 ("decode", dict(B=2, T=1, H=2, D=32, **random_state), False),
                 ("decode", dict(B=2, T=3, H=2, D=32, state=True, **gated), False),
                 ("decode", dict(B=2, T=1, H=2, D=32, **unnormalized), False)]
    else:
        checks = [("chunked", dict(B=2, T=300, H=3, D=48, **random_state), True),
                 ("chunked", dict(B=2, T=200, H=2, D=64, **random_state), True),
                 ("chunked", dict(B=2, T=200, H=2, D=64, **carried), True),
                 ("chunked", dict(B=1, T=2048, H=2, D=64, **one_call), True),
                 ("chunked", dict(B=2, T=300, H=3, D=64, **per_level), True),
                 ("chunked", dict(B=2, T=300, H=3, D=64, **unnormalized), True),
                 ("chunked", dict(B=2, T=300, H=3, D=64, **gated), True),
                 ("decode", dict(B=2, T=1, H=3, D=64, **random_state), False),
                 ("decode", dict(B=2, T=7, H=3, D=64, state=True, **gated), False),
                 ("decode", dict(B=2, T=7, H=3, D=48, **random_state), False),
                 ("decode", dict(B=2, T=1, H=3, D=64, **unnormalized), False)]
    for kind, shape, grad in checks:
        shape = dict(shape)
        loss_mean, normalize = shape.pop("loss_mean", 0.0), shape.pop("normalize", True)
        for dtype in (torch.float32, torch.bfloat16):
            after = f" after {shape['history']} tokens" if "history" in shape else ""
            if loss_mean:
                after += f" one call v/dO means {shape['v_mean']:g}/{loss_mean:g}"
            if shape.get("decay") == "level":
                after += " decay per level" + ("" if normalize else ", no denominator")
            if shape.get("decay") == "position":
                after += " decay per position"
            kernel = f"linear_attention[{kind} T={shape['T']} D={shape['D']}{after}]"
            try:
                inputs = attention_case(**shape, levels=2, dtype=dtype, device=device, grad=False)
                got = _outputs("triton", inputs, dtype, grad, loss_mean, normalize)
                truth = _outputs("reference", inputs, torch.float64, grad, loss_mean, normalize)
                # fp32 over one long call errs by ~1e-4 on every path (the fp32 reference by 1.3e-4)
                lowp_rule = dtype != torch.float32 or loss_mean
                same = _outputs("torch", inputs, dtype, grad, loss_mean, normalize) if lowp_rule else None
                margin = 1e-2 if dtype == torch.bfloat16 else 1e-4
                names = NAMES[:7] + ("ddecay",) + NAMES[7:] if shape.get("decay") == "position" else NAMES
                yield from common.check_rows(kernel, dtype, names[:len(got)], got, truth, same, margin,
                                             margins={"dw": 3 * margin}, truth_name="fp64 reference")
            except Exception as exc:  # recorded, not raised
                yield common.error_row(kernel, dtype, exc)
