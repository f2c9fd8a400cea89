"""Fused linear + cross-entropy benchmark: forward+backward time and peak memory vs naive.

CPU (palier2 head: 8,192 tokens, d=512, V=50257, fp32): the chunked PyTorch path vs naive
F.linear then F.cross_entropy. Targets: peak memory ≤ 1/8 of naive, time ≤ 1.3× naive.
GPU (1b head: 16,384 tokens, d=1280, V=50257, bf16): Triton vs naive, torch.compile(naive) and
Liger-Kernel's LigerFusedLinearCrossEntropyLoss when importable (default settings); each one's
loss and gradients compared with the fp32 naive ones. Target: memory and time ≤ Liger's.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fractus.bench import common
from fractus.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from fractus.verify.cases import CROSS_ENTROPY_GPU, cross_entropy_case, cross_entropy_fwd_bwd

CPU_CASE = dict(N=8192, d=512, V=50257)
TINY = dict(N=37, d=48, V=300)


def naive(h, w, t):
    """The unfused baseline: full logits, then F.cross_entropy."""
    return F.cross_entropy(F.linear(h, w), t)


def _impl(name):
    """name → fn(h, w, t) returning the scalar mean loss."""
    if name == "naive":
        return naive
    if name == "compiled":
        return torch.compile(naive)
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        mod = LigerFusedLinearCrossEntropyLoss()

        def liger(h, w, t):
            out = mod(w, h, t)
            return out[0] if isinstance(out, tuple) else out
        return liger
    return lambda h, w, t: linear_cross_entropy(h, w, t, backend=name)


def peak_case(impl, N, d, V):
    """For cpu_peak_bytes: builds a case and returns a forward+backward thunk."""
    h, w, t = cross_entropy_case(N, d, V)
    fn = _impl(impl)
    return lambda: cross_entropy_fwd_bwd(fn, h, w, t)


def _flops(N, d, V):
    """Matmul FLOPs of forward+backward (logits, dH, dW), whatever recomputation an impl does."""
    return 3 * 2 * N * d * V


def _min_bytes(N, d, V, elt):
    """Compulsory traffic of forward+backward: H and W read, dH and dW written, the int64 targets."""
    return elt * 2 * (N + V) * d + 8 * N


# ----------------------------------------------------------------------------- CPU
def cpu_rows(smoke: bool = False) -> list[dict]:
    """Chunked PyTorch path vs naive, fp32 forward+backward: time and peak RSS (spawned process)."""
    case = dict(N=256, d=64, V=2048) if smoke else CPU_CASE
    reps = dict(warmup=1, reps=2 if smoke else 3)
    impls = ("torch", "naive")
    peaks = [common.cpu_peak_bytes("fractus.bench.cross_entropy:peak_case", impl=i, **case) for i in impls]
    h, w, t = cross_entropy_case(**case)
    rows = []
    for impl, peak in zip(impls, peaks):
        fn = _impl(impl)
        tm = common.median_time(lambda: cross_entropy_fwd_bwd(fn, h, w, t), **reps)
        rows.append(dict(bench="cross_entropy", impl="chunked" if impl == "torch" else "naive",
                         mode="fwd+bwd", dtype=common.dtype_name(torch.float32), tokens=case["N"], d=case["d"],
                         V=case["V"], time_s=tm, gflops=_flops(**case) / tm / 1e9, peak_rss_bytes=peak))
    base = rows[1]
    for r in rows:
        r["time_vs_naive"] = r["time_s"] / base["time_s"]
        r["mem_vs_naive"] = r["peak_rss_bytes"] / max(base["peak_rss_bytes"], 1)
    fused = rows[0]
    fused["target"] = "mem <= 1/8 naive and time <= 1.3x naive"
    fused["target_met"] = fused["mem_vs_naive"] <= 1 / 8 and fused["time_vs_naive"] <= 1.3
    return rows


# ----------------------------------------------------------------------------- GPU
def gpu_rows(smoke: bool = False) -> list[dict]:
    """1b head in bf16: Triton vs naive, torch.compile(naive) and Liger (when importable).

    smoke=True runs tiny sizes through the Triton interpreter on CPU (torch.compile is
    skipped there: it needs a C++ toolchain and minutes).
    """
    dtype = torch.bfloat16
    device, case = ("cpu", TINY) if smoke else ("cuda", CROSS_ENTROPY_GPU)
    h, w, t = cross_entropy_case(**case, dtype=dtype, device=device)
    meta = dict(bench="cross_entropy", mode="fwd+bwd", dtype=common.dtype_name(dtype),
                tokens=case["N"], d=case["d"], V=case["V"])
    truth = cross_entropy_fwd_bwd(naive, h.detach().float().requires_grad_(), w.detach().float().requires_grad_(), t)
    rows = []
    for impl in ("triton", "naive", "compiled", "liger"):
        if impl == "compiled" and smoke:
            rows.append(dict(**meta, impl=impl, note="skipped in smoke (CPU)"))
            continue
        try:
            fn = _impl(impl)
            thunk = lambda: cross_entropy_fwd_bwd(fn, h, w, t)  # noqa: E731
            tm = common.median_time(thunk, warmup=1, reps=2, device=device) if smoke else \
                common.median_time(thunk, device=device)
            row = dict(**meta, impl=impl, time_s=tm, tflops=_flops(**case) / tm / 1e12,
                       gbps=_min_bytes(**case, elt=h.element_size()) / tm / 1e9)
            row.update({f"rel_err_{n}": common.rel_err(x, y) for n, x, y in
                        zip(("loss", "dh", "dw"), cross_entropy_fwd_bwd(fn, h, w, t), truth)})
            if device == "cuda":
                row["peak_bytes"] = common.cuda_peak_bytes(thunk, leaves=(h, w))
            rows.append(row)
        except ImportError as exc:
            rows.append(dict(**meta, impl=impl, note=f"not installed ({exc})"))
        except Exception as exc:  # a baseline failing (e.g. Liger on CPU) is recorded, not raised
            rows.append(dict(**meta, impl=impl, note=f"error: {type(exc).__name__}: {exc}"))
    timed = {r["impl"]: r for r in rows if "time_s" in r}
    for r in rows:
        if "time_s" not in r:
            continue
        for other in ("naive", "compiled", "liger"):
            if other in timed and other != r["impl"]:
                r[f"time_vs_{other}"] = r["time_s"] / timed[other]["time_s"]
                if "peak_bytes" in r:
                    r[f"mem_vs_{other}"] = r["peak_bytes"] / max(timed[other]["peak_bytes"], 1)
    tri = timed.get("triton")
    if tri is not None:
        tri["target"] = "time and memory <= Liger"
        if "liger" not in timed:
            tri["note"] = "target not measured: liger " + next(r for r in rows if r["impl"] == "liger")["note"]
        elif "peak_bytes" in tri:
            tri["target_met"] = tri["time_vs_liger"] <= 1.0 and tri["mem_vs_liger"] <= 1.0
        else:
            tri["note"] = "target not measured: no peak memory off CUDA"
    return rows



def _lowp_torch(h, w, t, **kw):
    """Same-dtype PyTorch computation: logits matmul in the inputs' dtype, then fp32 math."""
    logits = F.linear(h, w).float()
    pos = kw.get("positions")
    tt = t if pos is None else t[pos]
    if pos is not None:
        logits = logits[pos]
    if kw.get("softcap") is not None:
        logits = kw["softcap"] * torch.tanh(logits / kw["softcap"])
    lse = torch.logsumexp(logits, -1)
    valid = tt != -100
    safe = torch.where(valid, tt, torch.zeros_like(tt))
    ce = (lse - logits.gather(1, safe[:, None])[:, 0]) * valid
    loss = (ce + kw.get("z_loss", 0.0) * lse * lse * valid).sum()
    if kw.get("reduction", "mean") == "mean":
        loss = loss / valid.sum().clamp_min(1)
    return loss, ce.detach()


