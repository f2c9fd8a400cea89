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

from fractus.bench import common, harness
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


def peak_case(provider, mode, tokens, gather_chunk, **dims):
    """For :func:`fractus.bench.common.cpu_peak_bytes`: builds a case and returns a forward+backward
    thunk (the gather baseline in chunks of ``gather_chunk`` tokens)."""
    x, idx, w, ex = moe_case(tokens, **dims)
    return lambda: moe_fwd_bwd(_impl(provider), x, idx, w, ex, gather_chunk if provider == "gather" else None)


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
def cpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """The sorted path vs the per-token weight gather, low-rank, fp32, forward+backward, time and peak
    RSS (each in a fresh process). The two are timed in alternating rounds (the CPU is shared, its
    load changes by the minute) and compared on their best rounds (``compared``: ``low``)."""
    dims = TINY if smoke else PALIER2
    N = 64 if smoke else 8192
    shape = dict(dims, gather_chunk=16 if smoke else GATHER_CHUNK)

    def call(provider, mode, case):
        x, idx, w, ex = case
        chunk = shape["gather_chunk"] if provider == "gather" else None
        fn = _impl(provider)
        return lambda: moe_fwd_bwd(fn, x, idx, w, ex, chunk)
    return [harness.Bench(
        op="moe", case="lowrank", x_name="tokens", x_values=(N,), providers=("torch", "gather"),
        setup=lambda N: moe_case(N, **dims), call=call, metrics=("time", "memory"),
        peak_case="fractus.bench.moe:peak_case", baseline="gather", shape=shape, compared="low",
        timing=harness.Timing(warmup=1, rounds=2 if smoke else 5, interleave=("torch", "gather")),
        flops=lambda N, m: 3 * _flops(N, **dims),
        targets=(harness.Target("torch", ">=10x vs per_token_gather",
                                lambda r: r.value("torch") * 10 <= r.value("gather")),))]


def cpu_rows(smoke: bool = False) -> list[dict]:
    """:func:`cpu_benches`' rows (:mod:`fractus.bench.harness`)."""
    return list(harness.run(cpu_benches(smoke)))


# ----------------------------------------------------------------------------- GPU
def _timed_call(provider, mode, case):
    x, idx, w, ex = case
    fn = _impl(provider)
    if mode == "fwd+bwd":
        return lambda: moe_fwd_bwd(fn, x, idx, w, ex)

    def forward():
        with torch.no_grad():
            fn(x, idx, w, ex)
    return forward


def gpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """1b dims in bf16: Triton vs the sorted PyTorch path vs a per-expert loop, low-rank experts at
    each token count and dense ones at the first; forward and forward+backward of each
    implementation in turn; time, GB/s, TFLOP/s. The low-rank Triton rows carry the target (≥ 5×
    the loop). smoke=True runs tiny sizes through the Triton interpreter on CPU."""
    dtype = torch.bfloat16
    device, dims, tokens = ("cpu", TINY, (37,)) if smoke else ("cuda", MOE_GPU, MOE_TOKENS)
    elt = torch.finfo(dtype).bits // 8

    def bench(lowrank, xs, providers, targets=()):
        return harness.Bench(
            op="moe", case="lowrank" if lowrank else "dense", x_name="tokens", x_values=xs, providers=providers,
            modes=("fwd", "fwd+bwd"), by_provider=True,
            setup=lambda N: moe_case(N, **dims, lowrank=lowrank, dtype=dtype, device=device), call=_timed_call,
            metrics=("time", "memory"), baseline="torch", shape=dims, dtype=dtype, device=device,
            timing=harness.Timing(warmup=1, reps=2), targets=targets,
            flops=lambda N, m: (3 if m == "fwd+bwd" else 1) * _flops(N, **dims, lowrank=lowrank),
            min_bytes=lambda N, m: _min_bytes(N, **dims, elt=elt, lowrank=lowrank, backward=m == "fwd+bwd"),
            leaves=lambda case: _params(case[0], case[2], case[3]))
    vs_loop = harness.Target("triton", ">=5x vs per-expert loop",
                             lambda r: None if r.value("loop") is None else r.value("loop") / r.value("triton") >= 5)
    return [bench(True, tokens, ("triton", "torch", "loop"), (vs_loop,)), bench(False, tokens[:1], ("triton", "torch"))]


def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """:func:`gpu_benches`' rows (:mod:`fractus.bench.harness`), a case at a time; after a failure
    that loses CUDA's context, the rows so far and nothing more."""
    return harness.run(gpu_benches(smoke))


def correctness_rows(device, smoke: bool = False) -> Iterator[dict]:
    """Triton vs the fp32 per-token reference: output and every gradient, low-rank and dense.

    fp32: rel_err < tol. bf16 (on CPU through the interpreter, which :mod:`fractus.ops.interpreter`
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
