"""What the kernels are launched with, which the interpreter cannot check by running them: fp32
inputs ask for IEEE dots (the tests' interpreter truncates a "tf32" dot's fp32 operands as a GPU
does, so fp32 tolerances would fail at TF32 too; this test names the kernel), low-precision ones split the attention's
carried state in its dots, every autotune key names an argument
(Triton skips a name it does not find, so a misspelt key would silently share one tuning), and the
attention's grids stay within CUDA's limits (the interpreter has none)."""
import pytest
import torch
import triton

from fractus.ops.cross_entropy import kernels as ce_kernels
from fractus.ops.kuramoto import kernels as kuramoto_kernels
from fractus.ops.linear_attention import kernels as la_kernels
from fractus.ops.linear_attention import linear_attention
from fractus.ops.moe import kernels as moe_kernels
from fractus.model import FractusConfig, FractusCTE
from util import Launches


@pytest.mark.parametrize("over", [{}, {"expert_rank": 0}], ids=["lowrank", "dense"])
def test_fp32_launches_ieee_dots(monkeypatch, over):
    launches = {}
    for mod in (la_kernels, moe_kernels, ce_kernels):
        for name in [n for n in vars(mod) if n.endswith("_kernel")]:
            launches[name] = Launches(getattr(mod, name))
            monkeypatch.setattr(mod, name, launches[name])
    model = FractusCTE(FractusConfig.preset("tiny", backend="triton", **over))
    x = torch.randint(0, 512, (2, 20))
    _, parts, state = model(x[:, :-1], targets=x[:, 1:])
    parts["loss"].backward()
    with torch.no_grad():
        model.step(x[:, -1], FractusCTE.detach_state(state))
    precs = {name: {kw.get("PREC", kw.get("DOT_PREC")) for kw in r.kwargs} for name, r in launches.items() if r.count}
    dots = {name: p for name, p in precs.items() if p != {None}}  # kernels with dots
    assert all(p == {"ieee"} for p in dots.values()), dots
    assert precs.keys() - dots.keys() == {"_la_decode_kernel"}  # the only one without a tl.dot
    assert {"_la_states_kernel", "_la_bwd_grads_kernel", "_lce_bwd_dw_kernel"} <= dots.keys()
    assert ("_lr_bwd_rows_kernel" if not over else "_gmm_kernel") in dots
    splits = {name: {kw["SDROP"] for kw in r.kwargs} for name, r in launches.items()
              if r.count and "SDROP" in r.kwargs[0]}
    assert splits == {"_la_out_kernel": {0}, "_la_bwd_states_kernel": {0}, "_la_bwd_grads_kernel": {0}}, \
        splits  # fp32: IEEE, nothing split or rounded


def test_low_precision_splits_the_state_dots(monkeypatch):
    """fp16 inputs (state dots in tf32) and bf16: the dots with the carried state split it into
    hi + lo operands at the dot's precision, and every fp32 operand of a tf32 dot is rounded to
    nearest (see linear_attention's note on the state dots)."""
    launches = {}
    for name in ("_la_out_kernel", "_la_bwd_states_kernel", "_la_bwd_grads_kernel"):
        launches[name] = Launches(getattr(la_kernels, name))
        monkeypatch.setattr(la_kernels, name, launches[name])
    x = [torch.randn(1, 20, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    w = torch.ones(1, requires_grad=True)
    o, _ = linear_attention(*x, w, (0.0,), backend="triton")
    o.float().sum().backward()
    assert {name: [kw["SDROP"] for kw in r.kwargs] for name, r in launches.items()} == {
        "_la_out_kernel": [13], "_la_bwd_states_kernel": [13], "_la_bwd_grads_kernel": [13]}
    assert la_kernels.state_split(torch.empty(0, dtype=torch.bfloat16)) == 16


def test_autotune_keys_name_arguments():
    tuners = {n: k for mod in (la_kernels, moe_kernels, ce_kernels, kuramoto_kernels)
              for n, k in vars(mod).items() if isinstance(k, triton.runtime.Autotuner)}
    assert len(tuners) >= 8
    for name, k in tuners.items():
        assert k.keys and set(k.keys) <= set(k.arg_names), (name, k.keys)


class _Grids:
    """Stands in for a Triton kernel: records each launch's grid and launches nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_attention_grids_fit_cuda_past_65535_heads(monkeypatch):
    """B·H = 65,540 (the 1b model's 20 heads at B = 3,277): CUDA allows 2³¹ − 1 programs on grid
    axis 0 and 65,535 on axes 1 and 2, so B·H must not be on axis 1 or 2. The states kernel runs
again in the backward (it recomputes the chunk states)."""
    grids = {}
    for name in ("_la_states_kernel", "_la_out_kernel", "_la_bwd_states_kernel", "_la_bwd_grads_kernel"):
        grids[name] = _Grids()
        monkeypatch.setattr(la_kernels, name, grids[name])
    B, T, H, D = 3277, 33, 20, 4
    x = [torch.zeros(B, T, H, D, requires_grad=True) for _ in range(3)]
    w = torch.ones(2, requires_grad=True)
    o, _ = linear_attention(*x, w, (0.0, 0.5), backend="triton")
    o.sum().backward()
    fwd, bwd = B * H * triton.cdiv(T, 64), B * H * triton.cdiv(T, 32)
    assert {name: g.grids for name, g in grids.items()} == {
        "_la_states_kernel": [(B * 2 * H,)] * 2, "_la_out_kernel": [(fwd,)],
        "_la_bwd_states_kernel": [(B * 2 * H,)], "_la_bwd_grads_kernel": [(bwd,)]}
