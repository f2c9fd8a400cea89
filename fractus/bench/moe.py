"""Sparse MoE benchmark: the sorted PyTorch path and the Triton kernels vs naive formulations.

CPU (palier2 dims: d=512, E=16, F=512, r=64, K=2, 8,192 tokens): the sorted path vs the
per-token weight-gather formulation (each token's expert weights index-selected, then einsum),
forward+backward. GPU (1b dims: d=1280, E=128, F=2048, r=64, K=2, 16k and 64k tokens, bf16):
Triton vs the sorted PyTorch path vs a per-expert Python loop.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fractus.bench import common
from fractus.ops.moe import moe, moe_reference
from fractus.verify.cases import MOE_GPU, MOE_TOKENS, moe_case, moe_fwd_bwd

PALIER2 = dict(d=512, E=16, F=512, r=64, K=2)
TINY = dict(d=48, E=7, F=80, r=16, K=2)
GATHER_CHUNK = 1024  # tokens per forward+backward of the gather baseline (its memory is ∝ tokens)


def moe_gather(x, idx, w, ex):
    """Per-token weight-gather formulation: index_select every token's expert weights, einsum."""
    V1, U1, V2, U2 = (ex[k][idx] for k in ("V1", "U1", "V2", "U2"))  # [N, K, ., r]
    a1 = torch.einsum("nd,nkdr->nkr", x, V1)
    h = F.gelu(ex["s1"][idx].unsqueeze(-1) * torch.einsum("nkr,nkfr->nkf", a1, U1) + ex["b1"][idx])
    f = ex["s2"][idx].unsqueeze(-1) * torch.einsum("nkr,nkdr->nkd", torch.einsum("nkf,nkfr->nkr", h, V2), U2)
    return (w.unsqueeze(-1) * (f + ex["b2"][idx])).sum(1)


