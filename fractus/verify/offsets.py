"""The kernels at offsets past 2³¹ elements on the device (the GPU suite's ``correctness_offsets``).

Each op runs once on inputs whose element offsets leave int32 (a GPU wraps an int32 offset
silently); its outputs and per-row gradients at the end of the buffers (the largest offsets) are
checked against the reference run on those rows alone (fp64; the cross-entropy's and the MoE's
in fp32, their references' own precision) by the low-precision rule: error ≤ the same-dtype
PyTorch path's on those rows + 1e-2 (bf16). ``tests/verify/test_offsets.py`` checks the kernels'
integer arithmetic for such wraps in the interpreter; this checks what the GPU's compiler made of
it. Gradients that sum over every row (level and expert weights) are not checked. The dry run
takes the same code paths at tiny sizes (nothing there passes 2³¹), and the suite's precompile
captures the cases at a size that Triton specialises as the full one (see :func:`_long`), so that
they load binaries instead of compiling.

The gated delta rule is not among them: its kernels' fp32 intermediates at that size (features,
chunk matrices, gradients) need about 120 GB; ``tests/verify/test_offsets.py`` checks its integer
arithmetic in the interpreter.

The last rows checked all start past 2³¹ elements (:func:`_past`). Peak device memory per case,
counted (not measured): attention about 60 GB, its decode kernel 38 GB, cross-entropy 30 GB, MoE
55 GB, dense MoE 55 GB (bf16), the clock 60 GB (fp32); an H200 has 141 GB.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from fractus.ops.cross_entropy import linear_cross_entropy
from fractus.ops.kuramoto import kuramoto_phase, kuramoto_phase_reference
from fractus.ops.linear_attention import linear_attention
from fractus.ops.moe import moe
from fractus.model import level_omegas
from fractus.verify.checks import check_rows, error_row

PAST = 2 ** 31  # elements: the first offset int32 cannot hold
TAIL = 4  # sequences, tokens or rows checked at the end of each buffer
MARGIN = 1e-2  # bf16, as the suite's other correctness checks


def _randn(*shape, gen, device, dtype=torch.float32, scale=1.0, mean=0.0):
    return mean + scale * torch.randn(*shape, generator=gen, device=device, dtype=dtype)


def _past(width: int) -> int:
    """Rows of ``width`` elements such that the last TAIL rows all start past 2³¹ elements."""
    return -(-PAST // width) + TAIL


def _long(full: int, scale: str, smoke: int) -> int:
    """A case's long dimension: ``full`` (past 2³¹ elements), ``smoke`` (the dry run's), or for
    ``capture`` a small one of the same class where Triton specialises integer arguments (equal to 1,
    divisible by 16, neither): the same compiles as the full size."""
    return {"full": full, "smoke": smoke, "capture": 16 + full % 16}[scale]


def _label(scale: str) -> str:
    return "offsets past 2^31" if scale == "full" else f"offsets ({scale}: small)"


def _tails(*xs):
    """The last TAIL rows of each, copied (a view would keep the whole buffer)."""
    return [x[-TAIL:].detach().clone() for x in xs]


def _rows(kernel, dtype, names, got, truth, same):
    return check_rows(kernel, dtype, names, got, truth, same, margin=MARGIN, truth_name="fp64 reference")


def attention_rows(device, scale: str, gen) -> list[dict]:
    """Chunked forward and backward over B sequences of [T, H, D] with B·T·H·D past 2³¹, one level
    with decay, no state: o, the final (S, z), dq, dk, dv of the last sequences."""
    T, H, D = (40, 2, 32) if scale == "smoke" else (128, 2, 32)
    B = _long(_past(T * H * D), scale, 6)
    dtype, oms = torch.bfloat16, level_omegas(1)
    q, k, v, do = (_randn(B, T, H, D, gen=gen, device=device, dtype=dtype) for _ in range(4))
    w = torch.ones(1, device=device)
    g = torch.full((H,), 0.9, device=device)

    def run(backend, dt, rows=slice(None)):
        sdt = torch.float64 if dt == torch.float64 else torch.float32  # weights, decay and state
        leaves = [x[rows].detach().to(dt).requires_grad_() for x in (q, k, v)]
        o, (S, z) = linear_attention(*leaves, w.to(sdt), oms, decay=g.to(sdt), backend=backend)
        return _tails(o, S, z, *torch.autograd.grad(o, leaves, do[rows].to(o.dtype)))
    got = run("triton", dtype)
    tail = slice(B - TAIL, B)
    kernel = f"linear_attention[{_label(scale)}: B={B} T={T} H={H} D={D}]"
    return _rows(kernel, dtype, ("o", "S", "z", "dq", "dk", "dv"), got, run("reference", torch.float64, tail),
                 run("torch", dtype, tail))


def decode_rows(device, scale: str, gen) -> list[dict]:
    """The one-launch decode kernel (T ≤ 16, no autograd) over one sequence of H heads with
    (T − 1)·H·D past 2³¹ (its last position's offsets; the states' too), from a random state, one
    level with decay: o and the new (S, z) of the last heads (each head its own recurrence)."""
    T, D = 16, 16
    H = _long(_past((T - 1) * D), scale, 6)  # position T − 1 of each checked head past 2³¹
    dtype, oms = torch.bfloat16, level_omegas(1)
    q, k, v = (_randn(1, T, H, D, gen=gen, device=device, dtype=dtype) for _ in range(3))
    S0 = _randn(1, 1, H, D, D, gen=gen, device=device, scale=0.5)
    z0 = 1 + 2 * torch.rand(1, 1, H, D, generator=gen, device=device)
    w = torch.ones(1, device=device)
    g = 0.65 + 0.3 * torch.rand(H, generator=gen, device=device)

    def run(backend, dt, heads=slice(None)):
        sdt = torch.float64 if dt == torch.float64 else torch.float32
        q_, k_, v_ = (x[:, :, heads].to(dt) for x in (q, k, v))
        with torch.no_grad():
            o, (S, z) = linear_attention(q_, k_, v_, w.to(sdt), oms, decay=g[heads].to(sdt),
                                         state=(S0[:, :, heads].to(sdt), z0[:, :, heads].to(sdt)), backend=backend)
        return [x[:, :, -TAIL:].clone() for x in (o, S, z)]
    tail = slice(H - TAIL, H)
    kernel = f"linear_attention[{_label(scale)} (decode): T={T} H={H} D={D}]"
    return _rows(kernel, dtype, ("o", "S", "z"), run("triton", dtype), run("reference", torch.float64, tail),
                 run("torch", dtype, tail))


def _cross_entropy_case(device, scale: str, gen, case: str, N: int, V: int, d: int) -> list[dict]:
    """One call of the fused loss, summed (so a row's gradient is its own): "rows", per-token loss and
    dH of the last rows; "vocabulary", the loss, dH of every row and dW of the last vocab rows."""
    dtype = torch.bfloat16
    h = _randn(N, d, gen=gen, device=device, dtype=dtype)
    w = _randn(V, d, gen=gen, device=device, dtype=dtype, scale=0.02)
    t = torch.randint(0, V, (N,), generator=gen, device=device)
    dw_wanted = case == "vocabulary"

    def run(backend, dt, rows=slice(None)):
        hh = h[rows].detach().to(dt).requires_grad_()
        ww = w.detach().to(dt).requires_grad_(dw_wanted)
        loss, ce = linear_cross_entropy(hh, ww, t[rows], reduction="sum", return_per_token=True, backend=backend)
        grads = torch.autograd.grad(loss, [hh, ww] if dw_wanted else [hh])
        return _tails(ce, grads[0]) if case == "rows" else [loss.detach(), grads[0], *_tails(grads[1])]
    sel = slice(N - TAIL, N) if case == "rows" else slice(None)
    names = ("ce", "dh") if case == "rows" else ("loss", "dh", "dW")
    kernel = f"cross_entropy[{_label(scale)} ({case}): N={N} d={d} V={V}]"
    return check_rows(kernel, dtype, names, run("triton", dtype), run("reference", torch.float32, sel),
                             run("torch", dtype, sel), margin=MARGIN)


def cross_entropy_rows(device, scale: str, gen) -> list[dict]:
    """Two calls: N·d past 2³¹ ("rows"), then V·d past 2³¹ ("vocabulary")."""
    smoke = scale == "smoke"
    d = 32 if smoke else 1280
    return (_cross_entropy_case(device, scale, gen, "rows", _long(_past(d), scale, 50), 64 if smoke else 1024, d)
            + _cross_entropy_case(device, scale, gen, "vocabulary", 16 if smoke else 256, _long(_past(d), scale, 70),
                                  d))


def _moe_case(device, scale: str, gen, lowrank: bool) -> list[dict]:
    """One MoE call, forward and backward: y, dx and the gate weights' gradient of the last tokens,
    which are routed to the last two experts (their slot rows end those experts' sorted rows, past
    2³¹ elements in the per-slot tensors)."""
    if lowrank:
        d, E, F, r, K = (32, 4, 48, 16, 2) if scale == "smoke" else (1280, 8, 512, 64, 2)
        N = _long(_past(d), scale, 40)
    else:
        d, E, F, r, K = (16, 4, 64, 0, 2) if scale == "smoke" else (1280, 8, 2048, 0, 2)  # 1b's d and F
        N = _long(_past(F), scale, 40)
    dtype = torch.bfloat16
    rnd = dict(gen=gen, device=device)
    if lowrank:
        ex = dict(V1=_randn(E, d, r, **rnd, scale=d ** -0.5), U1=_randn(E, F, r, **rnd, scale=r ** -0.5),
                  b1=_randn(E, F, **rnd, scale=0.1), s1=_randn(E, **rnd, mean=1.0, scale=0.1),
                  V2=_randn(E, F, r, **rnd, scale=F ** -0.5), U2=_randn(E, d, r, **rnd, scale=r ** -0.5),
                  b2=_randn(E, d, **rnd, scale=0.1), s2=_randn(E, **rnd, mean=1.0, scale=0.1))
    else:
        ex = dict(W1=_randn(E, d, F, **rnd, scale=d ** -0.5), b1=_randn(E, F, **rnd, scale=0.1),
                  W2=_randn(E, F, d, **rnd, scale=F ** -0.5), b2=_randn(E, d, **rnd, scale=0.1))
    x = _randn(N, d, gen=gen, device=device, dtype=dtype)
    idx = torch.rand(N, E, generator=gen, device=device).topk(K, dim=1).indices
    idx[-TAIL:] = torch.arange(E - K, E, device=device)
    gate = torch.softmax(_randn(N, K, gen=gen, device=device), -1)
    dy = _randn(N, d, gen=gen, device=device, dtype=dtype)

    def run(backend, dt, rows=slice(None)):
        xx, ww = (a[rows].detach().to(dt).requires_grad_() for a in (x, gate))
        y = moe(xx, idx[rows], ww, {k: v.to(dt) for k, v in ex.items()}, backend=backend)
        return _tails(y, *torch.autograd.grad(y, (xx, ww), dy[rows].to(y.dtype)))
    tail = slice(N - TAIL, N)
    experts = f"r={r}" if lowrank else "dense"
    kernel = f"moe[{_label(scale)}: N={N} d={d} E={E} F={F} {experts} K={K}]"
    return check_rows(kernel, dtype, ("y", "dx", "dw"), run("triton", dtype),
                             run("reference", torch.float32, tail), run("torch", dtype, tail), margin=MARGIN)


def moe_rows(device, scale: str, gen) -> list[dict]:
    """Low-rank experts, x [N, d] with N·d past 2³¹ (the per-slot rows [N·K, d] twice that)."""
    return _moe_case(device, scale, gen, lowrank=True)


def moe_dense_rows(device, scale: str, gen) -> list[dict]:
    """Dense experts (the grouped GEMMs), N·F past 2³¹ (the hidden activation [N·K, F] twice that)."""
    return _moe_case(device, scale, gen, lowrank=False)


def kuramoto_rows(device, scale: str, gen) -> list[dict]:
    """The clock in fp32 (its only dtype), forward and backward, θ⁰ [M, N] with M·N past 2³¹: ψ and
    dθ⁰ of the last rows, against fp64 autograd, fp32 autograd's error + 1e-4 allowed."""
    N, r = (8, 4) if scale == "smoke" else (16, 8)
    M = _long(_past(N), scale, 40)
    theta0 = _randn(M, N, gen=gen, device=device, scale=3.0)
    omega, U = _randn(N, gen=gen, device=device, scale=0.3), _randn(N, r, gen=gen, device=device, scale=N ** -0.5)
    lam = 0.5 + torch.rand(r, generator=gen, device=device)
    dpsi = _randn(M, gen=gen, device=device)
    dt, steps, damping = 0.1, 2, 0.1

    def run(fn, dt_, rows=slice(None)):
        th = theta0[rows].detach().to(dt_).requires_grad_()
        psi = fn(th, *(a.to(dt_) for a in (omega, U, lam)), dt, steps, damping)
        return _tails(psi, *torch.autograd.grad(psi, th, dpsi[rows].to(dt_)))
    tail = slice(M - TAIL, M)
    got = run(lambda *a: kuramoto_phase(*a, backend="triton"), torch.float32)
    return check_rows(f"kuramoto_phase[{_label(scale)}: M={M} N={N}]", torch.float32, ("psi", "dtheta"),
                             got, run(kuramoto_phase_reference, torch.float64, tail),
                             run(kuramoto_phase_reference, torch.float32, tail), margin=1e-4,
                             truth_name="fp64 autograd")


CASES = {"linear_attention": attention_rows, "linear_attention_decode": decode_rows,
         "cross_entropy": cross_entropy_rows, "moe": moe_rows, "moe_dense": moe_dense_rows,
         "kuramoto_phase": kuramoto_rows}


def run_cases(device, scale: str) -> list[dict]:
    """Every case at ``scale`` ("full", "smoke" or "capture"), exceptions raised."""
    return [r for fn in CASES.values() for r in fn(torch.device(device), scale, torch.Generator(device).manual_seed(0))]


def correctness_rows(device, smoke: bool = False) -> Iterator[dict]:
    """Every op's case (each freeing its buffers before the next), yielded a case at a time; an op
    that raises (out of memory, say) is recorded as a failed row and the others still run."""
    device, scale = torch.device(device), "smoke" if smoke else "full"
    for name, fn in CASES.items():
        gen = torch.Generator(device).manual_seed(0)
        try:
            yield from fn(device, scale, gen)
        except Exception as exc:  # recorded, not raised
            yield error_row(f"{name}[{_label(scale)}]", torch.bfloat16, exc)
        if device.type == "cuda":
            torch.cuda.empty_cache()
