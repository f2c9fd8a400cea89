"""Multi-level causal linear attention benchmark.

CPU (fp32): (a) the chunked PyTorch path vs the token-by-token reference; (b) the chunked path
vs the materialising formulation (cumulative sum of [B, T, H, D, D] outer products) at B=1,
T=1024, H=16, D=64, one level, no decay: forward+backward time and peak RSS; targets ≥ 30×
faster and ≤ 1/4 of the memory; and chunked time(T=4096) / time(T=1024) ≤ 4.5 (linear in T).
GPU (bf16): forward and forward+backward at B=8, T ∈ {512, 2048, 8192}, 2 levels × 20 heads
(40 level·heads), D=64: Triton vs the PyTorch chunked path (fp32 inside), fla's
chunk_linear_attn when importable (levels folded into heads, feature maps included, normalised by
fla itself), and the materialising formulation where it fits, each forward's output compared with
the PyTorch path's; target: forward+backward within 1.25× of fla's at T=2048. Decode step (B=1,
T=1): Triton vs the PyTorch path, target ≥ 10×. Each timing has derived TFLOP/s (model FLOPs) and
GB/s (compulsory traffic). Forward+backward also times the Triton backward on chunks of 64
(``triton_bwd64``) against its default 32, chosen ahead of time for register pressure
(``python -m fractus.bench aot``): the first GPU run says which is faster.
"""
from __future__ import annotations

import contextlib
import functools
import statistics

import torch
import torch.nn.functional as F

from fractus.bench import common
from fractus.kernels import linear_attention as la_kernels
from fractus.kernels.linear_attention import linear_attention
from fractus.model import level_omegas

CPU_THREADS = 1  # CPU timings on one thread: OpenMP threads on busy cores make timings erratic


GPU_TS = (512, 2048, 8192)  # sequence lengths the GPU suite times, in bf16 at GPU_SHAPE
GPU_SHAPE = dict(B=8, H=20, D=64, levels=2)  # 40 level·heads


