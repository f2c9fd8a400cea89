"""The interpreter as :mod:`fractus.kernels.interpret` makes it (installed by conftest): tf32 dots read
fp32 operands as a GPU's tensor cores do (10 mantissa bits, the low 13 truncated), IEEE dots and
half-precision operands stay exact; bf16 is rounded to nearest-even as a GPU's conversions do and
computed on by value (the plain interpreter computes on its bits and truncates)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fractus.kernels import backend, interpret


@triton.jit
def _dot_kernel(a_ptr, b_ptr, o_ptr, PREC: tl.constexpr):
    r = tl.arange(0, 16)
    off = r[:, None] * 16 + r[None, :]
    tl.store(o_ptr + off, tl.dot(tl.load(a_ptr + off), tl.load(b_ptr + off), input_precision=PREC))


def _tf32(x):
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("prec", ["tf32", "ieee", "tf32x3"])
def test_tf32_dots_truncate_fp32_operands(prec):
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    o = torch.full((16, 16), float("nan"))
    _dot_kernel[(1,)](a, b, o, PREC=prec)
    want = _tf32(a).double() @ _tf32(b).double() if prec == "tf32" else a.double() @ b.double()
    torch.testing.assert_close(o.double(), want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(_tf32(a).double() @ _tf32(b).double(), a.double() @ b.double(), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_operands_multiply_exactly(dtype):
    a, b = torch.randn(16, 16, dtype=dtype), torch.randn(16, 16, dtype=dtype)
    o = torch.full((16, 16), float("nan"))
    _dot_kernel[(1,)](a, b, o, PREC="tf32")
    torch.testing.assert_close(o.double(), a.double() @ b.double(), rtol=1e-6, atol=1e-6)


@triton.jit
def _bf16_kernel(x_ptr, y_ptr, f_ptr, cast_ptr, cut_ptr, ar_ptr, sel_ptr, sum_ptr, max_ptr, cum_ptr,
                 N: tl.constexpr):
    i = tl.arange(0, N)
    off = i[:, None] * N + i[None, :]
    x, y, f = tl.load(x_ptr + off), tl.load(y_ptr + off), tl.load(f_ptr + off)
    tl.store(cast_ptr + off, f.to(tl.bfloat16))
    tl.store(cut_ptr + off, f.to(tl.bfloat16, fp_downcast_rounding="rtz"))
    tl.store(ar_ptr + off, (x * y - x) / y + tl.abs(x))
    tl.store(sel_ptr + off, tl.where(x < y, -x, tl.maximum(x, y)))
    tl.store(sum_ptr + i, tl.sum(x, 1))
    tl.store(max_ptr + i, tl.max(x, 1))
    tl.store(cum_ptr + off, tl.cumsum(x, 1))


def test_bf16_computed_by_value():
    """Casts from fp32 round to nearest-even (or toward zero when asked), arithmetic, comparisons,
    selects, reductions and scans on bf16 give the bf16 of their values (those of the fp32 result,
    rounded once: a GPU's reductions round each partial sum, hence the sums' tolerance)."""
    N = 16
    x, y = (torch.randn(N, N).bfloat16() for _ in range(2))
    f = torch.randn(N, N)
    outs = [torch.full((N, N), float("nan"), dtype=torch.bfloat16) for _ in range(4)]
    red = [torch.full((N,), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    cum = torch.full((N, N), float("nan"), dtype=torch.bfloat16)
    _bf16_kernel[(1,)](x, y, f, *outs, *red, cum, N=N)
    cast, cut, ar, sel = outs
    assert torch.equal(cast, f.bfloat16())
    assert torch.equal(cut, (f.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16())
    xf, yf = x.float(), y.float()
    q = (x * y - x).float() / yf  # Triton divides bf16 in fp32; torch rounds the quotient: a bf16 ulp apart
    assert ((ar.float() - ((x * y - x) / y + x.abs()).float()).abs() <= (q.abs() + xf.abs()) * 2 ** -7).all()
    assert torch.equal(sel, torch.where(x < y, -x, torch.maximum(x, y)))
    torch.testing.assert_close(red[0].float(), xf.sum(1), rtol=2 ** -7, atol=2 ** -7 * xf.abs().sum(1).max())
    assert torch.equal(red[1], x.max(1).values)
    torch.testing.assert_close(cum.float(), xf.cumsum(1), rtol=2 ** -7, atol=2 ** -6 * xf.abs().sum(1).max())


def test_bf16_bits():
    """The conversions the patch uses: nearest-even at ties, NaN kept, infinities and zeros kept."""
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, -np.inf, 0.0, np.nan, 3e38], np.float32)
    values = interpret.bf16_values(interpret.bf16_bits(x))
    assert np.array_equal(values, torch.from_numpy(x).bfloat16().float().numpy(), equal_nan=True)
    assert np.array_equal(values[:7], [1.0, 1.0, 1 + 2 ** -6, -2.5, np.inf, -np.inf, 0.0]) and np.isnan(values[7])


def test_triton_on_cpu_installs_the_emulation(monkeypatch):
    """Any Triton op on CPU tensors gets it, not only the tests (conftest installed it already)."""
    monkeypatch.setattr(interpret, "_installed", False)
    calls = []
    monkeypatch.setattr(interpret, "install", lambda: calls.append(1))
    assert backend.pick("triton", torch.zeros(1)) == "triton" and calls == [1]
    assert backend.pick("torch", torch.zeros(1)) == "torch" and calls == [1]
