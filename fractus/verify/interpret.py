"""Triton's interpreter as the checks that stand in for a GPU use it: computing bf16 and tf32 as a
GPU does (:func:`install`, :mod:`fractus.ops.interpreter`'s, which ``tests/conftest.py`` runs at
start-up and :func:`fractus.ops.common.pick` whenever a Triton kernel runs on CPU tensors), and
checking kernels' offsets past 2³¹ elements.

:func:`address_check` (a context manager, off by default) checks kernels' offsets at sizes past 2³¹
elements: int32 arithmetic that a GPU would wrap raises, and each launch runs only its last programs.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interp

from fractus.ops.interpreter import install

__all__ = ["address_check", "install"]

_Handle, _Builder = _interp.TensorHandle, _interp.InterpreterBuilder


_NONE = object()
_WRAPPING = {np.add: "+", np.subtract: "-", np.multiply: "*", np.left_shift: "<<"}


def _int32_range_error(what: str, exact: np.ndarray) -> OverflowError:
    bad = exact[(exact < -2**31) | (exact >= 2**31)]
    return OverflowError(f"int32 {what} overflows ({bad.size} elements, e.g. {int(bad.flat[0])}): a GPU "
                         "wraps it to a wrong offset; cast an operand to tl.int64")


def _scalar(value: int, ty) -> tl.tensor:
    return tl.tensor(_Handle(np.array([value], dtype=np.int64 if ty == tl.int64 else np.int32), ty), ty)


def _typed_range(*bounds):
    """A kernel's ``range`` as a GPU compiles it: the loop variable an int32 scalar (int64 when a
    bound is int64 or a constant outside int32), where the interpreter's is a Python int that
    never wraps (``i * BLOCK`` past 2³¹)."""
    values = [int(b.handle.data.item()) if isinstance(b, tl.tensor) else int(getattr(b, "value", b))
              for b in bounds]
    wide = any(isinstance(b, tl.tensor) and b.dtype == tl.int64 for b in bounds)
    ty = tl.int64 if wide or any(not -2**31 <= v < 2**31 for v in values) else tl.int32
    for i in range(*values):
        yield _scalar(i, ty)


@contextmanager
def address_check(last: int = 1):
    """Inside the block, interpreted launches check the integer arithmetic of their offsets at sizes
    past 2³¹ elements, cheaply:

    - an int32 ``+ - * <<`` whose exact result leaves int32, or an int64 → int32 cast out of range,
      raises OverflowError (a GPU wraps the value: a wrong address, read or written silently). Lanes
      a mask turns off count too (a GPU computes their offsets and does not use them): the check
      errs on the side of raising;
    - the loop variable of ``range`` in the launched kernel's module is an int32 scalar (int64 when
      a bound is int64 or a constant outside int32), as on a GPU, not a Python int: ``i * BLOCK``
      is checked too;
    - each launch runs only its last ``last`` programs along grid axis 0 (the last along the others):
      the largest offsets. ``tl.program_id`` and ``tl.num_programs`` report the full grid.

    So the buffers of such a call can come from ``torch.empty`` unpoisoned: the pages nobody touches
    cost no memory. The results are garbage (the other programs never ran); only the raising counts.
    :func:`install` runs first (restoring the builder on exit must not undo it).
    """
    install()
    B, G = _Builder, _interp.GridExecutor
    if getattr(G.__call__, "address_check", False):
        raise RuntimeError("address_check is already on: its launches would select programs twice")
    saved = (B.binary_op, B.create_int_cast, B.create_get_program_id, B.create_get_num_programs, G.__call__)
    B.binary_op, B.create_int_cast = _checked_offsets(B.binary_op, B.create_int_cast)
    B.create_get_program_id, B.create_get_num_programs, G.__call__ = _last_programs(last, G.__call__)
    try:
        yield
    finally:
        (B.binary_op, B.create_int_cast, B.create_get_program_id, B.create_get_num_programs,
         G.__call__) = saved


def _checked_offsets(binary, int_cast):
    """The builder's ``binary_op`` and ``create_int_cast`` (wrapping ``binary`` and ``int_cast``),
    raising where int32 arithmetic or a cast to int32 leaves int32's range."""
    def binary_op(self, lhs, rhs, op):
        out = binary(self, lhs, rhs, op)
        if op in _WRAPPING and out.dtype == tl.int32:
            exact = op(lhs.data.astype(np.int64), rhs.data.astype(np.int64))
            if np.any(exact != out.data):
                raise _int32_range_error(f"'{_WRAPPING[op]}'", exact)
        return out

    def create_int_cast(self, src, dst_type, is_signed):
        if dst_type.scalar == tl.int32 and src.data.dtype.itemsize == 8:
            exact = src.data.astype(np.int64)
            if np.any((exact < -2**31) | (exact >= 2**31)):
                raise _int32_range_error("cast", exact)
        return int_cast(self, src, dst_type, is_signed)
    return binary_op, create_int_cast


def _last_programs(last: int, run):
    """The builder's ``create_get_program_id`` and ``create_get_num_programs`` and the grid
    executor's ``__call__`` (wrapping ``run``): each launch runs only its last ``last`` programs
    along axis 0 (the last along the others) with ``range`` typed as a GPU types it, while the
    programs see the full grid."""
    grid, programs = (1, 1, 1), []  # the launch's full grid, the programs that run

    def program_id(self, axis):
        return _Handle(np.array([programs[self.grid_idx[0]][axis]], dtype=np.int32), tl.int32)

    def num_programs(self, axis):
        return _Handle(np.array([grid[axis]], dtype=np.int32), tl.int32)

    def call(self, *args, **kwargs):
        full = self.grid

        def chosen(meta):
            nonlocal grid, programs
            g = tuple(full(meta) if callable(full) else full)
            grid = g + (1,) * (3 - len(g))
            programs = [(x, grid[1] - 1, grid[2] - 1) for x in range(max(0, grid[0] - last), grid[0])]
            return (len(programs) if min(grid) > 0 else 0,)

        self.grid = chosen
        scope = self.fn.__globals__  # the kernel's module, where its ``range`` is looked up
        own = scope.get("range", _NONE)
        scope["range"] = _typed_range
        try:
            return run(self, *args, **kwargs)
        finally:
            self.grid = full
            if own is _NONE:
                del scope["range"]
            else:
                scope["range"] = own

    call.address_check = True
    return program_id, num_programs, call
