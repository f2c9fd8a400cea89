"""The timed problems of the GPU suite (fractus.verify.cases): fla's baseline computes the model's
recurrence, and the default's is the default model's."""
import pytest
import torch

from fractus.layers import LinearAttention
from fractus.model import FractusConfig
from fractus.verify import cases
from fractus.verify.checks import rel_err


@pytest.mark.parametrize("recurrence", cases.RECURRENCES)
@pytest.mark.parametrize("impl", ["fla", "fla_numerator"])
def test_fla_baseline_computes_the_models_recurrence(recurrence, impl, monkeypatch):
    """The fla baseline (featured q and k, levels folded into heads, the decay as g_gamma, the state
    and the denominator as a [D, D + 2] state) equals the reference, output and every gradient, with
    fla's naive recurrent form in place of its chunked kernels (those do not run on CPU; the GPU
    suite compares their output too); its numerator alone equals the reference without the
    denominator. The naive form computes in fp32."""
    import fla.ops.simple_gla as simple_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, **kw):
        B, T, N, _ = q.shape
        g = torch.zeros(B, T, N) if g_gamma is None else g_gamma.expand(B, T, N)
        return naive_recurrent_simple_gla(q, k, v, g, scale, initial_state)
    monkeypatch.setattr(simple_gla, "chunk_simple_gla", chunk_simple_gla)
    cases.fla_attention.cache_clear()
    try:
        inputs = cases.timed_attention(recurrence, B=2, T=37, H=3, D=16, levels=2, dtype=torch.float32)
        leaves = [*inputs[:4], *inputs[5]]
        outs = {}
        for name in (impl, "reference"):
            o = cases.attention(name, *inputs, normalize=impl == "fla")
            outs[name] = (o, *torch.autograd.grad(o.square().sum(), leaves, materialize_grads=True))
        for got, want in zip(outs[impl], outs["reference"]):
            assert rel_err(got, want) < 1e-5
    finally:
        cases.fla_attention.cache_clear()


def test_the_default_recurrence_is_the_default_models():
    """The timed default: the decay the default model's attention holds [Lv, H]; the original: none."""
    H, Lv = cases.ATTENTION_GPU["H"], cases.ATTENTION_GPU["levels"]
    cfg = FractusConfig.preset("palier0", n_heads=H, d_model=H * cases.ATTENTION_GPU["D"], n_levels=Lv)
    q, k, v, w, decay, state = cases.timed_attention("default", 1, 4, H, cases.ATTENTION_GPU["D"], Lv, grad=False)
    assert torch.equal(decay, LinearAttention(cfg).decay.to(decay.dtype)) and state is not None
    assert cfg.attn_norm == "denominator" and FractusConfig.preset("original-palier0").attn_norm == "denominator"
    assert cases.timed_attention("original", 1, 4, H, 64, Lv, grad=False)[4] is None
