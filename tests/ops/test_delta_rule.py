"""The gated delta rule (fractus.ops.delta_rule): what it recalls, the matrix form it
implements, its carried state and resets, and gradients through it; the chunked form against the
position-by-position reference on odd shapes, for outputs, states and every gradient."""
import pytest
import torch
import torch.nn.functional as F

from fractus.ops.delta_rule import delta_rule_chunked, delta_rule, delta_rule_reference
from util import assert_rel

OMEGAS = [1.0, 0.38]
PATHS = ("reference", "torch")


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
    probe = torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)  # a gradient no symmetry hides
    loss = (o * probe).sum() + (S * S.detach().sin()).sum()
    return (o, S) + torch.autograd.grad(loss, [x for x in xs if x is not None])


@pytest.mark.parametrize("T,C,decay_kind,with_state,with_resets", [
    (1, 64, "position", False, False), (13, 4, "position", True, True), (13, 64, None, True, False),
    (16, 4, "fixed", False, True), (37, 8, "position", True, True), (70, 64, "position", True, True)])
def test_the_chunked_form_is_the_recurrence(T, C, decay_kind, with_state, with_resets):
    """Outputs, final state and the gradients of q, k, v, the level weights, β, γ and the start state,
    chunked against one position at a time in fp64: chunks shorter, equal to and longer than T, a
    last chunk cut short, resets inside chunks and on their edges."""
    q, k, v, w, beta, decay = inputs(T=T, seed=T)
    B, _, H, D = q.shape
    decay = {"position": decay, "fixed": decay[0, 0], None: None}[decay_kind]
    S0 = torch.randn(B, len(OMEGAS), H, D, D, dtype=q.dtype) if with_state else None
    resets = None
    if with_resets:
        resets = torch.zeros(B, T, dtype=torch.bool)
        resets[0, ::C] = True  # on chunks' first positions
        resets[1, T // 3] = resets[1, T - 1] = True
    xs = [None if x is None else x.clone().requires_grad_() for x in (q, k, v, w, beta, decay, S0)]
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