def make_inputs(B, T, H, D, levels=2, decay=False, state=False, dtype=torch.float32,
                device="cpu", grad=True, seed=0, history=0, v_mean=0.0):
    """q, k, v [B, T, H, D] in dtype, level weights [Lv], decay [H] (``decay="level"``: [Lv, H], one
    per level and head, as the default model has) or None, state or None;
    the floating leaves require grad when grad=True (state and weights in fp32). With ``history``
    the state is the one that many earlier tokens leave without decay (training's carried state),
    v of those and of the call drawn around ``v_mean``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(x, dt=dtype):
        return x.to(device=device, dtype=dt).requires_grad_(grad)
    q, k = (leaf(torch.randn(B, T, H, D, generator=gen)) for _ in range(2))
    v = leaf(v_mean + torch.randn(B, T, H, D, generator=gen))
    w = leaf(torch.softmax(torch.randn(levels, generator=gen), 0), torch.float32)
    g = (torch.rand(*((levels, H) if decay == "level" else (H,)), generator=gen) * 0.3 + 0.65).to(device) \
        if decay else None
    st = None
    if history:
        kh = torch.randn(B, history, H, D, generator=gen).to(dtype).double()
        vh = (v_mean + torch.randn(B, history, H, D, generator=gen)).to(dtype).double()
        fk = torch.stack([F.elu(kh + om) + 1 for om in level_omegas(levels)], 1)  # [B, Lv, N, H, D]
        st = (leaf(torch.einsum("blnhd,bnhe->blhde", fk, vh), torch.float32), leaf(fk.sum(2), torch.float32))
    elif state:
        st = (leaf(0.5 * torch.randn(B, levels, H, D, D, generator=gen), torch.float32),
              leaf(torch.rand(B, levels, H, D, generator=gen) * 2 + 1, torch.float32))
    return q, k, v, w, g, st


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


@functools.lru_cache(maxsize=None)
def _fla_fn():
    """fla's chunk_linear_attn wrapped to our math: feature maps per level, levels folded into
    heads, normalised by fla itself (``normalize=True``: a cumulative sum of the keys and a divide,
    in the inputs' dtype, eps 1e-10); returns (fn(q, k, v, w, oms) -> o, note)."""
    from fla.ops.linear_attn import chunk_linear_attn

    def fn(q, k, v, w, oms):
        Lv, H = len(oms), q.shape[2]
        fq = torch.cat([F.elu(q + om) + 1 for om in oms], 2)  # [B, T, Lv·H, D]
        fk = torch.cat([F.elu(k + om) + 1 for om in oms], 2)
        y = chunk_linear_attn(fq, fk, v.repeat(1, 1, Lv, 1), scale=1.0, normalize=True)[0].unflatten(2, (Lv, H))
        return torch.einsum("l,btlhd->bthd", w.to(y.dtype), y)  # levels mixed in the inputs' dtype
    import fla
    return fn, f"fla {getattr(fla, '__version__', '?')} chunk_linear_attn(normalize=True)"


@contextlib.contextmanager
def _backward_chunk(n):
    """The Triton backward's chunk length set to ``n`` for the duration."""
    default, la_kernels._BWD_CHUNK = la_kernels._BWD_CHUNK, n
    try:
        yield
    finally:
        la_kernels._BWD_CHUNK = default


def _run(impl, q, k, v, w, oms):
    """impl ∈ torch / triton / triton_bwd64 / reference / materialising / fla → o, from a zero
    state (triton_bwd64's forward is triton's, see _fwd_bwd)."""
    if impl == "materialising":
        return materialising(q, k, v, w, oms)
    if impl == "fla":
        return _fla_fn()[0](q, k, v, w, oms)
    return linear_attention(q, k, v, w, oms, backend=impl.removesuffix("_bwd64"))[0]


def _fwd_bwd(impl, q, k, v, w, oms):
    for x in (q, k, v, w):
        x.grad = None
    with _backward_chunk(64) if impl == "triton_bwd64" else contextlib.nullcontext():
        _run(impl, q, k, v, w, oms).float().sum().backward()


def peak_case(impl, B, T, H, D, levels):
    """For cpu_peak_bytes: inputs, then a forward+backward thunk."""
    q, k, v, w, _, _ = make_inputs(B, T, H, D, levels)
    oms = level_omegas(levels)
    return lambda: _fwd_bwd(impl, q, k, v, w, oms)


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
    q, k, v, w, g, _ = make_inputs(**a, levels=2, decay=True)
    oms = level_omegas(2)
    times = {}
    for impl in ("torch", "reference"):
        def thunk(impl=impl):
            for x in (q, k, v, w):
                x.grad = None
            linear_attention(q, k, v, w, oms, g, backend=impl)[0].sum().backward()
        times[impl] = common.median_time(thunk, **reps)
    for impl in ("torch", "reference"):
        rows.append(dict(common_cols, case="vs_reference", impl=impl, **a, levels=2, decay=True,
                         time_s=times[impl], speedup_vs_baseline=times["reference"] / times[impl],
                         baseline="reference"))
    del q, k, v, w, g
    # (b) chunked vs materialising at T=1024, D=64, 16 heads, B=1, one level
    q, k, v, w, _, _ = make_inputs(**b, levels=1)
    oms = level_omegas(1)
    tm_ = common.median_time(lambda: _fwd_bwd("materialising", q, k, v, w, oms), **reps)
    # linear in T: the chunked path at T and 4·T, timed alternately (the shared machine's load
    # drifts; interleaving exposes both sizes to the same drift)
    b4 = dict(b, T=4 * b["T"])
    q4, k4, v4, w4, _, _ = make_inputs(**b4, levels=1)
    tc, t4 = (statistics.median(ts) for ts in common.interleaved_times(
        [lambda: _fwd_bwd("torch", q, k, v, w, oms), lambda: _fwd_bwd("torch", q4, k4, v4, w4, oms)],
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


def _mat_bytes(B, T, N, D):
    """Rough peak of the materialising forward+backward: ~6 fp32 [B, T, N, D, D] tensors."""
    return 6 * B * T * N * D * D * 4


def gpu_rows(smoke: bool = False) -> list[dict]:
    """bf16 timings on CUDA (smoke: tiny, Triton interpreter on CPU)."""
    dtype = torch.bfloat16
    if smoke:
        device, H, Lv, D, B, Ts = "cpu", 2, 2, 32, 1, (40,)
    else:
        device, H, Lv, D, B, Ts = "cuda", GPU_SHAPE["H"], GPU_SHAPE["levels"], GPU_SHAPE["D"], GPU_SHAPE["B"], GPU_TS
    dname = common.dtype_name(dtype)
    oms = level_omegas(Lv)
    timer = (lambda f: common.median_time(f, warmup=1, reps=2, device=device)) if smoke else \
        (lambda f: common.median_time(f, device=device))
    rows = []
    try:
        fla, fla_note = _fla_fn()
    except ImportError as exc:
        fla, fla_note = None, f"not installed ({exc})"
    except Exception as exc:  # installed but failing at import (e.g. probing the device): recorded
        fla, fla_note = None, f"failed at import: {type(exc).__name__}: {exc}"[:300]
    for T in Ts:
        q, k, v, w, _, _ = make_inputs(B, T, H, D, Lv, dtype=dtype, device=device)
        meta = dict(bench="linear_attention", dtype=dname, B=B, T=T, H=H, levels=Lv, D=D)
        with torch.no_grad():
            truth = _run("torch", q, k, v, w, oms)  # fp32 inside: the outputs' agreement is judged against it
        for mode in ("fwd", "fwd+bwd"):
            timed, first = {}, len(rows)
            impls = ("triton", "triton_bwd64") if mode == "fwd+bwd" else ("triton",)
            for impl in impls + ("torch", "fla", "materialising"):
                row = dict(meta, mode=mode, impl=impl)
                if impl == "fla" and fla is None:
                    rows.append(dict(row, note=fla_note))
                    continue
                if impl == "materialising" and device == "cuda" and \
                        _mat_bytes(B, T, Lv * H, D) > 0.8 * torch.cuda.mem_get_info()[0]:
                    rows.append(dict(row, note=f"skipped: needs ~{_mat_bytes(B, T, Lv * H, D) / 2**30:.0f} GiB"))
                    continue
                try:
                    if mode == "fwd":
                        def thunk(impl=impl):
                            with torch.no_grad():
                                return _run(impl, q, k, v, w, oms)
                        row["rel_err_vs_torch"] = common.rel_err(thunk(), truth)
                    else:
                        def thunk(impl=impl):
                            _fwd_bwd(impl, q, k, v, w, oms)
                    tm = timer(thunk)
                    row["time_s"] = tm
                    row["tflops"] = _flops(B, T, H, D, Lv, mode == "fwd+bwd") / tm / 1e12
                    row["gbps"] = _min_bytes(B, T, H, D, Lv, q.element_size(), mode == "fwd+bwd") / tm / 1e9
                    if device == "cuda":
                        row["peak_bytes"] = common.cuda_peak_bytes(thunk, leaves=(q, k, v, w))
                    if impl == "fla":
                        row["note"] = fla_note
                    timed[impl] = tm
                except Exception as exc:  # a baseline failing (OOM, fla on CPU) is recorded
                    row["note"] = f"error: {type(exc).__name__}: {exc}"[:300]
                    if common.cuda_context_lost(device):  # every later call would fail too
                        return rows + [row]
                    if device == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
            for r in rows[first:]:
                if "time_s" in r:
                    for other in ("torch", "fla", "materialising"):
                        if other in timed and other != r["impl"]:
                            r[f"speedup_vs_{other}"] = timed[other] / r["time_s"]
                if mode == "fwd+bwd" and T == Ts[len(Ts) // 2] and r["impl"] == "triton":
                    r["target"] = f"fwd+bwd <= 1.25x fla's time at T={T}"
                    if "fla" in timed and "time_s" in r:
                        r["target_met"] = r["time_s"] <= 1.25 * timed["fla"]
                    else:
                        r["note"] = f"target not measured: fla {fla_note if fla is None else 'failed'}"
    # decode step: B=1, T=1, carried state, no autograd
    q, k, v, w, g, st = make_inputs(1, 1, H, D, Lv, decay=True, state=True, dtype=dtype,
                                    device=device, grad=False)
    dec, dec_rows = {}, []
    for impl in ("triton", "torch"):
        def thunk(impl=impl):
            with torch.no_grad():
                linear_attention(q, k, v, w, oms, g, st, backend=impl)
        row = dict(bench="linear_attention", dtype=dname, B=1, T=1, H=H, levels=Lv, D=D, mode="decode", impl=impl)
        try:
            tm = dec[impl] = timer(thunk)
            row.update(time_s=tm, tflops=_flops(1, 1, H, D, Lv) / tm / 1e12,
                       gbps=_min_bytes(1, 1, H, D, Lv, q.element_size(), state=True) / tm / 1e9)
        except Exception as exc:  # recorded: the rows above are kept
            row["note"] = f"error: {type(exc).__name__}: {exc}"[:300]
        dec_rows.append(row)
    for row in dec_rows:
        if "time_s" in row and "torch" in dec:
            row["speedup_vs_torch"] = dec["torch"] / row["time_s"]
        if row["impl"] == "triton":
            row["target"] = "decode >= 10x the PyTorch path"
            if "speedup_vs_torch" in row:
                row["target_met"] = row["speedup_vs_torch"] >= 10
    rows += dec_rows
    return rows


# ----------------------------------------------------------------------------- correctness
NAMES = ("o", "S", "z", "dq", "dk", "dv", "dw", "dS0", "dz0")


def _outputs(backend, inputs, dtype, grad, loss_mean=0.0, normalize=True):
    """Run on copies in dtype (state, weights fp32; fp64 for the truth): o, S, z (+ grads of a
    fixed random loss on o, S and z with a state, on o alone without (training's), its weights
    drawn around loss_mean); ``normalize=False``: the attention without its denominator."""
    q, k, v, w, g, st = inputs
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dtype).requires_grad_(grad) for x in (q, k, v)]
    leaves += [w.detach().to(sdt).requires_grad_(grad)]
    leaves += [x.detach().to(sdt).requires_grad_(grad) for x in st or ()]
    with torch.set_grad_enabled(grad):
        o, (S, z) = linear_attention(*leaves[:4], level_omegas(w.numel()), None if g is None else g.to(sdt),
                                     tuple(leaves[4:]) or None, backend=backend, normalize=normalize)
    outs = [o, S, z]
    if grad:
        gen = torch.Generator().manual_seed(1)
        loss = sum((x.double() * (loss_mean + torch.randn(x.shape, generator=gen, dtype=torch.float64))
                    .to(x.device)).sum() for x in (outs if st else outs[:1]))
        outs += list(torch.autograd.grad(loss, leaves))
    return outs


def correctness_rows(device, smoke: bool = False) -> list[dict]:
    """Triton (chunked with gradients, and the decode kernel) vs the reference run in fp64 on the
    same rounded inputs, with decay and a random state, without decay after a long history with v
    around a mean (training's carried state, where dq cancels: see the kernels' note on the state
    dots), and over one long call from no state with v and dO around a mean (the numerator and
    the denominator must round alike). fp32: rel_err < 1e-4 (over the long call, like low
    precision with a margin of 1e-4: fp32 accumulation alone errs by ~1e-4 there). bf16 (on CPU
    through the interpreter, which :mod:`fractus.verify.interpret` makes round it as a GPU does):
    rel_err ≤ that of the PyTorch path in bf16 + 1e-2 (dw, a sum of B·T·H·D mostly cancelling
    terms, 3e-2). The interpreter's bf16 exceeds the PyTorch path's error at these sizes by at most
    3.6e-3 (dq over the long call), dw by 1.7e-2 (T = 300). The default model's setting, a decay per
    (level, head), runs with the denominator and without it. Recorded, never raised."""
    device = torch.device(device)
    random_state, carried = dict(decay=True, state=True), dict(history=1024 if smoke else 16384, v_mean=1.0)
    per_level, unnormalized = dict(decay="level", state=True), dict(decay="level", state=True, normalize=False)
    one_call = dict(v_mean=1.0, loss_mean=3.0)
    if smoke:
        cases = [("chunked", dict(B=2, T=40, H=2, D=48, **random_state), True),
                 ("chunked", dict(B=1, T=40, H=2, D=32, **carried), True),
                 ("chunked", dict(B=1, T=160, H=1, D=32, **one_call), True),
                 ("chunked", dict(B=2, T=40, H=2, D=32, **per_level), True),
                 ("chunked", dict(B=2, T=40, H=2, D=32, **unnormalized), True),
                 ("decode", dict(B=2, T=1, H=2, D=32, **random_state), False),
                 ("decode", dict(B=2, T=1, H=2, D=32, **unnormalized), False)]
    else:
        cases = [("chunked", dict(B=2, T=300, H=3, D=48, **random_state), True),
                 ("chunked", dict(B=2, T=200, H=2, D=64, **random_state), True),
                 ("chunked", dict(B=2, T=200, H=2, D=64, **carried), True),
                 ("chunked", dict(B=1, T=2048, H=2, D=64, **one_call), True),
                 ("chunked", dict(B=2, T=300, H=3, D=64, **per_level), True),
                 ("chunked", dict(B=2, T=300, H=3, D=64, **unnormalized), True),
                 ("decode", dict(B=2, T=1, H=3, D=64, **random_state), False),
                 ("decode", dict(B=2, T=7, H=3, D=48, **random_state), False),
                 ("decode", dict(B=2, T=1, H=3, D=64, **unnormalized), False)]
    rows = []
    for kind, shape, grad in cases:
        shape = dict(shape)
        loss_mean, normalize = shape.pop("loss_mean", 0.0), shape.pop("normalize", True)
        for dtype in (torch.float32, torch.bfloat16):
            after = f" after {shape['history']} tokens" if "history" in shape else ""
            if loss_mean:
                after += f" one call v/dO means {shape['v_mean']:g}/{loss_mean:g}"
            if shape.get("decay") == "level":
                after += " decay per level" + ("" if normalize else ", no denominator")
            kernel = f"linear_attention[{kind} T={shape['T']} D={shape['D']}{after}]"
            try:
                inputs = make_inputs(**shape, levels=2, dtype=dtype, device=device, grad=False)
                got = _outputs("triton", inputs, dtype, grad, loss_mean, normalize)
                truth = _outputs("reference", inputs, torch.float64, grad, loss_mean, normalize)
                # fp32 over one long call errs by ~1e-4 on every path (the fp32 reference by 1.3e-4)
                lowp_rule = dtype != torch.float32 or loss_mean
                same = _outputs("torch", inputs, dtype, grad, loss_mean, normalize) if lowp_rule else None
                margin = 1e-2 if dtype == torch.bfloat16 else 1e-4
                rows += common.check_rows(kernel, dtype, NAMES[:len(got)], got, truth, same, margin,
                                          margins={"dw": 3 * margin}, truth_name="fp64 reference")
            except Exception as exc:  # recorded, not raised
                rows.append(common.error_row(kernel, dtype, exc))
    return rows
