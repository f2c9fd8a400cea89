"""fp32 inputs launch every kernel's dots with IEEE precision. Triton's interpreter ignores
``input_precision`` (it multiplies with numpy), so only the launches can show that a GPU would not
round fp32 inputs to TF32 (about 1e-3 relative error)."""
import pytest
import torch

from fractus.kernels import cross_entropy, linear_attention, moe
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
