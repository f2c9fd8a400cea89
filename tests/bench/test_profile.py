"""The profiler breakdown (:mod:`fractus.bench.profile`): the original's tables, the forward's
components, the attribution of CUDA events, and the launch counts of the CPU and GPU paths."""
from dataclasses import replace

import pytest
import torch

from fractus.bench import profile as P
from fractus.bench.setup import Setup
from fractus.model import FractusConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_originals_profile_tables_add_up_and_map_every_component():
    assert set(P.ORIGINAL_ROWS) == set(P.COMPONENTS)
    assert set(P.ORIGINAL_ROWS.values()) == set(P.ORIGINAL_FORWARD_MS)
    assert sum(P.ORIGINAL_FORWARD_MS.values()) == P.ORIGINAL_PHASES_MS["forward"]
    assert sum(v for k, v in P.ORIGINAL_PHASES_MS.items() if k != "total") == P.ORIGINAL_PHASES_MS["total"]


def test_forward_components_cover_the_profiled_forward():
    r = Setup(preset="tiny", vocab_size=512, tie_head=True, sparse_moe=True, fused_ce=True, batch_size=2,
                chunk_len=16)
    fc = P.forward_components(r, iters=1, warmup=1)
    total = sum(fc[c] for c in P.COMPONENTS)
    assert total == pytest.approx(fc["forward"], rel=0.02)
    for label in ("attention", "kuramoto", "moe", "head_loss", "norms"):
        assert fc[label] > 0, label
    assert fc["backward"] > 0 and fc["optimizer"] > 0 and fc["ops"] > 50
    ph = P.phase_times(r, iters=1, warmup=1)
    assert ph["total"] == pytest.approx(ph["forward"] + ph["backward"] + ph["optimizer"])


def test_attribute_counts_cuda_backward_on_autograd_thread():
    """On CUDA the backward's kernels run on autograd's device thread, outside the backward range;
    the kernels' events and the GPU's copies of the ranges are not counted again."""
    from types import SimpleNamespace as Ev

    from torch.autograd import DeviceType

    def ev(name, thread, dev_self, dev_total=None, parent=None, device_type=DeviceType.CPU):
        return Ev(name=name, thread=thread, cpu_parent=parent, self_device_time_total=dev_self * 1e3,
                  device_time_total=(dev_total if dev_total is not None else dev_self) * 1e3,
                  self_cpu_time_total=0.0, cpu_time_total=0.0, device_type=device_type)
    fwd = ev(P._MARK + "forward", 1, 0.0, 5.0)
    events = [fwd, ev("attention", 1, 5.0, parent=fwd), ev(P._MARK + "backward", 1, 0.0, 0.5),
              ev("autograd::engine::evaluate_function: MmBackward0", 2, 7.0),
              ev(P._MARK + "optimizer", 1, 0.0, 1.0),
              # the kernels' own events (a stream for a thread): their time is in their ops' already
              ev("_la_out_kernel", 7, 5.0, device_type=DeviceType.CUDA),
              ev("sm90_xmma_gemm_bf16", 7, 7.0, device_type=DeviceType.CUDA),
              # the GPU's copies of the ranges (user annotations, named alike): not counted twice
              ev(P._MARK + "forward", 7, 5.0, device_type=DeviceType.CUDA),
              ev(P._MARK + "backward", 7, 7.0, device_type=DeviceType.CUDA)]
    out = P.attribute(events, device_time=True)
    assert out["forward"] == 5.0 and out["attention"] == 5.0
    assert out["backward"] == 7.5 and out["optimizer"] == 1.0


def _launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return P.launched_ops(prof.events())


@pytest.fixture
def four_threads():
    """Four torch threads: CPU's kernels take their parallel paths (which call other ops inside)."""
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("n", [4, 1 << 18])  # small, and large enough for CPU's kernels to call helpers inside
def test_launched_ops_counts_an_op_once_whatever_it_calls_inside(n, four_threads):
    """One launch per op that does work, however CPU's ATen implements it at this size and thread
    count (a large cat narrows its inputs: views only; zeros fills; a large sum may fill and copy),
    none for views; an op built of two working ops counts two."""
    a, b, rows = torch.randn(8, n), torch.randn(8, n), torch.tensor([0, 1])
    assert _launches(lambda: torch.stack([a, b])) == 1
    assert _launches(lambda: torch.zeros(8, n)) == 1
    assert _launches(lambda: a.sum(0)) == 1
    assert _launches(lambda: a.bfloat16().sum(0)) == 2  # the cast, then the sum
    assert _launches(lambda: (a.t(), a.view(-1), a[1:])) == 0
    assert _launches(lambda: a.index_add(0, rows, b[:2])) == 2  # clone, then index_add_


def test_gpu_launch_count_does_not_vary_with_the_batch(four_threads):
    """The GPU path's launches are a property of the structure: the same at B=8 and B=64 (B=1 skips
    copies of tensors that are contiguous only then; few tokens split the head's vocabulary)."""
    r = Setup(preset="palier0", vocab_size=512, tie_head=True, sparse_moe=True, fused_ce=True, chunk_len=128)
    assert P.gpu_launch_count(replace(r, batch_size=8)) == P.gpu_launch_count(replace(r, batch_size=64))


def test_gpu_launch_count_grows_with_layers_not_experts():
    """Launches of the GPU's path (Triton launches captured): per layer a fixed number, whatever the
    expert count; the CPU path's sorted MoE instead runs ops per expert."""
    def setup(**dims):
        return Setup(preset="tiny", vocab_size=256, tie_head=True, sparse_moe=True, fused_ce=True,
                       chunk_len=16, batch_size=2, dims=tuple(dims.items()))
    one, two = (P.gpu_launch_count(setup(n_layers=n, n_experts=4)) for n in (1, 2))
    assert 20 < two - one < 400  # a block: attention, clock, MoE and norms, forward and backward
    assert P.gpu_launch_count(setup(n_layers=1, n_experts=16)) == one
    cpu = [P.op_count(setup(n_layers=1, n_experts=e))["ops"] for e in (4, 16)]
    assert cpu[1] > cpu[0]


def test_clock_launch_counts_per_path():
    cfg = FractusConfig.preset("palier0")
    n = P.clock_ops(cfg)
    more = P.clock_ops(FractusConfig.preset("palier0", kuramoto_steps=2 * cfg.kuramoto_steps))
    assert 2 <= n["triton"] < n["torch"] < n["reference"], n
    assert more["triton"] == n["triton"] and more["reference"] > n["reference"] and more["torch"] > n["torch"]
