"""Growth keeps the function: the grown model's logits, cross-entropy and routing equal the old."""
import pytest
import torch

from fractus.grow import grow
from fractus.model import ORIGINAL, FractusConfig, FractusCTE
from util import assert_rel

CHAIN = ("palier0", "palier1", "palier2", "palier3", "1b")


def scaled(name: str, **over) -> FractusConfig:
    """The preset at 1/8 of its widths (d_head 8), a quarter of its depth, vocab 97."""
    c = FractusConfig.preset(name)
    return FractusConfig.preset(name, vocab_size=97, d_model=c.d_model // 8, expert_d_ff=c.expert_d_ff // 8,
                                expert_rank=c.expert_rank // 8, n_layers=max(1, c.n_layers // 4), **over)


def trained_like(cfg: FractusConfig) -> FractusCTE:
    """A model whose parameters are moved away from their initialisation (LayerNorm γ ≠ 1,
    biases ≠ 0, gate biases ≠ 0, …) so that growth is tested on a generic point."""
    model = FractusCTE(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p) * (p.std() if p.numel() > 1 else 1.0))
    return model.eval()


def check_same_function(old: FractusCTE, new: FractusCTE, T: int = 24):
    V = old.cfg.vocab_size
    x, y = torch.randint(0, V, (2, T)), torch.randint(0, V, (2, T))
    new.eval()
    with torch.no_grad():
        l0, r0, _ = old(x)
        l1, r1, _ = new(x)
        _, p0, _ = old(x, None, y)
        _, p1, _ = new(x, None, y)
    assert_rel(l1, l0, 1e-5, "logits")
    ce0, ce1 = p0["ce"].item(), p1["ce"].item()
    assert abs(ce1 - ce0) / ce0 < 1e-4, (ce0, ce1)
    L, L2 = old.cfg.n_layers, new.cfg.n_layers
    for i, j in enumerate(i * L2 // L for i in range(L)):  # old block i sits at position j
        assert torch.equal(r1["routing"][j][0], r0["routing"][i][0]), f"routing of block {i}"
    return ce0


@pytest.mark.parametrize("src,dst", list(zip(CHAIN, CHAIN[1:])) + [
    (f"original-{a}", f"original-{b}") for a, b in zip(CHAIN, CHAIN[1:])])
def test_growth_preserves_function_scaled_presets(src, dst):
    old = trained_like(scaled(src))
    new = grow(old, scaled(dst))
    check_same_function(old, new)
    E, L, L2 = old.cfg.n_experts, old.cfg.n_layers, new.cfg.n_layers
    for j in (i * L2 // L for i in range(L)):
        moe = new.blocks[j].moe
        assert moe.V1[E:].abs().min() > 0 and moe.U2[E:].abs().max() > 0, "new experts are not zeros"
    first = new.blocks[0].moe
    assert torch.equal(first.phases[:E], old.blocks[0].moe.phases), "old experts keep their phases"
    assert len(set(first.phases.tolist())) == new.cfg.n_experts, "new experts get their own phases"


def test_growth_real_palier0_to_palier1():
    old = trained_like(FractusConfig.preset("palier0"))
    new = grow(old, FractusConfig.preset("palier1"))
    check_same_function(old, new, T=32)
    assert new.num_params() > 3 * old.num_params()


# (name, the source's overrides of tiny, the target's beyond the grown dimensions)
VARIANTS = [("linear-router", dict(router="linear"), {}), ("dense-experts", dict(expert_rank=0), {}),
            ("untied-head", dict(tie_head=False), {}),
            ("per-head-decay", dict(attn_decay=(0.9, 0.95)), dict(attn_decay=(0.9, 0.95, 1.0, 0.8))),
            ("per-level-decay", dict(attn_decay=(0.9, 0.95, 0.8, 0.85)),
             dict(attn_decay=(0.9, 0.95, 0.7, 0.6, 0.8, 0.85, 0.99, 1.0))),
            ("shared-expert", dict(shared_expert=20), dict(shared_expert=40)),
            ("shared-expert-added", {}, dict(shared_expert=24)),
            ("eot-reset-conv2", dict(eot_reset=True, short_conv=2), {}),
            ("rms-no-gate-qk-norm", dict(attn_norm="rms", attn_gate=False, qk_norm=True), {}),
            ("window", dict(attn_window=6), {}),
            ("decay-gate", dict(decay_gate=True, attn_decay=(0.9, 0.95, 0.8, 0.85)),
             dict(attn_decay=(0.9, 0.95, 0.7, 0.6, 0.8, 0.85, 0.99, 0.5))),
            ("delta-rule", dict(attn_update="delta", attn_norm="rms"), {}),
            ("delta-rule-triton", dict(attn_update="delta", attn_norm="rms", decay_gate=True, backend="triton"), {}),
            ("original", dict(ORIGINAL), dict(ORIGINAL))]


@pytest.mark.parametrize("src_over,dst_over", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_growth_variants(src_over, dst_over):
    src = FractusConfig.preset("tiny", vocab_size=97, **src_over)
    dst = FractusConfig.preset("tiny", **{**src_over, **dict(
        vocab_size=97, d_model=64, n_heads=4, n_layers=3, n_experts=6, expert_d_ff=48, n_oscillators=8,
        coupling_rank=3, expert_rank=0 if src_over.get("expert_rank") == 0 else 12), **dst_over})
    old = trained_like(src)
    check_same_function(old, grow(old, dst))


def test_growth_to_same_config_is_a_copy():
    old = trained_like(FractusConfig.preset("tiny", vocab_size=97))
    new = grow(old, old.cfg)
    for (k, a), b in zip(old.state_dict().items(), new.state_dict().values()):
        assert_rel(b, a, 1e-7, k)


def test_grown_model_learns_new_parts():
    """New experts, heads and blocks receive gradients from the first step."""
    old = trained_like(FractusConfig.preset("tiny", vocab_size=97))
    big = FractusConfig.preset("tiny", vocab_size=97, d_model=64, n_heads=4, n_layers=3, n_experts=8)
    new = grow(old, big)
    x = torch.randint(0, 97, (2, 24))
    _, parts, _ = new.train()(x[:, :-1], None, x[:, 1:])
    parts["loss"].backward()
    moe = new.blocks[0].moe
    assert (moe.gate_bias.grad[4:] < 0).all(), "load balance pulls the new experts in"
    assert new.blocks[0].attn.out.weight.grad[:, 32:].abs().sum() > 0, "new heads' out columns learn"
    assert new.blocks[2].attn.out.weight.grad.abs().sum() > 0, "the new block's out projection learns"
    assert new.blocks[2].moe.U2.grad.abs().sum() > 0, "the new block's experts learn"
    assert new.embed.weight.grad[:, 32:].abs().sum() > 0, "new residual coordinates learn"


@pytest.mark.parametrize("over,msg", [
    (dict(d_model=16, n_heads=1), "would shrink"),
    (dict(vocab_size=101), "vocab_size"),
    (dict(d_model=64), "d_head"),
    (dict(n_oscillators=6), "whole factor"),
    (dict(expert_rank=0), "dense"),
    (dict(top_k=1), "top_k"),
    (dict(short_conv=2), "short_conv"),
    (dict(attn_norm="rms"), "attn_norm"),
    (dict(attn_decay=(0.5, 0.5, 0.5, 0.5)), "attn_decay of the old heads"),
])
def test_growth_refusals(over, msg):
    src = FractusConfig.preset("tiny", vocab_size=97)
    with pytest.raises(ValueError, match=msg):
        grow(FractusCTE(src), FractusConfig.preset("tiny", **{"vocab_size": 97, **over}))


def test_grow_from_checkpoint_file(tmp_path):
    old = trained_like(FractusConfig.preset("tiny", vocab_size=97))
    old.save(tmp_path / "a.pt")
    new = grow(tmp_path / "a.pt", FractusConfig.preset("tiny", vocab_size=97, d_model=64, n_heads=4))
    check_same_function(old, new)


def test_stacked_growth_repeats_the_trained_blocks():
    """depth="stack" (G_stack): block j of the target is old block j mod L — in depth alone, every
    weight equal; with no new depth it is the interleaved growth itself (the same logits)."""
    c = scaled("palier1")
    old = trained_like(FractusConfig.from_saved({**c.to_dict(), "n_layers": 2}))
    deeper = FractusConfig.from_saved({**old.cfg.to_dict(), "n_layers": 5})
    stack = grow(old, deeper, depth="stack")
    for j, block in enumerate(stack.blocks):
        twin = old.blocks[j % 2].state_dict()
        assert all(torch.equal(w, twin[name]) for name, w in block.state_dict().items()), f"block {j}"
    for n in ("embed.weight", "ln_f.weight", "ln_f.bias"):
        assert torch.equal(stack.state_dict()[n], old.state_dict()[n])
    wider = FractusConfig.from_saved({**scaled("palier2").to_dict(), "n_layers": 2})
    torch.manual_seed(0)
    a = grow(old, wider, depth="stack")
    torch.manual_seed(0)
    b = grow(old, wider)
    assert all(torch.equal(w, b.state_dict()[n]) for n, w in a.state_dict().items())
    check_same_function(old, a)
    with pytest.raises(ValueError, match="depth 'copy'"):
        grow(old, wider, depth="copy")