def correctness_rows(device, smoke: bool = False) -> Iterator[dict]:
    """Triton vs the fp32 reference: loss, per-token ce, dH, dW; fp32 and low precision.

    fp32: rel_err < 1e-4. bf16 (on CPU through the interpreter, which :mod:`fractus.verify.interpret`
    makes round it as a GPU does): rel_err vs the fp32 truth ≤ that of the bf16 PyTorch computation + 2e-3.
    Measured so at this size (1,000 tokens, d 512, V 50257), the kernel's errors are below the
    PyTorch path's in both options: loss and per-token ce by 4e-6 to 2.5e-4, dH and dW by 3e-4 to 8e-4.
    Failures (including exceptions) are recorded, never raised; the rows are yielded an option and
    dtype at a time.
    """
    device = torch.device(device)
    case = TINY if smoke else dict(N=1000, d=512, V=50257)
    N = case["N"]
    options = {
        "mean": dict(),
        "sum+z+softcap+positions": dict(reduction="sum", z_loss=1e-3, softcap=3.0,
                                        positions=torch.arange(N - 1, 0, -3)),
    }
    names = ("loss", "per_token_ce", "dH", "dW")
    for opt, kw in options.items():
        kw = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in kw.items()}
        for dtype in (torch.float32, torch.bfloat16):
            kernel = f"linear_cross_entropy[{opt}]"
            try:
                h, w, t = cross_entropy_case(**case, dtype=dtype, device=device, ignore_every=7)
                with torch.no_grad():
                    w.mul_(100.0 / case["d"] ** 0.5)  # logits of std ~2: a peaked, not flat, softmax

                def run(fn, h, w):
                    loss, ce = fn(h, w, t, **kw)
                    return (loss, ce, *torch.autograd.grad(loss * 1.5, (h, w)))

                got = run(lambda *a, **k: linear_cross_entropy(*a, backend="triton",
                                                               return_per_token=True, **k), h, w)
                h32 = h.detach().float().requires_grad_()
                w32 = w.detach().float().requires_grad_()
                truth = run(lambda *a, **k: linear_cross_entropy_reference(*a, return_per_token=True,
                                                                           **k), h32, w32)
                same = run(_lowp_torch, h, w) if dtype != torch.float32 else None
                yield from common.check_rows(kernel, dtype, names, got, truth, same, margin=2e-3)
            except Exception as exc:  # recorded, not raised
                yield common.error_row(kernel, dtype, exc)
