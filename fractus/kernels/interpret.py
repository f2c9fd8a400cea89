"""Triton's interpreter made to compute as a GPU does, so that kernels checked on the CPU meet a
GPU's rounding. :func:`install` patches it in place (once; :mod:`.backend` calls it when a
Triton kernel runs on CPU tensors, ``tests/conftest.py`` at start-up):

- bf16: the interpreter stores bf16 as its 16 bits and then treats them as integers: ``tl.dot``,
  arithmetic, comparisons and reductions on bf16 give garbage, and fp32 → bf16 casts truncate.
  Here bf16 is decoded to fp32 exactly, computed on, and rounded back to nearest-even (a GPU's
  ``cvt.rn.bf16.f32``); dots multiply bf16 operands exactly and accumulate in fp32, as tensor
  cores do.
- tf32: the interpreter multiplies fp32 operands of a "tf32" dot (``tl.dot``'s default) exactly,
  where Hopper's tensor cores keep 10 mantissa bits (the PTX ISA's ``wgmma``; Triton PR #8873
  masks them in its Hopper test). Here the low 13 bits are dropped (truncation: the larger error
  of truncating and rounding).

fp16 and fp32 arithmetic is left as it is: numpy already rounds them as a GPU does.
"""
from __future__ import annotations

import numpy as np
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime import interpreter as _interp

TF32_KEEP = np.uint32(0xFFFFE000)  # fp32 bits a tf32 operand keeps: sign, exponent, 10 mantissa bits
_Handle, _Builder = _interp.TensorHandle, _interp.InterpreterBuilder
_installed = False


def bf16_bits(x, truncate: bool = False) -> np.ndarray:
    """fp32 values → bf16 bits (uint16), rounded to nearest-even (or toward zero); NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    if not truncate:
        b = b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))
    out = (b >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out) if np.isnan(x).any() else out


def bf16_values(bits) -> np.ndarray:
    """bf16 bits (uint16) → their fp32 values (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _is_bf16(h) -> bool:
    return isinstance(h, _Handle) and h.dtype.scalar == tl.bfloat16


def _f32(h):
    return _Handle(bf16_values(h.data), tl.float32) if _is_bf16(h) else h


def _as_bf16(result, like):
    """A result computed in fp32 for bf16 operands, rounded back to bf16 if it is a float."""
    if result.data.dtype.kind == "f":
        return _Handle(bf16_bits(result.data), tl.bfloat16)
    return _Handle(result.data, like.dtype.scalar)


def install() -> None:
    """Patch the interpreter's builder, reductions and scans (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    B, R, S = _Builder, _interp.ReduceOps, _interp.ScanOps
    cast, to_fp, binary, unary, ternary, fma, erf, dot = (
        B.cast_impl, B.create_fp_to_fp, B.binary_op, B.unary_op, B.ternary_op, B.create_fma, B.create_erf,
        B.create_dot)

    def cast_impl(self, src, dst_type, truncate=False):
        dst = dst_type.scalar
        if dst == tl.bfloat16 and not _is_bf16(src):
            return _Handle(bf16_bits(src.data.astype(np.float32), truncate), tl.bfloat16)
        if _is_bf16(src) and dst != tl.bfloat16:
            return _Handle(bf16_values(src.data).astype(_interp._get_np_dtype(dst_type)), dst)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if _is_bf16(src) or dst_type.scalar == tl.bfloat16:
            return cast_impl(self, src, dst_type, truncate=rounding_mode == ir.ROUNDING_MODE.RTZ)
        return to_fp(self, src, dst_type, rounding_mode)

    def binary_op(self, lhs, rhs, op):
        if _is_bf16(lhs) or _is_bf16(rhs):
            return _as_bf16(binary(self, _f32(lhs), _f32(rhs), op), lhs)
        return binary(self, lhs, rhs, op)

    def unary_op(self, arg, op):
        return _as_bf16(unary(self, _f32(arg), op), arg) if _is_bf16(arg) else unary(self, arg, op)

    def ternary_op(self, lhs, rhs, other, op):
        if op is not np.where and (_is_bf16(lhs) or _is_bf16(other)):  # a select moves bits: exact
            return _as_bf16(ternary(self, _f32(lhs), _f32(rhs), _f32(other), op), other)
        return ternary(self, lhs, rhs, other, op)

    def create_fma(self, x, y, z):
        if _is_bf16(z):
            return _as_bf16(fma(self, _f32(x), _f32(y), _f32(z)), z)
        return fma(self, x, y, z)

    def create_erf(self, arg):
        return _as_bf16(erf(self, _f32(arg)), arg) if _is_bf16(arg) else erf(self, arg)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = _f32(a), _f32(b)
        if input_precision == ir.INPUT_PRECISION.TF32:
            a, b = (_Handle((x.data.view(np.uint32) & TF32_KEEP).view(np.float32), x.dtype)
                    if x.data.dtype == np.float32 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    B.cast_impl, B.create_fp_to_fp, B.binary_op, B.unary_op, B.ternary_op = (
        cast_impl, create_fp_to_fp, binary_op, unary_op, ternary_op)
    B.create_fma, B.create_erf, B.create_dot = create_fma, create_erf, create_dot

    def on_values(method):
        """A reduction or scan of bf16 computed on its fp32 values and rounded back."""
        def run(self, input, *args, **kw):
            values = input[0] if isinstance(input, tuple) else input  # min_max may get (values, indices)
            if values.dtype.scalar != tl.bfloat16:
                return method(self, input, *args, **kw)
            out = method(self, self.to_tensor(bf16_values(values.handle.data), tl.float32), *args, **kw)
            return type(out)(map(to_bf16, out)) if isinstance(out, (list, tuple)) else to_bf16(out)
        return run

    def to_bf16(t):
        if t.dtype.scalar != tl.float32:
            return t
        return tl.core.tensor(_Handle(bf16_bits(t.handle.data), tl.bfloat16), t.type.with_element_ty(tl.bfloat16))

    R.sum, R.min_max = on_values(R.sum), on_values(R.min_max)
    S.cumsum, S.cumprod = on_values(S.cumsum), on_values(S.cumprod)