def moe_expert_loop(x, idx, w, ex):
    """Per-expert Python loop: for every expert, find its (token, slot) pairs, run it, index_add."""
    y = torch.zeros_like(x)
    for e in range(ex["b1"].shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            m = x[tok]
            h = F.gelu(ex["s1"][e] * ((m @ ex["V1"][e]) @ ex["U1"][e].t()) + ex["b1"][e])
            f = ex["s2"][e] * ((h @ ex["V2"][e]) @ ex["U2"][e].t()) + ex["b2"][e]
            y = y.index_add(0, tok, w[tok, slot].unsqueeze(1) * f)
    return y


def _params(x, w, ex):
    return [x, w, *ex.values()]


def _impl(name):
    if name == "gather":
        return moe_gather
    if name == "loop":
        return moe_expert_loop
    return lambda x, idx, w, ex: moe(x, idx, w, ex, backend=name)


def peak_case(impl, N, chunk=None, **dims):
    """For cpu_peak_bytes: builds a case and returns a forward+backward thunk."""
    x, idx, w, ex = moe_case(N, **dims)
    return lambda: moe_fwd_bwd(_impl(impl), x, idx, w, ex, chunk)


def _flops(N, d, E, F, r, K, lowrank=True):
    """Model FLOPs of the forward (backward counted as 2× forward)."""
    per_row = 4 * r * (d + F) if lowrank else 4 * d * F
    return per_row * N * K


def _min_bytes(N, d, E, F, r, K, elt, lowrank=True, backward=False):
    """Compulsory traffic: x gathered per slot, y per slot, expert weights once (×3 with backward)."""
    wts = E * ((2 * d * r + 2 * F * r + F + d) if lowrank else (2 * d * F + F + d))
    act = 2 * N * K * d
    return elt * (3 * (act + wts) if backward else act + wts)


# ----------------------------------------------------------------------------- CPU
def cpu_rows(smoke: bool = False) -> list[dict]:
    """Sorted path vs per-token weight gather, low-rank, fp32, forward+backward (+ peak RSS).

    The two are timed in alternating rounds (the CPU is shared, its load changes by the
    minute); time_s is the best round, time_median_s the median.
    """
    dims = TINY if smoke else PALIER2
    N = 64 if smoke else 8192
    chunk = 16 if smoke else GATHER_CHUNK
    rounds = 2 if smoke else 5
    impls = (("torch", None), ("gather", chunk))
    peaks = [common.cpu_peak_bytes("fractus.bench.moe:peak_case", impl=impl, N=N, chunk=ch, **dims)
             for impl, ch in impls]
    x, idx, w, ex = moe_case(N, **dims)
    runs = common.interleaved_times([lambda impl=impl, ch=ch: moe_fwd_bwd(_impl(impl), x, idx, w, ex, ch)
                                     for impl, ch in impls], rounds)
    times = {impl: ts for (impl, _), ts in zip(impls, runs)}
    best = {impl: min(ts) for impl, ts in times.items()}
    rows = []
    for (impl, ch), peak in zip(impls, peaks):
        t = best[impl]
        rows.append(dict(bench="moe", impl="sorted" if impl == "torch" else "per_token_gather",
                         mode="fwd+bwd", dtype=common.dtype_name(torch.float32), tokens=N, chunk_tokens=ch or N, **dims,
                         time_s=t, time_median_s=sorted(times[impl])[rounds // 2], rounds=rounds,
                         gflops=3 * _flops(N, **dims) / t / 1e9, peak_rss_bytes=peak,
                         speedup_vs_gather=best["gather"] / t, target=">=10x vs per_token_gather",
                         target_met=best["torch"] * 10 <= best["gather"]))
    return rows


# ----------------------------------------------------------------------------- GPU
def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """1b dims in bf16: Triton vs the sorted PyTorch path vs a per-expert loop; time, GB/s, TFLOP/s,
    yielded a case (token count, low-rank or dense experts) at a time. After a failure that loses
    CUDA's context, the rows so far are yielded and nothing more runs.

    smoke=True runs tiny sizes through the Triton interpreter on CPU.
    """
    dtype = torch.bfloat16
    if smoke:
        device, dims, tokens = "cpu", TINY, (37,)
    else:
        device, dims, tokens = "cuda", MOE_GPU, MOE_TOKENS
    elt = torch.finfo(dtype).bits // 8
    cases = [(N, True) for N in tokens] + [(tokens[0], False)]
    for N, lowrank in cases:
        x, idx, w, ex = moe_case(N, **dims, lowrank=lowrank, dtype=dtype, device=device)
        impls = ("triton", "torch", "loop") if lowrank else ("triton", "torch")
        case_rows = []
        for impl in impls:
            fn = _impl(impl)
            for mode in ("fwd", "fwd+bwd"):
                if mode == "fwd":
                    def thunk():
                        with torch.no_grad():
                            fn(x, idx, w, ex)
                else:
                    def thunk():
                        moe_fwd_bwd(fn, x, idx, w, ex)
                row = dict(bench="moe", kind="lowrank" if lowrank else "dense", impl=impl, mode=mode,
                           dtype=common.dtype_name(dtype), tokens=N, **dims)
                try:
                    t = common.median_time(thunk, warmup=1, reps=2, device=device) if smoke else \
                        common.median_time(thunk, device=device)
                    mult = 3 if mode == "fwd+bwd" else 1
                    row.update(time_s=t, tflops=mult * _flops(N, **dims, lowrank=lowrank) / t / 1e12,
                               gbps=_min_bytes(N, **dims, elt=elt, lowrank=lowrank,
                                               backward=mode == "fwd+bwd") / t / 1e9)
                    if device == "cuda":
                        row["peak_bytes"] = common.cuda_peak_bytes(thunk, leaves=_params(x, w, ex))
                except Exception as exc:  # recorded; the other implementations and cases still run
                    row["note"] = f"error: {type(exc).__name__}: {exc}"[:300]
                    if common.cuda_context_lost(device):  # every later call would fail too
                        yield from case_rows + [row]
                        return
                    if device == "cuda":
                        torch.cuda.empty_cache()
                case_rows.append(row)
        for row in case_rows:
            same = {r_["impl"]: r_["time_s"] for r_ in case_rows if r_["mode"] == row["mode"] and "time_s" in r_}
            if "time_s" in row and "torch" in same:
                row["speedup_vs_torch"] = same["torch"] / row["time_s"]
            if lowrank and row["impl"] == "triton":
                row["target"] = ">=5x vs per-expert loop"
            if "time_s" in row and "loop" in same:
                row["speedup_vs_loop"] = same["loop"] / row["time_s"]
                if row["impl"] == "triton":
                    row["target_met"] = row["speedup_vs_loop"] >= 5
        yield from case_rows
        del x, idx, w, ex


def correctness_rows(device, smoke: bool = False) -> Iterator[dict]:
    """Triton vs the fp32 per-token reference: output and every gradient, low-rank and dense.

    fp32: rel_err < tol. bf16 (on CPU through the interpreter, which :mod:`fractus.verify.interpret`
    makes round it as a GPU does): rel_err vs the fp32 truth ≤ that of the bf16 PyTorch path + 2e-3
    (the interpreter's bf16 exceeds it by at most 6.6e-4 at these sizes, 8.3e-4 at the dry run's;
    mostly the kernels are more accurate). Failures (including exceptions) are recorded, never raised;
    the rows are yielded a kernel and dtype at a time.
    """
    device = torch.device(device)
    dims = TINY if smoke else dict(d=320, E=16, F=400, r=64, K=2)
    N = 13 if smoke else 257
    for lowrank in (True, False):
        # (token dtype, fp32 master experts as the model passes them under autocast)
        for dtype, masters in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            kernel = ("moe_lowrank" if lowrank else "moe_dense") + ("[fp32 experts]" if masters else "")
            try:
                x, idx, w, ex = moe_case(N, **dims, lowrank=lowrank, dtype=dtype, device=device)
                dy = torch.randn(N, dims["d"], generator=torch.Generator().manual_seed(1)).to(device, dtype)

                def run(fn, x, w, ex, dy):
                    y = fn(x, idx, w, ex)
                    return (y, *torch.autograd.grad(y, _params(x, w, ex), dy))

                up = {k: v.detach().float().requires_grad_() for k, v in ex.items()}
                if masters:
                    ex = {k: v.detach().clone().requires_grad_() for k, v in up.items()}
                got = run(_impl("triton"), x, w, ex, dy)
                x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
                truth = run(moe_reference, x32, w32, up, dy.float())
                same = run(_impl("torch"), x, w, ex, dy) if dtype != torch.float32 else None
                yield from common.check_rows(kernel, dtype, ["y", "dx", "dw", *ex], got, truth, same, margin=2e-3)
            except Exception as exc:  # recorded, not raised
                yield common.error_row(kernel, dtype, exc)
