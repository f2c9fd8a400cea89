"""The interpreter as :mod:`fractus.ops.interpreter` makes it (installed by conftest): tf32 dots read
fp32 operands as a GPU's tensor cores do (10 mantissa bits, the low 13 truncated), IEEE dots and
half-precision operands stay exact; bf16 is rounded to nearest-even as a GPU's conversions do and
computed on by value (the plain interpreter computes on its bits and truncates)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fractus.ops import common as backend
from fractus.ops import interpreter


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


@triton.jit
def _bf16_more_kernel(x_ptr, y_ptr, z_ptr, f8_ptr, cmp_ptr, both_ptr, fma_ptr, to8_ptr, from8_ptr,
                      N: tl.constexpr):
    i = tl.arange(0, N)
    x, y, z = tl.load(x_ptr + i), tl.load(y_ptr + i), tl.load(z_ptr + i)
    tl.store(cmp_ptr + i, (x > y).to(tl.float32))
    tl.store(both_ptr + i, ((x > 0) & (y > 0)).to(tl.int32))
    tl.store(fma_ptr + i, tl.fma(x, y, z))
    tl.store(to8_ptr + i, x.to(tl.float8e5, fp_downcast_rounding="rtne"))
    tl.store(from8_ptr + i, tl.load(f8_ptr + i).to(tl.bfloat16))


def test_bf16_comparisons_fma_and_fp8():
    """A comparison of bf16 gives booleans (cast and combined as such); an fma rounds once (x·y + z
    = −15.09375 + 1.4e-7 rounds up to −15.0625; rounding x·y + z to fp32 first made it a tie, and
    −15.125); fp8 ↔ bf16 casts keep the interpreter's own fp8 conversion."""
    x = torch.tensor([-6.0, 2.5, -1.0, 0.5, 3.0, -7.0, 96.0, 1.0]).bfloat16()
    y = torch.tensor([2.515625, 1.0, -2.0, 0.5, -1.0, 2.0, 4.0, 0.25]).bfloat16()
    z = torch.tensor([1.378e-7, 0, 0, 0, 0, 0, 0, 0]).bfloat16()
    f8 = x.to(torch.float8_e5m2)
    cmp, fma = torch.full((8,), float("nan")), torch.full((8,), float("nan"), dtype=torch.bfloat16)
    both, to8 = torch.full((8,), -1, dtype=torch.int32), torch.zeros(8, dtype=torch.float8_e5m2)
    from8 = torch.full((8,), float("nan"), dtype=torch.bfloat16)
    _bf16_more_kernel[(1,)](x, y, z, f8, cmp, both, fma, to8, from8, N=8)
    assert torch.equal(cmp, (x > y).float()) and torch.equal(both, ((x > 0) & (y > 0)).int())
    assert fma[0].item() == -15.0625 and torch.equal(fma[1:], (x * y)[1:])
    assert torch.equal(to8.float(), f8.float()) and torch.equal(from8, f8.bfloat16())


def test_bf16_bits():
    """The conversions the patch uses: nearest-even at ties, NaN kept, infinities and zeros kept."""
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, -np.inf, 0.0, np.nan, 3e38], np.float32)
    values = interpreter.bf16_values(interpreter.bf16_bits(x))
    assert np.array_equal(values, torch.from_numpy(x).bfloat16().float().numpy(), equal_nan=True)
    assert np.array_equal(values[:7], [1.0, 1.0, 1 + 2 ** -6, -2.5, np.inf, -np.inf, 0.0]) and np.isnan(values[7])


def test_triton_on_cpu_installs_the_emulation(monkeypatch):
    """Any Triton op on CPU tensors gets it, not only the tests (conftest installed it already)."""
    calls = []
    monkeypatch.setattr(interpreter, "install", lambda: calls.append(1))
    assert backend.pick("triton", torch.zeros(1)) == "triton" and calls == [1]
    assert backend.pick("torch", torch.zeros(1)) == "torch" and calls == [1]
