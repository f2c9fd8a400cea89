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

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fractus.bench import common, harness
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


def peak_case(provider, mode, B, T, H, D, levels, decay):
    """For :func:`fractus.bench.common.cpu_peak_bytes`: inputs, then a forward+backward thunk."""
    q, k, v, w, _, _ = attention_case(B, T, H, D, levels, decay=decay)
    return lambda: _fwd_bwd(provider, q, k, v, w)


# ----------------------------------------------------------------------------- CPU
def cpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """fp32 forward+backward on CPU_THREADS threads (OpenMP threads on busy cores make timings
    erratic): (a) the chunked PyTorch path vs the token-by-token reference, 2 levels with decay;
    (b) the chunked path vs the materialising formulation at T=1024, D=64, 16 heads, B=1, one
    level, time and peak RSS (each in a fresh process), and the chunked path at 4·T against T,
    the two sizes timed in alternating rounds (the shared machine's load drifts; interleaving
    exposes both to the same drift)."""
    a = dict(B=1, T=64, H=2, D=32) if smoke else dict(B=1, T=512, H=4, D=64)
    b = dict(B=1, T=256, H=2, D=16) if smoke else dict(B=1, T=1024, H=16, D=64)
    reps = 2 if smoke else 3
    shape_a = dict(B=a["B"], H=a["H"], D=a["D"], levels=2, decay=True)
    shape_b = dict(B=b["B"], H=b["H"], D=b["D"], levels=1, decay=False)
    T = b["T"]
    vs_reference = harness.Bench(
        op="linear_attention", case="vs_reference", x_name="T", x_values=(a["T"],), providers=("torch", "reference"),
        setup=lambda T: attention_case(T=T, **shape_a)[:5],
        call=lambda p, m, qkvwg: lambda: cases.attention_fwd_bwd(p, *qkvwg),
        baseline="reference", shape=shape_a, timing=harness.Timing(warmup=1, reps=reps), threads=CPU_THREADS)
    vs_materialising = harness.Bench(
        op="linear_attention", case="vs_materialising", x_name="T", x_values=(T, 4 * T),
        providers=("torch", "materialising"), only=lambda p, x, m: p == "torch" or x == T,
        setup=lambda T: attention_case(T=T, **shape_b)[:4],
        call=lambda p, m, qkvw: lambda: _fwd_bwd(p, *qkvw),
        metrics=("time", "memory"), memory_x=(T,), peak_case="fractus.bench.linear_attention:peak_case",
        baseline="materialising", shape=shape_b, threads=CPU_THREADS,
        timing=harness.Timing(warmup=1, reps=reps, rounds=3 if smoke else 7, interleave=("torch",)),
        targets=(harness.Target("torch", "speedup >= 30x and memory <= 1/4 of materialising", x=T, met=lambda r: (
                     r.value("materialising") / r.value("torch") >= 30
                     and 0 < r.value("torch", "memory") <= r.value("materialising", "memory") / 4)),
                 harness.Target("torch", "time(4T)/time(T) <= 4.5", x=4 * T,
                                met=lambda r: r.value("torch") / r.value("torch", x=T) <= 4.5)))
    return [vs_reference, vs_materialising]


def cpu_rows(smoke: bool = False) -> list[dict]:
    """:func:`cpu_benches`' rows (:mod:`fractus.bench.harness`)."""
    return list(harness.run(cpu_benches(smoke)))


# ----------------------------------------------------------------------------- GPU
def _flops(B, T, H, D, levels, backward=False):
    """Model FLOPs: the recurrent form's 4·D·(D + 1) per token and level·head (state update, q·S,
    the denominator), the backward 2× the forward; a chunked kernel does more (intra-chunk products)."""
    return (3 if backward else 1) * 4 * D * (D + 1) * B * T * H * levels


def _min_bytes(B, T, H, D, levels, elt, backward=False, state=False):
    """Compulsory traffic: q, k, v read and o written once (the levels share them; the backward
    also reads q, k, v, dO and writes dq, dk, dv); ``state``: the fp32 (S, z) read and written."""
    return (11 if backward else 4) * B * T * H * D * elt + (8 * B * levels * H * D * (D + 1) if state else 0)


def _timed_case(recurrence, shape, device):
    """x = T → (the timed inputs, the forward's truth: the PyTorch path in fp32 inside, with and
    without its denominator)."""
    def setup(T):
        inputs = cases.timed_attention(recurrence, T=T, dtype=torch.bfloat16, device=device, **shape)
        with torch.no_grad():  # fp32 inside: the outputs' agreement is judged against it
            truth = {n: cases.attention("torch", *inputs, normalize=n) for n in (True, False)}
        return inputs, truth
    return setup


