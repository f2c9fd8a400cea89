"""The inputs that the kernels' checks and timings run on, and the timed calls themselves: what the
GPU suite's stages launch, and so what the compile table and the suite's precompile
(:mod:`fractus.verify.aot`) capture of them.

- linear attention: :func:`attention_case` (q, k, v [B, T, H, D], level weights [Lv], a decay and a
  state), the shape the suite times (:data:`ATTENTION_GPU` at :data:`ATTENTION_TS`), the two
  recurrences it times (:data:`RECURRENCES`: the default model's and the original's) and
  :func:`attention` / :func:`fwd_bwd`, which run one implementation of them: ours (PyTorch, Triton,
  Triton with its backward on chunks of 64, the reference) or flash-linear-attention's
  ``chunk_simple_gla`` on the same featured q and k (:func:`fla_attention`);
- the gated delta rule: :func:`delta_case` (β and a decay per position, a state, resets), timed at
  the linear attention's shape, and :func:`delta` / :func:`delta_fwd_bwd`: ours (Triton, PyTorch,
  the reference) or fla's ``chunk_gated_delta_rule`` on the same unit features (:func:`fla_delta_rule`);
- sparse experts: :func:`moe_case`, the 1b shape the suite times (:data:`MOE_GPU`, :data:`MOE_TOKENS`)
  and its timed call (:func:`moe_fwd_bwd`);
- the tied head's cross-entropy: :func:`cross_entropy_case`, :data:`CROSS_ENTROPY_GPU` and its timed
  call (:func:`cross_entropy_fwd_bwd`);
- the Kuramoto clock: :func:`kuramoto_case`; generation's prompt: :data:`GEN_PROMPT`.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fractus.ops.delta_rule import delta_rule
from fractus.ops.delta_rule.reference import unit_features
from fractus.ops.linear_attention import kernels as la_kernels
from fractus.ops.linear_attention import linear_attention
from fractus.model import level_omegas, multiscale_decays

GEN_PROMPT = list(range(1, 17))  # generation's prompt (16 tokens)

ATTENTION_GPU = dict(B=8, H=20, D=64, levels=2)  # the suite's timings, in bf16: 40 level·heads
ATTENTION_TS = (512, 2048, 8192)  # and their sequence lengths
# The recurrences the suite times, both with the carried state that training passes and the
# denominator (the normalisation of both): the default model's multiscale decay per (level, head)
# [Lv, H] (fixed: the decay gate's decays per position are checked, not timed), and the original's,
# without decay.
RECURRENCES = ("default", "original")
EPS = 1e-6  # the models' ε in the denominator

MOE_GPU = dict(d=1280, E=128, F=2048, r=64, K=2)  # 1b's experts
MOE_TOKENS = (16384, 65536)  # token counts the suite times at MOE_GPU (the dense experts at the first)
CROSS_ENTROPY_GPU = dict(N=16384, d=1280, V=50257)  # 1b's head


# ----------------------------------------------------------------------------- linear attention
def attention_case(B, T, H, D, levels=2, decay=False, state=False, dtype=torch.float32,
                   device="cpu", grad=True, seed=0, history=0, v_mean=0.0):
    """q, k, v [B, T, H, D] in dtype, level weights [Lv], decay [H] (``decay="level"``: [Lv, H], one
    per level and head; ``decay="position"``: [B, T, Lv, H], one per position, level and head, as the
    default model's decay gate makes) or None, state or None;
    the floating leaves require grad when grad=True (state and weights in fp32). With ``history``
    the state is the one that many earlier tokens leave without decay (training's carried state),
    v of those and of the call drawn around ``v_mean``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(x, dt=dtype):
        return x.to(device=device, dtype=dt).requires_grad_(grad)
    q, k = (leaf(torch.randn(B, T, H, D, generator=gen)) for _ in range(2))
    v = leaf(v_mean + torch.randn(B, T, H, D, generator=gen))
    w = leaf(torch.softmax(torch.randn(levels, generator=gen), 0), torch.float32)
    shape = {"level": (levels, H), "position": (B, T, levels, H)}.get(decay, (H,))
    g = (torch.rand(*shape, generator=gen) * 0.3 + 0.65).to(device) if decay else None
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


def timed_attention(recurrence: str, B, T, H, D, levels, dtype=torch.bfloat16, device="cpu", grad=True):
    """A timed problem of :data:`RECURRENCES`: :func:`attention_case` with a carried state, and the
    recurrence's decay: the default model's multiscale values [Lv, H], or None for the original's."""
    if recurrence not in RECURRENCES:
        raise ValueError(f"recurrence must be one of {RECURRENCES}, got {recurrence!r}")
    q, k, v, w, _, state = attention_case(B, T, H, D, levels, state=True, dtype=dtype, device=device, grad=grad)
    decay = torch.tensor(multiscale_decays(H, levels), device=device).view(levels, H) \
        if recurrence == "default" else None
    return q, k, v, w, decay, state


@functools.lru_cache(maxsize=None)
def fla_attention():
    """flash-linear-attention's ``chunk_simple_gla`` computing our recurrence, and a note naming it:
    (fn(q, k, v, w, decay, state, normalize) → o, note). The feature maps run first (q and k per
    level, the levels folded into heads, level-major as the decay [Lv, H] and the state are) and the
    decay is its ``g_gamma`` (log γ per head). With ``normalize``, v takes a column of ones (and
    one of zeros: fla's backward takes even widths only), so that one call carries the state (S, z)
    as one [D, D + 2] matrix from our initial state and its output's column D is the denominator
    f(q)ᵀz; the division (in fp32) and the level mix follow. Without, it computes the numerator
    alone (from S), at v's own width. ImportError without fla."""
    from fla.ops.simple_gla import chunk_simple_gla

    def fn(q, k, v, w, decay=None, state=None, normalize=True):
        B, T, H, D = q.shape
        Lv = w.numel()
        oms = level_omegas(Lv)
        fq = torch.cat([F.elu(q + om) + 1 for om in oms], 2)  # [B, T, Lv·H, D]
        fk = torch.cat([F.elu(k + om) + 1 for om in oms], 2)
        g = None if decay is None else torch.log(decay.float().expand(Lv, H)).reshape(Lv * H)
        h0 = None if state is None else state[0]
        if normalize:  # [v, 1, 0] and [S, z, 0]
            v = torch.cat([v, torch.ones_like(v[..., :1]), torch.zeros_like(v[..., :1])], -1)
            if state is not None:
                h0 = torch.cat([state[0], state[1][..., None], torch.zeros_like(state[1][..., None])], -1)
        h0 = None if h0 is None else h0.reshape(B, Lv * H, D, -1)
        o = chunk_simple_gla(fq, fk, v.repeat(1, 1, Lv, 1), g_gamma=g, scale=1.0, initial_state=h0)[0].float()
        y = (o[..., :D] / (o[..., D:D + 1] + EPS) if normalize else o).unflatten(2, (Lv, H))
        return torch.einsum("l,btlhd->bthd", w.float(), y).to(q.dtype)
    import fla
    return fn, f"fla {getattr(fla, '__version__', '?')} chunk_simple_gla on the featured q, k"


@contextlib.contextmanager
def _backward_chunk(n):
    """The Triton backward's chunk length set to ``n`` for the duration."""
    default, la_kernels.BWD_CHUNK = la_kernels.BWD_CHUNK, n
    try:
        yield
    finally:
        la_kernels.BWD_CHUNK = default


# ours; fla's on the whole recurrence; fla's on its numerator alone (v's own width: fla's kernels at
# their own shape, a bound on what computing the denominator too can cost it)
ATTENTION_IMPLS = ("triton", "triton_bwd64", "torch", "reference", "fla", "fla_numerator")


def attention(impl: str, q, k, v, w, decay=None, state=None, normalize=True) -> torch.Tensor:
    """o [B, T, H, D] of one of :data:`ATTENTION_IMPLS` (``triton_bwd64``'s forward is triton's;
    ``fla_numerator`` is fla's without the denominator whatever ``normalize`` says)."""
    if impl.startswith("fla"):
        return fla_attention()[0](q, k, v, w, decay, state, normalize and impl == "fla")
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    return linear_attention(q, k, v, w, level_omegas(w.numel()), decay, state, EPS,
                            backend=impl.removesuffix("_bwd64"), normalize=normalize)[0]


def fwd_bwd(run: Callable[[], torch.Tensor], leaves) -> None:
    """``run()``'s output summed in fp32 and backpropagated, the ``leaves``' gradients cleared first
    (so that each call computes them afresh)."""
    for x in leaves:
        if x is not None:
            x.grad = None
    run().float().sum().backward()


def attention_fwd_bwd(impl: str, q, k, v, w, decay=None, state=None) -> None:
    """Forward and backward of :func:`attention` (``triton_bwd64``: the backward on chunks of 64)."""
    with _backward_chunk(64) if impl == "triton_bwd64" else contextlib.nullcontext():
        fwd_bwd(lambda: attention(impl, q, k, v, w, decay, state), (q, k, v, w, *(state or ())))


# ----------------------------------------------------------------------------- gated delta rule
DELTA_IMPLS = ("triton", "torch", "reference", "fla")


def delta_case(B, T, H, D, levels=2, state=True, resets=False, dtype=torch.float32, device="cpu", grad=True,
               seed=0):
    """The gated delta rule's inputs: q, k, v [B, T, H, D] in dtype; level weights [Lv], write
    strengths β [B, T, Lv, H] in (0, 1) and a decay per position [B, T, Lv, H] in [0.65, 0.95] (the
    decay gate's), in fp32 as the model makes them; a state [B, Lv, H, D, D] fp32 or None; resets
    [B, T] (every 97th position from the 37th) or None. Floating leaves require grad when grad."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(x, dt=torch.float32):
        return x.to(device=device, dtype=dt).requires_grad_(grad)
    q, k, v = (leaf(torch.randn(B, T, H, D, generator=gen), dtype) for _ in range(3))
    w = leaf(torch.softmax(torch.randn(levels, generator=gen), 0))
    beta = leaf(torch.rand(B, T, levels, H, generator=gen))
    decay = leaf(torch.rand(B, T, levels, H, generator=gen) * 0.3 + 0.65)
    st = leaf(0.5 * torch.randn(B, levels, H, D, D, generator=gen)) if state else None
    r = None
    if resets:
        r = torch.zeros(B, T, dtype=torch.bool)
        r[:, 36::97] = True
        r = r.to(device)
    return q, k, v, w, beta, decay, st, r


@functools.lru_cache(maxsize=None)
def fla_delta_rule():
    """flash-linear-attention's ``chunk_gated_delta_rule`` computing our gated delta rule, and a
    note naming it: (fn(q, k, v, w, beta, decay, state) → o, note). The unit feature maps run first
    (per level, the levels folded into heads, level-major as β, the decay and the state are), v is
    repeated for each level, g = log γ, scale 1; the level mix follows. fla takes no resets.
    ImportError without fla."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fn(q, k, v, w, beta, decay, state=None):
        B, T, H, D = q.shape
        Lv = w.numel()
        fq, fk = (unit_features(x, level_omegas(Lv)).transpose(1, 2).flatten(2, 3).to(q.dtype) for x in (q, k))
        h0 = None if state is None else state.reshape(B, Lv * H, D, D)
        o = chunk_gated_delta_rule(fq, fk, v.repeat(1, 1, Lv, 1), torch.log(decay.float()).flatten(2, 3),
                                   beta.flatten(2, 3).to(q.dtype), scale=1.0, initial_state=h0)[0]
        return torch.einsum("l,btlhd->bthd", w.float(), o.float().unflatten(2, (Lv, H))).to(q.dtype)
    import fla
    return fn, f"fla {getattr(fla, '__version__', '?')} chunk_gated_delta_rule on the unit features"


def delta(impl: str, q, k, v, w, beta, decay, state=None, resets=None) -> torch.Tensor:
    """o [B, T, H, D] of one of :data:`DELTA_IMPLS` (fla: without resets)."""
    if impl == "fla":
        if resets is not None:
            raise ValueError("fla's chunk_gated_delta_rule takes no resets")
        return fla_delta_rule()[0](q, k, v, w, beta, decay, state)
    if impl not in DELTA_IMPLS:
        raise ValueError(f"impl must be one of {DELTA_IMPLS}, got {impl!r}")
    return delta_rule(q, k, v, w, level_omegas(w.numel()), beta, decay, state, resets, backend=impl)[0]


def delta_fwd_bwd(impl: str, q, k, v, w, beta, decay, state=None, resets=None) -> None:
    """Forward and backward of :func:`delta`."""
    fwd_bwd(lambda: delta(impl, q, k, v, w, beta, decay, state, resets), (q, k, v, w, beta, decay, state))


# ----------------------------------------------------------------------------- sparse experts
def moe_case(N, d, E, F, r, K, lowrank=True, dtype=torch.float32, device="cpu", seed=0):
    """Random experts (leaf tensors requiring grad), x [N, d], idx [N, K] distinct per token, w [N, K]."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype).requires_grad_()

    if lowrank:
        ex = dict(V1=rnd(E, d, r, scale=d ** -0.5), U1=rnd(E, F, r, scale=r ** -0.5), b1=rnd(E, F, scale=0.1),
                  s1=rnd(E, scale=0.1), V2=rnd(E, F, r, scale=F ** -0.5), U2=rnd(E, d, r, scale=r ** -0.5),
                  b2=rnd(E, d, scale=0.1), s2=rnd(E, scale=0.1))
        with torch.no_grad():
            ex["s1"] += 1.0
            ex["s2"] += 1.0
    else:
        ex = dict(W1=rnd(E, d, F, scale=d ** -0.5), b1=rnd(E, F, scale=0.1),
                  W2=rnd(E, F, d, scale=F ** -0.5), b2=rnd(E, d, scale=0.1))
    x = rnd(N, d)
    idx = torch.rand(N, E, generator=gen).topk(K, dim=1).indices.to(device)
    w = torch.softmax(torch.randn(N, K, generator=gen), -1).to(device=device, dtype=dtype).requires_grad_()
    return x, idx, w, ex


def moe_fwd_bwd(fn, x, idx, w, ex, chunk=None) -> None:
    """Forward+backward of ``fn(x, idx, w, ex)`` (in token chunks when ``chunk`` is set) with an
    upstream gradient of ones; gradients accumulate into .grad, cleared first."""
    n = x.shape[0]
    step = chunk or n
    for p in (x, w, *ex.values()):
        p.grad = None
    for i in range(0, n, step):
        y = fn(x[i:i + step], idx[i:i + step], w[i:i + step], ex)
        y.backward(torch.ones_like(y))


# ----------------------------------------------------------------------------- cross-entropy
def cross_entropy_case(N, d, V, dtype=torch.float32, device="cpu", seed=0, ignore_every=0):
    """h [N, d], weight [V, d] (leaves requiring grad), targets [N] (every k-th row ignored if k)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (0.02 * torch.randn(V, d, generator=gen)).to(device=device, dtype=dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen)
    if ignore_every:
        t[1::ignore_every] = -100
    return h, w, t.to(device)


def cross_entropy_fwd_bwd(fn, h, w, t):
    """One forward+backward of ``fn(h, w, t)`` (a scalar loss); returns (loss, dL/dh, dL/dW)."""
    h.grad = w.grad = None
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


# ----------------------------------------------------------------------------- Kuramoto clock
def kuramoto_case(device: torch.device, small: bool):
    """θ⁰ [M, N], ω, U, λ (leaves on the device) and an upstream gradient for ψ [M], fp32."""
    M, N, r = (37, 8, 4) if small else (1 << 17, 16, 8)  # 1b: 16 oscillators, rank 8
    g = torch.Generator().manual_seed(0)
    args = [3 * torch.randn(M, N, generator=g), 0.3 * torch.randn(N, generator=g),
            torch.randn(N, r, generator=g) / N ** 0.5, 0.5 + torch.rand(r, generator=g)]
    return [a.to(device).requires_grad_() for a in args], torch.randn(M, generator=g).to(device)
