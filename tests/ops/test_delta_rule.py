"""The gated delta rule (fractus.ops.delta_rule): what it recalls, the matrix form it
implements, its carried state and resets, and gradients through it; the chunked PyTorch form and
the Triton kernels (in the interpreter) against the position-by-position reference on odd shapes,
for outputs, states and every gradient, in fp32 and bf16; the decode kernel against the chunked
kernels; the kernels against fla's recurrent gated delta rule."""
import pytest
import torch
import torch.nn.functional as F

from fractus.ops.delta_rule import delta_rule_chunked, delta_rule, delta_rule_reference, delta_rule_triton
from fractus.ops.delta_rule import kernels as K
from fractus.ops.delta_rule.reference import unit_features
from util import LOWP, Launches, assert_lowp, assert_rel

OMEGAS = [1.0, 0.38]
PATHS = ("reference", "torch")  # fp64 paths; the kernels (fp32 inside) are tested below


def inputs(B=2, T=13, H=3, D=5, Lv=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3))
    beta = torch.rand(B, T, Lv, H, generator=g, dtype=dtype)
    decay = 0.8 + 0.2 * torch.rand(B, T, Lv, H, generator=g, dtype=dtype)
    w = torch.softmax(torch.randn(Lv, generator=g, dtype=dtype), 0)
    return q, k, v, w, beta, decay


@pytest.mark.parametrize("backend", PATHS)
def test_a_key_written_twice_recalls_its_latest_value(backend):
    """β = 1, γ = 1: S = k̂ v₁ᵀ, then the second write replaces v₁ by v₂ along k̂ (‖k̂‖ = 1)."""
    k = torch.randn(1, 1, 1, 4, dtype=torch.float64).expand(1, 3, 1, 4)
    v = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    beta = torch.ones(1, 3, 1, 1, dtype=torch.float64)
    o, S = delta_rule(k, k, v, torch.ones(1, dtype=torch.float64), [1.0], beta, backend=backend)
    for t in range(3):  # the query is the key: it recalls the value just written
        assert_rel(o[0, t, 0], v[0, t, 0], 1e-12, f"position {t}")


@pytest.mark.parametrize("backend", PATHS)
def test_it_is_the_gated_delta_rule_in_matrix_form(backend):
    """S_t = (I − β k̂ k̂ᵀ) γ S_{t−1} + β k̂ vᵀ and o = Σ_l w_l q̂ᵀ S, written independently in fp64."""
    q, k, v, w, beta, decay = inputs()
    o, S = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay, backend=backend)
    B, T, H, D = q.shape
    unit = lambda x, om: F.normalize(F.elu(x + om) + 1, dim=-1)  # noqa: E731
    Sr = torch.zeros(B, len(OMEGAS), H, D, D, dtype=q.dtype)
    ref = torch.zeros_like(o)
    eye = torch.eye(D, dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            for l, om in enumerate(OMEGAS):
                for h in range(H):
                    kh, qh, bt = unit(k[b, t, h], om), unit(q[b, t, h], om), beta[b, t, l, h]
                    Sr[b, l, h] = (eye - bt * torch.outer(kh, kh)) @ (decay[b, t, l, h] * Sr[b, l, h]) \
                        + bt * torch.outer(kh, v[b, t, h])
                    ref[b, t, h] += w[l] * qh @ Sr[b, l, h]
    assert_rel(o, ref, 1e-12, "o")
    assert_rel(S, Sr, 1e-12, "S")


@pytest.mark.parametrize("backend", PATHS)
def test_the_state_carries_across_calls_and_resets_start_it_afresh(backend):
    q, k, v, w, beta, decay = inputs()
    o, S = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay, backend=backend)
    o1, S1 = delta_rule(q[:, :6], k[:, :6], v[:, :6], w, OMEGAS, beta[:, :6], decay=decay[:, :6], backend=backend)
    o2, S2 = delta_rule(q[:, 6:], k[:, 6:], v[:, 6:], w, OMEGAS, beta[:, 6:], decay=decay[:, 6:], state=S1,
                        backend=backend)
    assert_rel(torch.cat([o1, o2], 1), o, 1e-12, "o")
    assert_rel(S2, S, 1e-12, "S")
    resets = torch.zeros(q.shape[:2], dtype=torch.bool)
    resets[:, 6] = True  # the same as a second call from an empty state
    o3, _ = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay, state=torch.randn_like(S), resets=resets,
                       backend=backend)
    o4, _ = delta_rule(q[:, 6:], k[:, 6:], v[:, 6:], w, OMEGAS, beta[:, 6:], decay=decay[:, 6:], backend=backend)
    assert_rel(o3[:, 6:], o4, 1e-12, "o after the reset")


