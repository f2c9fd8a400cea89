"""Triton's interpreter made to compute as a GPU does, so that kernels run on CPU tensors meet a
GPU's rounding. :func:`install` patches it in place (once; :func:`fractus.ops.common.pick` calls it
when a Triton kernel runs on CPU tensors, ``tests/conftest.py`` at start-up):

- bf16: the interpreter stores bf16 as its 16 bits and then treats them as integers: ``tl.dot``,
  arithmetic, comparisons and reductions on bf16 give garbage, and fp32 → bf16 casts truncate.
  Here bf16 is decoded to fp32 exactly, computed on, and rounded back to nearest-even (a GPU's
  ``cvt.rn.bf16.f32``); dots multiply bf16 operands exactly and accumulate in fp32, as tensor
  cores do; an fma rounds once. Reductions and scans of bf16 are summed in fp32 and rounded once,
  where a GPU rounds each partial sum in an order of its own (so its error is larger; the
  kernels here reduce in fp32).
- tf32: the interpreter multiplies fp32 operands of a "tf32" dot (``tl.dot``'s default) exactly,
  where Hopper's tensor cores keep 10 mantissa bits (the PTX ISA's ``wgmma``; Triton PR #8873
  masks them in its Hopper test). Here the low 13 bits are dropped (truncation: the larger error
  of truncating and rounding).

fp16 and fp32 arithmetic is left as it is: numpy already rounds them as a GPU does.

The checks made on top of it (offsets past 2³¹ elements) are :mod:`fractus.verify.interpret`'s.
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
    """fp32 values → bf16 bits (uint16), rounded to nearest-even (or toward zero); a NaN stays a
    NaN of its sign."""
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    nan = (b >> 16) | np.uint32(0x40)  # the quiet bit set: the payload's top bits may be zero
    if not truncate:
        b = b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))
    return np.where(np.isnan(x), nan, b >> 16).astype(np.uint16)


def bf16_values(bits) -> np.ndarray:
    """bf16 bits (uint16) → their fp32 values (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _is_bf16(h) -> bool:
    return isinstance(h, _Handle) and h.dtype.scalar == tl.bfloat16


def _f32(h):
    return _Handle(bf16_values(h.data), tl.float32) if _is_bf16(h) else h


def _to_odd(r: np.ndarray, short: np.ndarray) -> np.ndarray:
    """r, a rounding of an exact value that exceeds it by ``short``, rounded to odd instead: toward
    zero, its last bit set when inexact."""
    uint = np.uint64 if r.dtype == np.float64 else np.uint32
    toward_zero = np.where(short * np.sign(r) < 0, np.nextafter(r, r.dtype.type(0)), r)
    odd = (toward_zero.view(uint) | uint(1)).view(r.dtype)
    return np.where((short != 0) & np.isfinite(r), odd, r)


def _bf16_of_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bf16 bits of a + b (fp64), rounded once to nearest-even: the sum rounded to odd in fp64
    (TwoSum gives what its rounding lost), then in fp32; rounding to odd at more than 2 bits beyond
    the target leaves the last rounding the only one."""
    s = a + b
    bb = s - a
    s = _to_odd(s, (a - (s - bb)) + (b - bb))
    r = s.astype(np.float32)
    return bf16_bits(_to_odd(r, s - r.astype(np.float64)))


def _as_bf16(result):
    """A result computed in fp32 for bf16 operands: a float rounded back to bf16, a comparison's
    booleans as they are."""
    if result.data.dtype.kind == "f":
        return _Handle(bf16_bits(result.data), tl.bfloat16)
    return _Handle(result.data, tl.int1)


def install() -> None:
    """Patch the interpreter's builder, reductions and scans (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    B, R, S = _Builder, _interp.ReduceOps, _interp.ScanOps
    for name, method in _bf16_builder(B).items():
        setattr(B, name, method)
    R.sum, R.min_max = _on_values(R.sum), _on_values(R.min_max)
    S.cumsum, S.cumprod = _on_values(S.cumsum), _on_values(S.cumprod)


def _is_fp8(ty) -> bool:
    return ty.scalar.is_floating() and ty.scalar.primitive_bitwidth == 8


def _bf16_builder(B) -> dict:
    """The builder's methods that bf16 and tf32 reach, by name, each wrapping ``B``'s own."""
    cast, to_fp, binary, unary, ternary, fma, dot = (
        B.cast_impl, B.create_fp_to_fp, B.binary_op, B.unary_op, B.ternary_op, B.create_fma, B.create_dot)

    def cast_impl(self, src, dst_type, rounding_mode=None):
        """Casts to and from bf16 by value (fp8's through fp32 by the interpreter's own conversion)."""
        dst = dst_type.scalar
        if dst == tl.bfloat16 and not _is_bf16(src):
            values = to_fp(self, src, tl.float32, None).data if _is_fp8(src.dtype) else src.data.astype(np.float32)
            return _Handle(bf16_bits(values, rounding_mode == ir.ROUNDING_MODE.RTZ), tl.bfloat16)
        if _is_bf16(src) and dst != tl.bfloat16:
            if _is_fp8(dst_type):
                return to_fp(self, _f32(src), dst_type, rounding_mode)
            return _Handle(bf16_values(src.data).astype(_interp._get_np_dtype(dst_type)), dst)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if _is_bf16(src) or dst_type.scalar == tl.bfloat16:
            return cast_impl(self, src, dst_type, rounding_mode)
        return to_fp(self, src, dst_type, rounding_mode)

    def binary_op(self, lhs, rhs, op):
        if _is_bf16(lhs) or _is_bf16(rhs):
            return _as_bf16(binary(self, _f32(lhs), _f32(rhs), op))
        return binary(self, lhs, rhs, op)

    def unary_op(self, arg, op):
        return _as_bf16(unary(self, _f32(arg), op)) if _is_bf16(arg) else unary(self, arg, op)

    def ternary_op(self, lhs, rhs, other, op):
        if op is not np.where and (_is_bf16(lhs) or _is_bf16(other)):  # a select moves bits: exact
            return _as_bf16(ternary(self, _f32(lhs), _f32(rhs), _f32(other), op))
        return ternary(self, lhs, rhs, other, op)

    def create_fma(self, x, y, z):
        if not _is_bf16(z):
            return fma(self, x, y, z)
        x, y, z = (bf16_values(h.data).astype(np.float64) for h in (x, y, z))
        return _Handle(_bf16_of_sum(x * y, z), tl.bfloat16)  # x·y is exact in fp64

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = _f32(a), _f32(b)
        if input_precision == ir.INPUT_PRECISION.TF32:
            a, b = (_Handle((x.data.view(np.uint32) & TF32_KEEP).view(np.float32), x.dtype)
                    if x.data.dtype == np.float32 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    return dict(cast_impl=cast_impl, create_fp_to_fp=create_fp_to_fp, binary_op=binary_op, unary_op=unary_op,
                ternary_op=ternary_op, create_fma=create_fma, create_dot=create_dot)


def _on_values(method):
    """A reduction or scan of bf16 computed on its fp32 values and rounded back."""
    def run(self, input, *args, **kw):
        values = input[0] if isinstance(input, tuple) else input  # min_max may get (values, indices)
        if values.dtype.scalar != tl.bfloat16:
            return method(self, input, *args, **kw)
        out = method(self, self.to_tensor(bf16_values(values.handle.data), tl.float32), *args, **kw)
        return type(out)(map(_to_bf16, out)) if isinstance(out, (list, tuple)) else _to_bf16(out)
    return run


def _to_bf16(t):
    """A tensor of fp32 rounded to bf16 (others as they are)."""
    if t.dtype.scalar != tl.float32:
        return t
    return tl.core.tensor(_Handle(bf16_bits(t.handle.data), tl.bfloat16), t.type.with_element_ty(tl.bfloat16))
