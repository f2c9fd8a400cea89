"""What the kernels are launched with, which the interpreter cannot check by running them: fp32
inputs ask for IEEE dots (the interpreter ignores ``input_precision`` and multiplies with numpy; a
GPU would round fp32 to TF32, about 1e-3 relative error), low-precision ones split the attention's
carried state in its dots, and every autotune key names an argument
(Triton skips a name it does not find, so a misspelt key would silently share one tuning)."""
import pytest
import torch
import triton

from fractus.kernels import cross_entropy, kuramoto, linear_attention, moe
from fractus.model import FractusConfig, FractusCTE
from util import Launches


@pytest.mark.parametrize("over", [{}, {"expert_rank": 0}], ids=["lowrank", "dense"])
def test_fp32_launches_ieee_dots(monkeypatch, over):
    launches = {}
    for mod in (linear_attention, moe, cross_entropy):
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
    assert splits == {"_la_out_kernel": {0}, "_la_bwd_grads_kernel": {0}}, splits  # fp32: IEEE, nothing split


def test_low_precision_splits_the_state_dots(monkeypatch):
    """fp16 inputs (state dots in tf32) and bf16: the dots with the carried state split it into
    hi + lo operands at the dot's precision (see linear_attention's note on the state dots)."""
    launches = {}
    for name in ("_la_out_kernel", "_la_bwd_grads_kernel"):
        launches[name] = Launches(getattr(linear_attention, name))
        monkeypatch.setattr(linear_attention, name, launches[name])
    x = [torch.randn(1, 20, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    w = torch.ones(1, requires_grad=True)
    o, _ = linear_attention.linear_attention(*x, w, (0.0,), backend="triton")
    o.float().sum().backward()
    assert {name: [kw["SDROP"] for kw in r.kwargs] for name, r in launches.items()} == {
        "_la_out_kernel": [13], "_la_bwd_grads_kernel": [13]}
    assert linear_attention._state_split(torch.empty(0, dtype=torch.bfloat16)) == 16


def test_autotune_keys_name_arguments():
    tuners = {n: k for mod in (linear_attention, moe, cross_entropy, kuramoto)
              for n, k in vars(mod).items() if isinstance(k, triton.runtime.Autotuner)}
    assert len(tuners) >= 8
    for name, k in tuners.items():
        assert k.keys and set(k.keys) <= set(k.arg_names), (name, k.keys)
