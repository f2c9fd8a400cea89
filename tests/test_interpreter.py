"""The test set-up's interpreter (conftest): its tf32 dots read fp32 operands as a GPU's tensor cores
do (10 mantissa bits, the low 13 truncated); IEEE dots and half-precision operands stay exact."""
import pytest
import torch
import triton
import triton.language as tl


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


def test_half_operands_multiply_exactly():
    a, b = torch.randn(16, 16, dtype=torch.float16), torch.randn(16, 16, dtype=torch.float16)
    o = torch.full((16, 16), float("nan"))
    _dot_kernel[(1,)](a, b, o, PREC="tf32")
    torch.testing.assert_close(o.double(), a.double() @ b.double(), rtol=1e-6, atol=1e-6)