def _timed_call(provider, mode, case):
    inputs, _ = case
    if mode == "fwd+bwd":
        return lambda: cases.attention_fwd_bwd(provider, *inputs)

    def forward():
        with torch.no_grad():
            return cases.attention(provider, *inputs)
    return forward


def _decode_call(provider, mode, inputs):
    q, k, v, w, g, st = inputs

    def step():
        with torch.no_grad():
            linear_attention(q, k, v, w, level_omegas(w.numel()), g, st, cases.EPS, backend=provider)
    return step


def gpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """bf16 on CUDA (smoke: tiny, Triton's interpreter on CPU): per recurrence, at each length, the
    forward (its output compared with the PyTorch path's) and then the forward+backward of every
    implementation, against the PyTorch path; the first recurrence's Triton forward+backward at the
    middle length carries the target (within 1.25× of fla's time). Then each recurrence's decode
    step (B=1, T=1, the carried state, no autograd): Triton vs the PyTorch path, the first
    recurrence's Triton row with the target (≥ 10×)."""
    device, shape, Ts = ("cpu", SMOKE_GPU, (40,)) if smoke else ("cuda", cases.ATTENTION_GPU, cases.ATTENTION_TS)
    timing = harness.Timing(warmup=1, reps=2)  # CPU (smoke); CUDA: do_bench's own
    fla, fla_note = harness.peer(cases.fla_attention)
    absent = {"fla": fla_note, "fla_numerator": fla_note} if fla is None else {}
    fla_missing = fla_note if fla is None else "failed"
    B, H, D, Lv = (shape[k] for k in ("B", "H", "D", "levels"))
    elt = torch.finfo(torch.bfloat16).bits // 8
    T_target = Ts[len(Ts) // 2]

    def vs_fla(r):
        fla_s = r.value("fla")
        return f"fla {fla_missing}" if fla_s is None else r.value("triton") <= 1.25 * fla_s
    benches = []
    for recurrence in cases.RECURRENCES:
        target = (harness.Target("triton", f"fwd+bwd <= 1.25x fla's time at T={T_target}", vs_fla, mode="fwd+bwd",
                                 x=T_target),) if recurrence == cases.RECURRENCES[0] else ()
        benches.append(harness.Bench(
            op="linear_attention", case=recurrence, x_name="T", x_values=Ts,
            providers=("triton", "triton_bwd64", "torch", "fla", "fla_numerator"), modes=("fwd", "fwd+bwd"),
            only=lambda p, x, m: p != "triton_bwd64" or m == "fwd+bwd",
            setup=_timed_case(recurrence, shape, device), call=_timed_call,
            check=lambda p, m, case, out: {"rel_err": common.rel_err(out, case[1][p != "fla_numerator"])},
            check_modes=("fwd",), check_vs="torch", metrics=("time", "memory"), baseline="torch", shape=shape,
            dtype=torch.bfloat16, device=device, timing=timing, absent=absent, targets=target,
            flops=lambda T, m: _flops(B, T, H, D, Lv, m == "fwd+bwd"),
            min_bytes=lambda T, m: _min_bytes(B, T, H, D, Lv, elt, m == "fwd+bwd", state=True),
            leaves=lambda case: (*case[0][:4], *case[0][5])))
    for recurrence in cases.RECURRENCES:
        target = (harness.Target("triton", "decode >= 10x the PyTorch path",
                                 lambda r: None if r.value("torch") is None else r.value("torch") / r.value("triton") >= 10),
                  ) if recurrence == cases.RECURRENCES[0] else ()
        benches.append(harness.Bench(
            op="linear_attention", case=recurrence, x_name="T", x_values=(1,), providers=("triton", "torch"),
            modes=("decode",), setup=lambda T, recurrence=recurrence: cases.timed_attention(
                recurrence, 1, T, H, D, Lv, device=device, grad=False),
            call=_decode_call, baseline="torch", shape=dict(B=1, H=H, D=D, levels=Lv), dtype=torch.bfloat16,
            device=device, timing=timing, targets=target,
            flops=lambda T, m: _flops(1, T, H, D, Lv), min_bytes=lambda T, m: _min_bytes(1, T, H, D, Lv, elt, state=True)))
    return benches


def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """:func:`gpu_benches`' rows (:mod:`fractus.bench.harness`), a length at a time; after a failure
    that loses CUDA's context, the rows so far and nothing more."""
    return harness.run(gpu_benches(smoke))


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
    through the interpreter, which :mod:`fractus.ops.interpreter` makes round it as a GPU does):
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
