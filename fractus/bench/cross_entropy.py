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

from fractus.bench import common, harness
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


def peak_case(provider, mode, tokens, d, V):
    """For :func:`fractus.bench.common.cpu_peak_bytes`: builds a case and returns a forward+backward thunk."""
    h, w, t = cross_entropy_case(tokens, d, V)
    fn = _impl(provider)
    return lambda: cross_entropy_fwd_bwd(fn, h, w, t)


def _flops(N, d, V):
    """Matmul FLOPs of forward+backward (logits, dH, dW), whatever recomputation an impl does."""
    return 3 * 2 * N * d * V


def _min_bytes(N, d, V, elt):
    """Compulsory traffic of forward+backward: H and W read, dH and dW written, the int64 targets."""
    return elt * 2 * (N + V) * d + 8 * N


def _call(provider, mode, case):
    fn = _impl(provider)
    return lambda: cross_entropy_fwd_bwd(fn, *case)


# ----------------------------------------------------------------------------- CPU
def cpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """The chunked PyTorch path vs naive, fp32 forward+backward: time and peak RSS (each in a fresh
    process); the chunked path's target: memory ≤ 1/8 of naive's and time ≤ 1.3×."""
    case = dict(N=256, d=64, V=2048) if smoke else CPU_CASE
    shape = dict(d=case["d"], V=case["V"])

    def met(r):
        mem = r.value("torch", "memory") / max(r.value("naive", "memory"), 1)
        return mem <= 1 / 8 and r.value("torch") / r.value("naive") <= 1.3
    return [harness.Bench(
        op="cross_entropy", case="", x_name="tokens", x_values=(case["N"],), providers=("torch", "naive"),
        setup=lambda N: cross_entropy_case(N, **shape), call=_call, metrics=("time", "memory"),
        peak_case="fractus.bench.cross_entropy:peak_case", baseline="naive", shape=shape,
        timing=harness.Timing(warmup=1, reps=2 if smoke else 3), flops=lambda N, m: _flops(N, **shape),
        targets=(harness.Target("torch", "mem <= 1/8 naive and time <= 1.3x naive", met),))]


def cpu_rows(smoke: bool = False) -> list[dict]:
    """:func:`cpu_benches`' rows (:mod:`fractus.bench.harness`)."""
    return list(harness.run(cpu_benches(smoke)))


# ----------------------------------------------------------------------------- GPU
def gpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """1b head in bf16: Triton vs naive, torch.compile(naive) and Liger (when importable), each one's
    loss and gradients compared with the fp32 naive ones; the Triton row's target: time and
    memory ≤ Liger's. smoke=True runs tiny sizes through the Triton interpreter on CPU
    (torch.compile is skipped there: it needs a C++ toolchain and minutes)."""
    dtype = torch.bfloat16
    device, case = ("cpu", TINY) if smoke else ("cuda", CROSS_ENTROPY_GPU)
    shape = dict(d=case["d"], V=case["V"])
    elt = torch.finfo(dtype).bits // 8

    def setup(N):
        h, w, t = cross_entropy_case(N, **shape, dtype=dtype, device=device)
        truth = cross_entropy_fwd_bwd(naive, h.detach().float().requires_grad_(),
                                      w.detach().float().requires_grad_(), t)
        return h, w, t, truth

    def call(provider, mode, case):
        return _call(provider, mode, case[:3])

    def check(provider, mode, case, out):
        return {f"rel_err_{n}": common.rel_err(x, y) for n, x, y in zip(("loss", "dh", "dw"), out, case[3])}

    def vs_liger(r):
        if r.value("liger") is None:
            return "liger " + r.note("liger")
        if r.value("triton", "memory") is None:
            return "no peak memory off CUDA"
        mem = r.value("triton", "memory") / max(r.value("liger", "memory"), 1)
        return r.value("triton") / r.value("liger") <= 1.0 and mem <= 1.0
    return [harness.Bench(
        op="cross_entropy", case="", x_name="tokens", x_values=(case["N"],),
        providers=("triton", "naive", "compiled", "liger"), setup=setup, call=call, check=check,
        check_modes=("fwd+bwd",), check_vs="naive (fp32)", metrics=("time", "memory"), baseline="naive",
        shape=shape, dtype=dtype, device=device, timing=harness.Timing(warmup=1, reps=2),
        absent={"compiled": "skipped in smoke (CPU)"} if smoke else {},
        flops=lambda N, m: _flops(N, **shape), min_bytes=lambda N, m: _min_bytes(N, **shape, elt=elt),
        leaves=lambda case: case[:2], targets=(harness.Target("triton", "time and memory <= Liger", vs_liger),))]


def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """:func:`gpu_benches`' rows (:mod:`fractus.bench.harness`)."""
    return harness.run(gpu_benches(smoke))


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

    fp32: rel_err < 1e-4. bf16 (on CPU through the interpreter, which :mod:`fractus.ops.interpreter`
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
