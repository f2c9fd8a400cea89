"""Test set-up: Triton kernels run in the interpreter on CPU, computing bf16 and tf32 as a GPU does
(:mod:`fractus.kernels.interpret`), and outputs are NaN-poisoned."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from fractus.kernels import backend, interpret  # noqa: E402

interpret.install()  # bf16 and tf32 computed as a GPU does, for kernels launched directly too


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
