"""The gated delta rule (fractus.kernels.delta_rule): what it recalls, the matrix form it
implements, its carried state and resets, and gradients through it."""
import torch
import torch.nn.functional as F

from fractus.kernels.delta_rule import delta_rule
from util import assert_rel

OMEGAS = [1.0, 0.38]


def inputs(B=2, T=13, H=3, D=5, Lv=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3))
    beta = torch.rand(B, T, Lv, H, generator=g, dtype=dtype)
    decay = 0.8 + 0.2 * torch.rand(B, T, Lv, H, generator=g, dtype=dtype)
    w = torch.softmax(torch.randn(Lv, generator=g, dtype=dtype), 0)
    return q, k, v, w, beta, decay


def test_a_key_written_twice_recalls_its_latest_value():
    """β = 1, γ = 1: S = k̂ v₁ᵀ, then the second write replaces v₁ by v₂ along k̂ (‖k̂‖ = 1)."""
    k = torch.randn(1, 1, 1, 4, dtype=torch.float64).expand(1, 3, 1, 4)
    v = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    beta = torch.ones(1, 3, 1, 1, dtype=torch.float64)
    o, S = delta_rule(k, k, v, torch.ones(1, dtype=torch.float64), [1.0], beta)
    for t in range(3):  # the query is the key: it recalls the value just written
        assert_rel(o[0, t, 0], v[0, t, 0], 1e-12, f"position {t}")


def test_it_is_the_gated_delta_rule_in_matrix_form():
    """S_t = (I − β k̂ k̂ᵀ) γ S_{t−1} + β k̂ vᵀ and o = Σ_l w_l q̂ᵀ S, written independently in fp64."""
    q, k, v, w, beta, decay = inputs()
    o, S = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay)
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


def test_the_state_carries_across_calls_and_resets_start_it_afresh():
    q, k, v, w, beta, decay = inputs()
    o, S = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay)
    o1, S1 = delta_rule(q[:, :6], k[:, :6], v[:, :6], w, OMEGAS, beta[:, :6], decay=decay[:, :6])
    o2, S2 = delta_rule(q[:, 6:], k[:, 6:], v[:, 6:], w, OMEGAS, beta[:, 6:], decay=decay[:, 6:], state=S1)
    assert_rel(torch.cat([o1, o2], 1), o, 1e-12, "o")
    assert_rel(S2, S, 1e-12, "S")
    resets = torch.zeros(q.shape[:2], dtype=torch.bool)
    resets[:, 6] = True  # the same as a second call from an empty state
    o3, _ = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay, state=torch.randn_like(S), resets=resets)
    o4, _ = delta_rule(q[:, 6:], k[:, 6:], v[:, 6:], w, OMEGAS, beta[:, 6:], decay=decay[:, 6:])
    assert_rel(o3[:, 6:], o4, 1e-12, "o after the reset")


def test_gradients_reach_every_input():
    q, k, v, w, beta, decay = (x.float().requires_grad_() for x in inputs(dtype=torch.float32))
    o, S = delta_rule(q, k, v, w, OMEGAS, beta, decay=decay)
    (o.square().sum() + S.sum()).backward()
    for name, x in zip("q k v w beta decay".split(), (q, k, v, w, beta, decay)):
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0, name