@pytest.mark.parametrize("backend", PATHS)
def test_gradients_reach_every_input(backend):
    q, k, v, w, beta, decay = (x.float().requires_grad_() for x in inputs(dtype=torch.float32))
    o, S = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay, backend=backend)
    (o.square().sum() + S.sum()).backward()
    for name, x in zip("q k v w beta decay".split(), (q, k, v, w, beta, decay)):
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0, name


def _grads(fn, xs, resets, **kw):
    q, k, v, w, beta, decay, S0 = xs
    o, S = fn(q, k, v, w, OMEGAS, beta, decay, S0, resets, **kw)
    probe = torch.sin(torch.arange(o.numel(), dtype=torch.float64)).to(o.dtype).view_as(o)  # no symmetry hides it
    loss = (o * probe).sum() + (S * S.detach().sin()).sum()
    return (o, S) + torch.autograd.grad(loss, [x for x in xs if x is not None])


def _case(T, D, decay_kind, with_state, with_resets, seed=0, B=2, H=2, chunk=16):
    q, k, v, w, beta, decay = inputs(B=B, T=T, H=H, D=D, seed=seed)
    decay = {"position": decay, "fixed": decay[0, 0], None: None}[decay_kind]
    S0 = torch.randn(B, len(OMEGAS), H, D, D, dtype=q.dtype) if with_state else None
    resets = None
    if with_resets:
        resets = torch.zeros(B, T, dtype=torch.bool)
        resets[0, ::chunk] = True  # on chunks' first positions
        resets[1, T // 3] = resets[1, T - 1] = True
    return [q, k, v, w, beta, decay, S0], resets


@pytest.mark.parametrize("T,C,decay_kind,with_state,with_resets", [
    (1, 64, "position", False, False), (13, 4, "position", True, True), (13, 64, None, True, False),
    (16, 4, "fixed", False, True), (37, 8, "position", True, True), (70, 64, "position", True, True)])
def test_the_chunked_form_is_the_recurrence(T, C, decay_kind, with_state, with_resets):
    """Outputs, final state and the gradients of q, k, v, the level weights, β, γ and the start state,
    chunked against one position at a time in fp64: chunks shorter, equal to and longer than T, a
    last chunk cut short, resets inside chunks and on their edges."""
    xs, resets = _case(T, 5, decay_kind, with_state, with_resets, seed=T, H=3, chunk=C)
    xs = [None if x is None else x.clone().requires_grad_() for x in xs]
    ref = _grads(delta_rule_reference, xs, resets)
    got = _grads(delta_rule_chunked, xs, resets, C=C)
    names = ["o", "S"] + [n for n, x in zip("q k v w beta decay S0".split(), xs) if x is not None]
    for name, a, b in zip(names, got, ref):
        assert_rel(a, b, 1e-10, name)


def test_in_fp32_the_chunked_form_is_as_accurate_as_the_reference():
    """fp32 over 1,024 positions with slow decays, judged against the fp64 recurrence: the chunked
    form's relative error at most the fp32 reference's plus a small tolerance."""
    q, k, v, w, beta, _ = inputs(B=2, T=1024, H=2, D=16, seed=3, dtype=torch.float32)
    decay = 1 - 1e-3 * torch.rand(2, 1024, len(OMEGAS), 2)
    truth = delta_rule_reference(*(x.double() for x in (q, k, v, w)), OMEGAS, beta.double(), decay.double())
    ref = delta_rule_reference(q, k, v, w, OMEGAS, beta, decay)
    got = delta_rule(q, k, v, w, OMEGAS, beta, decay, backend="torch")
    for name, a, r, t in zip("oS", got, ref, truth):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        err = lambda x: ((x.double() - t).norm() / t.norm()).item()  # noqa: E731
        assert err(a) <= err(r) + 2e-6, (name, err(a), err(r))


def _names(xs):
    return ["o", "S"] + [n for n, x in zip("q k v w beta decay S0".split(), xs) if x is not None]


@pytest.mark.parametrize("T,D,decay_kind,with_state,with_resets,chunk", [
    (1, 5, "position", True, False, 16), (37, 8, "position", True, True, 16), (16, 16, "fixed", False, True, 16),
    (40, 5, None, True, False, 16), (70, 32, "position", True, True, 32), (33, 64, "position", False, True, 16)])
def test_the_triton_kernels_are_the_recurrence(T, D, decay_kind, with_state, with_resets, chunk):
    """fp32 through the Triton kernels against the fp64 reference: outputs, final state and the
    gradients of q, k, v, the level weights, β, γ and the start state to 1e-5 — T of one position,
    one chunk, a last chunk cut short; D below, at and above the 16-wide tile; a fixed decay and
    none; resets on chunks' first positions, inside chunks and at the end."""
    xs, resets = _case(T, D, decay_kind, with_state, with_resets, seed=T, chunk=chunk)
    ref = _grads(delta_rule_reference, [None if x is None else x.clone().requires_grad_() for x in xs], resets)
    got = _grads(delta_rule_triton, [None if x is None else x.float().requires_grad_() for x in xs], resets,
                 chunk=chunk)
    for name, a, b in zip(_names(xs), got, ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("dtype", LOWP)
def test_in_low_precision_the_kernels_are_as_accurate_as_the_reference(dtype):
    """bf16 and fp16 inputs over 100 positions: each output and gradient's error against the fp64
    truth (on the same rounded inputs) at most the same-dtype reference's (which computes in fp32
    and rounds its results) plus 2e-3 — the kernels' dots are tf32 (measured excess ≤ 1.3e-3)."""
    xs, resets = _case(100, 16, "position", True, True, seed=5)
    xs = [x.to(dtype) for x in xs]
    truth = _grads(delta_rule_reference, [x.double().requires_grad_() for x in xs], resets)
    ref = _grads(delta_rule_reference, [x.clone().requires_grad_() for x in xs], resets)
    got = _grads(delta_rule_triton, [x.clone().requires_grad_() for x in xs], resets, chunk=32)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for name, a, r, t in zip(_names(xs), got, ref, truth):
        assert_lowp(a, r, t, 2e-3, name)


@pytest.mark.parametrize("T,with_state,with_resets", [(1, True, False), (5, False, True), (16, True, True)])
def test_the_decode_kernel_is_the_chunked_kernels(T, with_state, with_resets, monkeypatch):
    """T ≤ 16 without autograd runs one launch of the decode kernel, and gives the output and state
    the chunked kernels give under autograd."""
    xs, resets = _case(T, 24, "position", with_state, with_resets, seed=T)
    xs = [None if x is None else x.float() for x in xs]
    q, k, v, w, beta, decay, S0 = xs
    launches = Launches(K._dr_decode_kernel)
    monkeypatch.setattr(K, "_dr_decode_kernel", launches)
    with torch.no_grad():
        o, S = delta_rule(q, k, v, w, OMEGAS, beta, decay, S0, resets, backend="triton")
    assert launches.count == 1
    o2, S2 = delta_rule_triton(q, k, v, w.requires_grad_(), OMEGAS, beta, decay, S0, resets)
    assert launches.count == 1  # autograd takes the chunked kernels
    assert_rel(o, o2.detach(), 1e-6, "o")
    assert_rel(S, S2.detach(), 1e-6, "S")


def test_the_kernels_carry_their_state_across_calls():
    """One call over 50 positions against a 21-position call and a 29-position call that takes its
    state (chunks cut at other places), and a reset against a call from an empty state."""
    (q, k, v, w, beta, decay, _), _ = _case(50, 8, "position", False, False, seed=7)
    q, k, v, w, beta, decay = (x.float() for x in (q, k, v, w, beta, decay))
    o, S = delta_rule_triton(q, k, v, w, OMEGAS, beta, decay)
    cut = lambda x, a, b: x[:, a:b]  # noqa: E731
    o1, S1 = delta_rule_triton(*(cut(x, 0, 21) for x in (q, k, v)), w, OMEGAS, cut(beta, 0, 21), cut(decay, 0, 21))
    o2, S2 = delta_rule_triton(*(cut(x, 21, 50) for x in (q, k, v)), w, OMEGAS, cut(beta, 21, 50),
                               cut(decay, 21, 50), state=S1)
    assert_rel(torch.cat([o1, o2], 1), o, 1e-6, "o")
    assert_rel(S2, S, 1e-6, "S")
    resets = torch.zeros(2, 50, dtype=torch.bool)
    resets[:, 21] = True
    o3, _ = delta_rule_triton(q, k, v, w, OMEGAS, beta, decay, state=torch.randn_like(S), resets=resets)
    fresh, _ = delta_rule_triton(*(cut(x, 21, 50) for x in (q, k, v)), w, OMEGAS, cut(beta, 21, 50), cut(decay, 21, 50))
    assert_rel(o3[:, 21:], fresh, 1e-6, "o after the reset")


def test_the_kernels_refuse_what_they_cannot_run():
    q, k, v, w, beta, decay = (x.float() for x in inputs(T=4))
    with pytest.raises(TypeError, match="fp32/fp16/bf16"):
        delta_rule_triton(q.double(), k.double(), v.double(), w.double(), OMEGAS, beta.double())
    with pytest.raises(ValueError, match="power of two"):
        delta_rule_triton(q, k, v, w, OMEGAS, beta, chunk=24)
    with pytest.raises(ValueError, match="beta must be"):
        delta_rule_triton(q, k, v, w, OMEGAS, beta[..., :1, :])


def test_the_kernels_agree_with_fla():
    """One level (weight 1) through the kernels against fla's ``naive_recurrent_gated_delta_rule``
    on the same unit features, β, log γ and start state (scale 1): output, final state, and the
    gradients of the features' inputs, v, β, γ and the start state."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    (q, k, v, _, beta, decay, S0), _ = _case(45, 16, "position", True, False, seed=11)
    one = [OMEGAS[0]]
    q, k, v = (x.float().clone().requires_grad_() for x in (q, k, v))
    beta, decay = (x.float()[:, :, :1].clone().requires_grad_() for x in (beta, decay))
    S0 = S0.float()[:, :1].clone().requires_grad_()
    xs = (q, k, v, beta, decay, S0)
    probe = torch.sin(torch.arange(q.numel(), dtype=torch.float32)).view_as(q)

    def ours():
        o, S = delta_rule_triton(q, k, v, torch.ones(1), one, beta, decay, S0)
        return o, S[:, 0]

    def theirs():
        fq, fk = (unit_features(x, one)[:, 0] for x in (q, k))
        return naive.naive_recurrent_gated_delta_rule(fq, fk, v, beta[:, :, 0], torch.log(decay[:, :, 0]), scale=1.0,
                                                      initial_state=S0[:, 0], output_final_state=True)
    results = []
    for fn in (ours, theirs):
        o, S = fn()
        loss = (o * probe).sum() + (S * S.detach().sin()).sum()
        results.append((o, S, *torch.autograd.grad(loss, xs)))
    for name, a, b in zip("o S q k v beta decay S0".split(), *results):
        assert_rel(a, b, 1e-5, name)

