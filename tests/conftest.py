"""Test set-up: Triton kernels run in the interpreter on CPU, its tf32 dots read operands as a GPU
does, and outputs are NaN-poisoned."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from fractus.kernels import backend  # noqa: E402

TF32_DROP = np.uint32(0xFFFFE000)  # fp32 bits a tf32 operand keeps: sign, exponent, 10 mantissa bits


def _tf32_dots():
    """Make the interpreter's ``tl.dot`` read fp32 operands as tf32 when asked for "tf32" (tl.dot's
    default): it multiplies them exactly, where a GPU's tensor cores keep 10 mantissa bits. The low
    13 bits are dropped (truncation: the larger error of truncating and rounding), so the fp16
    kernels' tf32 dots, and any fp32 dot left at the default, show a GPU's error on the CPU."""
    exact = interpreter.InterpreterBuilder.create_dot

    def tf32(x):
        if x.data.dtype != np.float32:
            return x
        return interpreter.TensorHandle((x.data.view(np.uint32) & TF32_DROP).view(np.float32), x.dtype)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision == ir.INPUT_PRECISION.TF32:
            a, b = tf32(a), tf32(b)
        return exact(self, a, b, d, input_precision, max_num_imprecise_acc)
    interpreter.InterpreterBuilder.create_dot = create_dot


_tf32_dots()


@pytest.fixture(autouse=True)
def _seed_and_poison():
    torch.manual_seed(0)
    with backend.poisoned():
        yield


@pytest.fixture
def one_thread():
    """One torch thread for small tensors: OpenMP threads only contend on the shared cores (2-6x
    slower); restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
