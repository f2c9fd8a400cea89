"""A second derivative through a kernel (a gradient penalty, a Hessian-vector product) is either
right or refused: paths whose backward is a hand-written autograd Function raise
(``backend.first_order_only``) instead of treating that backward as a constant, which gives wrong
second derivatives (relative errors 0.2–1). Plain-autograd paths must equal the reference."""
import pytest
import torch

from fractus.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from fractus.ops.kuramoto import kuramoto_phase, kuramoto_phase_reference
from fractus.ops.linear_attention import linear_attention, linear_attention_reference
from fractus.ops.moe import moe, moe_reference
from util import assert_rel

B, T, H, D = 1, 5, 2, 16  # interpreted Triton: tiny shapes


def _attention(fn, **kw):
    def op(x):  # x [B·T, H·D] → q = k = v
        q = x.view(B, T, H, D)
        return fn(q, q, q, torch.tensor([0.7, 0.3]), (1.0, 0.38), **kw)[0].square().sum()
    return op, torch.randn(B * T, 8, generator=torch.Generator().manual_seed(5)), H * D


def _kuramoto(fn, **kw):
    g = torch.Generator().manual_seed(1)
    omega, U, lam = 0.1 * torch.randn(8, generator=g), torch.randn(8, 2, generator=g) / 3, torch.full((2,), 0.5)
    return (lambda x: fn(x, omega, U, lam, 0.1, 2, 0.05, **kw).sin().sum()), torch.randn(7, 4, generator=g), 8


def _cross_entropy(fn, **kw):
    g = torch.Generator().manual_seed(2)
    weight, targets = torch.randn(24, 16, generator=g), torch.randint(0, 24, (9,), generator=g)
    return (lambda x: fn(x, weight, targets, **kw)), torch.randn(9, 4, generator=g), 16


def _moe(fn, **kw):
    g = torch.Generator().manual_seed(3)
    E, d, F, r = 3, 16, 16, 16
    ex = {"V1": torch.randn(E, d, r, generator=g) / 4, "U1": torch.randn(E, F, r, generator=g) / 4,
          "b1": torch.zeros(E, F), "s1": torch.ones(E), "V2": torch.randn(E, F, r, generator=g) / 4,
          "U2": torch.randn(E, d, r, generator=g) / 4, "b2": torch.zeros(E, d), "s2": torch.ones(E)}
    idx, w = torch.randint(0, E, (6, 2), generator=g), torch.full((6, 2), 0.5)
    return (lambda x: fn(x, idx, w, ex, **kw).square().sum()), torch.randn(6, 4, generator=g), d


OPS = {"linear_attention": (_attention, linear_attention, linear_attention_reference),
       "kuramoto_phase": (_kuramoto, kuramoto_phase, kuramoto_phase_reference),
       "linear_cross_entropy": (_cross_entropy, linear_cross_entropy, linear_cross_entropy_reference),
       "moe": (_moe, moe, moe_reference)}


def second_derivative(make, fn, **kw):
    """d/dA ‖∂L/∂x‖² for L = op(x·A): a gradient penalty through an upstream linear layer."""
    op, x, width = make(fn, **kw)
    x.requires_grad_(True)
    A = (torch.randn(x.shape[1], width, generator=torch.Generator().manual_seed(4)) / 2).requires_grad_(True)
    gx, = torch.autograd.grad(op(x @ A), x, create_graph=True)
    return torch.autograd.grad(gx.square().sum(), A)[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(OPS))
def test_second_derivative_is_right_or_refused(name, backend):
    make, fn, ref = OPS[name]
    truth = second_derivative(make, ref)
    try:
        got = second_derivative(make, fn, backend=backend)
    except RuntimeError as e:
        assert "second derivatives (create_graph=True) are not supported" in str(e), e
        return
    assert_rel(got, truth, 1e-4, f"{name}[{backend}]")
