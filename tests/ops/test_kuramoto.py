"""Kuramoto clock: the fused autograd Function (hand-written RK4 backward) and the Triton kernels
(interpreter) vs plain autograd."""
import numpy as np
import pytest
import torch

from fractus.ops.kuramoto import kuramoto_phase, kuramoto_phase_reference
from fractus.model import FractusConfig, FractusCTE
from util import assert_rel


def make_inputs(M, N, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = 3 * torch.randn(M, N, generator=g)
    omega = 0.3 * torch.randn(N, generator=g)
    U = torch.randn(N, r, generator=g) / N ** 0.5
    lam = 0.5 + torch.rand(r, generator=g)
    return [t.to(dtype).requires_grad_() for t in (theta, omega, U, lam)]


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_gradcheck_fp64(steps):
    args = make_inputs(7, 5, 3, torch.float64)
    assert torch.autograd.gradcheck(lambda *a: kuramoto_phase(*a, 0.1, steps, 0.1), args)


@pytest.mark.parametrize("M,N,r,steps,dt,damping", [(1, 4, 2, 2, 0.1, 0.1), (37, 8, 4, 2, 0.1, 0.1),
                                                    (300, 16, 8, 3, 0.05, 0.0), (65, 6, 6, 1, 0.3, 0.5)])
def test_fused_matches_reference_fp32(M, N, r, steps, dt, damping):
    args = make_inputs(M, N, r, torch.float32, seed=M)
    g = torch.randn(M)
    outs = []
    for fn in (kuramoto_phase, kuramoto_phase_reference):
        psi = fn(*args, dt, steps, damping)
        outs.append((psi, *torch.autograd.grad(psi, args, g)))
    for name, a, b in zip(("psi", "d theta", "d omega", "d U", "d lambda"), *outs):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("M,N,r,steps,dt,damping", [(1, 4, 2, 2, 0.1, 0.1), (37, 8, 4, 2, 0.1, 0.1),
                                                    (300, 16, 8, 3, 0.05, 0.0), (65, 6, 6, 1, 0.3, 0.5),
                                                    (70, 20, 8, 2, 0.1, 0.1)])
def test_triton_matches_fp64_truth(M, N, r, steps, dt, damping):
    """ψ and every gradient of the Triton kernels (rows not a multiple of the block, N padded to
    16 or 32) against plain autograd in fp64: relative error < 1e-4, as the fused path."""
    g = torch.randn(M, dtype=torch.float64)
    outs = {}
    for name, dtype, fn in (("triton", torch.float32, lambda *a: kuramoto_phase(*a, backend="triton")),
                            ("torch", torch.float32, kuramoto_phase),
                            ("truth", torch.float64, kuramoto_phase_reference)):
        args = make_inputs(M, N, r, dtype, seed=M)
        psi = fn(*args, dt, steps, damping)
        outs[name] = (psi, *torch.autograd.grad(psi, args, g.to(dtype)))
    for i, name in enumerate(("psi", "d theta", "d omega", "d U", "d lambda")):
        for path in ("triton", "torch"):
            assert_rel(outs[path][i].double(), outs["truth"][i], 1e-4, f"{path} {name}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_grad_path_equals_grad_path(backend):
    args = make_inputs(50, 8, 4, torch.float32)
    with torch.no_grad():
        a = kuramoto_phase(*args, 0.1, 2, 0.1, backend=backend)
    assert_rel(a, kuramoto_phase(*args, 0.1, 2, 0.1, backend=backend).detach(), 1e-7, "no-grad vs grad")


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        kuramoto_phase(*make_inputs(3, 4, 2, torch.float32), 0.1, 2, 0.1, backend="cuda")


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_model_gradients_match_reference_clock(path):
    """Whole-model loss and every parameter gradient with the fused (or Triton) clock vs the
    reference one (attention, MoE and CE on their reference paths in both, so only the clock differs)."""
    cfg = FractusConfig.preset("tiny", n_oscillators=8, coupling_rank=4)
    x = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    grads = []
    for clock in (path, "reference"):
        torch.manual_seed(0)
        model = FractusCTE(FractusConfig.preset("tiny", n_oscillators=8, coupling_rank=4, backend="reference"))
        for blk in model.blocks:
            blk.clock.cfg = FractusConfig.preset("tiny", n_oscillators=8, coupling_rank=4, backend=clock)
        _, parts, _ = model(x, targets=x)
        parts["loss"].backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    flat = [torch.cat([g[n].flatten() for n in sorted(g)]) for g in grads]
    assert_rel(flat[0], flat[1], 1e-5, "all gradients")
    scale = max(g.norm() for g in grads[1].values())
    for n in grads[1]:  # near-cancelling gradients (level logits at init) are left to the global check
        if grads[1][n].norm() > 1e-3 * scale:
            assert_rel(grads[0][n], grads[1][n], 1e-4, n)  # fp32 summation-order noise is ~1e-5
    assert any("clock.U" in n for n in grads[1]) and any("clock.encoder" in n for n in grads[1])


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_bad_shapes_and_dtypes_are_refused(backend):
    """Shapes that the Triton kernels would read out of bounds, dtypes the paths would treat
    differently, and integration settings without meaning are a ValueError naming the argument
    on every path."""
    theta, omega, U, lam = (t.detach() for t in make_inputs(5, 8, 2, torch.float32))
    cases = [((theta[0], omega, U, lam), "theta0 must be a floating \\[M, N\\]"),
             ((theta.long(), omega, U, lam), "theta0 must be a floating"),
             ((theta, omega[:1], U, lam), "omega must be \\[8\\]"),
             ((theta, omega, U[:7], lam), "U must be \\[8, 2\\]"),
             ((theta, omega, U, lam[:1]), "U must be \\[8, 1\\]"),
             ((theta, omega.double(), U, lam), "omega must be \\[8\\] torch.float32"),
             ((theta.half(), omega.half(), U.half(), lam.half()), "too fine for half precision"),
             ((theta.bfloat16(), omega, U, lam), "too fine for half precision")]
    if backend == "triton":  # the kernels compute in fp32: fp64 would come back rounded
        cases.append(((theta.double(), omega.double(), U.double(), lam.double()), "kernels compute in fp32"))
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            kuramoto_phase(*args, 0.1, 2, 0.05, backend=backend)
    for dt, steps, damping in ((0.1, 0, 0.05), (0.1, -1, 0.05), (0.1, 2.0, 0.05), (float("nan"), 2, 0.05),
                               (0.0, 2, 0.05), (float("inf"), 2, 0.05), (0.1, 2, -0.1), (0.1, 2, float("nan"))):
        with pytest.raises(ValueError, match="steps ≥ 1, a finite dt > 0 and a finite damping ≥ 0"):
            kuramoto_phase(theta, omega, U, lam, dt, steps, damping, backend=backend)
    for steps in (True, 2.5):
        with pytest.raises(ValueError, match="an integer steps ≥ 1"):
            kuramoto_phase(theta, omega, U, lam, 0.1, steps, 0.05, backend=backend)
    assert_rel(kuramoto_phase(theta, omega, U, lam, 0.1, np.int64(2), 0.05, backend=backend),
               kuramoto_phase(theta, omega, U, lam, 0.1, 2, 0.05, backend=backend), 1e-7, "numpy steps")
