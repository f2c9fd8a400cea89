"""Test set-up: Triton kernels run in the interpreter on CPU, computing bf16 and tf32 as a GPU does
(:mod:`fractus.ops.interpreter`), and outputs are NaN-poisoned. Under ``pytest -n N --dist
loadfile`` (``make test``) the workers share the cores."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # before torch: its threads, and its subprocesses' and kernels'
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
import torch  # noqa: E402

from fractus.ops import common as backend  # noqa: E402
from fractus.verify import interpret  # noqa: E402

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
