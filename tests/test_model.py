"""The model: decode equals the chunked forward, causality, presets, bad input, checkpoints, and the
whole model on the Triton path (interpreted) equal to the CPU path."""
import dataclasses
import json
import random
import re

import numpy as np
import pytest
import torch

import fractus.layers as layers
import fractus.model as model_mod
from fractus.checkpoint import CheckpointError, load_checkpoint, load_model_state, save_checkpoint
from fractus.model import FIELD_CHECKS, FractusConfig, FractusCTE, farey_phases, level_omegas
from util import assert_lowp, assert_rel


def random_configs(n=8):
    """Random small configs over every switch of the architecture (the original's and the levers)."""
    rng = random.Random(1)
    for _ in range(n):
        heads, levels = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
        cfg = FractusConfig(
            vocab_size=97, d_model=16 * heads, n_heads=heads, n_layers=rng.choice([1, 2]), n_levels=levels,
            attn_decay=rng.choice([1.0, "multiscale", tuple(rng.uniform(0.8, 1.0) for _ in range(heads)),
                                   tuple(rng.uniform(0.8, 1.0) for _ in range(heads * levels))]),
            attn_norm=rng.choice(["denominator", "rms"]), attn_gate=rng.choice([True, False]),
            short_conv=rng.choice([0, 2, 4]), qk_norm=rng.choice([True, False]), eot_reset=rng.choice([True, False]),
            shared_expert=rng.choice([0, 20]), n_experts=rng.choice([3, 4, 6]), top_k=rng.choice([1, 2]),
            expert_d_ff=24, expert_rank=rng.choice([0, 4]), n_oscillators=rng.choice([4, 8]), coupling_rank=2,
            router=rng.choice(["phase", "linear"]), detach_kuramoto=rng.choice([True, False]))
        window = rng.choice([0, 5])
        gated = rng.choice([True, False])
        delta = cfg.attn_norm == "rms" and cfg.attn_gate  # the delta rule reads its state through the RMSNorm
        yield dataclasses.replace(cfg, attn_window=window, decay_gate=gated, attn_update="delta" if delta else "add")


def config_id(c: FractusConfig) -> str:
    return (f"L{c.n_levels}H{c.n_heads}r{c.expert_rank}{c.router}-{c.attn_norm}-conv{c.short_conv}"
            f"{'-gate' if c.attn_gate else ''}{'-qkn' if c.qk_norm else ''}{'-eot' if c.eot_reset else ''}"
            f"{f'-win{c.attn_window}' if c.attn_window else ''}{'-dgate' if c.decay_gate else ''}"
            f"{'-delta' if c.attn_update == 'delta' else ''}")


@pytest.mark.parametrize("cfg", list(random_configs()), ids=config_id)
def test_decode_equals_chunked_forward(cfg):
    """T steps == two chunks with the carried state == one chunk (fp32, 1e-5), end-of-text tokens
    included (with eot_reset they start the state afresh, the convolution's buffer too). A decay
    gate's weights are drawn at random, so that each token's decay is its own."""
    model = FractusCTE(cfg).eval()
    for block in model.blocks:
        for proj in (block.attn.decay_proj, block.attn.beta_proj):
            if proj is not None:
                torch.nn.init.normal_(proj.weight, std=1.0)
    x = torch.randint(0, cfg.vocab_size, (2, 37))
    x[0, [3, 19, 20]] = x[1, 30] = cfg.vocab_size - 1
    with torch.no_grad():
        full, _, _ = model(x)
        a, _, st = model(x[:, :20])
        b, _, _ = model(x[:, 20:], st)
        state, ticks = None, []
        for t in range(x.shape[1]):
            logits, state = model.step(x[:, t], state)
            ticks.append(logits)
    assert_rel(torch.cat([a, b], 1), full, 1e-5, "two chunks with carried state vs one")
    assert_rel(torch.stack(ticks, 1), full, 1e-5, "step-by-step vs chunked forward")


@pytest.mark.parametrize("conv,window", [(0, 0), (4, 0), (4, 6)])
def test_eot_reset_starts_afresh(conv, window):
    """With eot_reset, the logits from an end-of-text token on are those of a fresh model state
    started at it, whatever came before (the convolution's buffer and the window's keys too);
    without it they depend on the past."""
    torch.manual_seed(0)
    for reset in (True, False):
        cfg = FractusConfig.preset("tiny", vocab_size=61, attn_decay="multiscale", short_conv=conv, eot_reset=reset,
                                   attn_window=window)
        model = FractusCTE(cfg).eval()
        x = torch.randint(0, 60, (2, 40))
        x[:, 25] = 60
        with torch.no_grad():
            before = model(torch.randint(0, 60, (2, 9)))[2]
            full, _, _ = model(x, before)
            fresh, _, _ = model(x[:, 25:])
            state, ticks = before, []
            for t in range(x.shape[1]):  # decoding through the reset
                logits, state = model.step(x[:, t], state)
                ticks.append(logits)
        assert_rel(torch.stack(ticks, 1), full, 1e-5, "step by step vs the chunked forward")
        if reset:
            assert_rel(full[:, 25:], fresh, 1e-5, "after the reset")
        else:
            assert not torch.allclose(full[:, 25:], fresh, atol=1e-4)


@pytest.mark.parametrize("conv", [0, 4])
def test_causality(conv):
    """A token changed at position t leaves every earlier position's logits and routing as they were
    (up to rounding: the experts' matmuls run over the tokens routed to each, a set that later
    positions change) and changes the later ones."""
    cfg = FractusConfig.preset("tiny", vocab_size=101, short_conv=conv)
    model = FractusCTE(cfg).eval()
    x = torch.randint(0, 101, (2, 30))
    t = 17
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % 101
    with torch.no_grad():
        lx, px, _ = model(x)
        ly, py, _ = model(y)
    assert_rel(ly[:, :t], lx[:, :t], 1e-6, "logits before t")
    assert not torch.allclose(lx[:, t:], ly[:, t:])
    for (ix, prx), (iy, pry) in zip(px["routing"], py["routing"]):
        assert torch.equal(ix[:, :t], iy[:, :t])
        assert_rel(pry[:, :t], prx[:, :t], 1e-6, "routing probabilities before t")


def test_tick_vec_matches_step_on_embedding():
    model = FractusCTE(FractusConfig.preset("tiny")).eval()
    tok = torch.tensor([5, 9])
    a, sa = model.step(tok, None)
    b, sb = model.tick_vec(model.embed(tok), None)
    assert torch.equal(a, b)
    assert all(torch.equal(s1, s2) for p, q in zip(sa, sb) for s1, s2 in zip(p, q))


def test_a_config_without_levers_is_the_original():
    """A config dict written before the levers existed (a checkpoint's) is read as the original
    architecture, not as the default; the default's own dict round-trips."""
    old = {k: v for k, v in FractusConfig.preset("original-tiny").to_dict().items() if k not in model_mod.ORIGINAL}
    assert FractusConfig.from_saved(old) == FractusConfig.preset("original-tiny")
    new = FractusConfig.preset("tiny")
    assert FractusConfig.from_saved(new.to_dict()) == new and new != FractusConfig.preset("original-tiny")


def test_a_saved_config_that_names_the_chunk_length_loads(tmp_path):
    """The chunk length is a training setting (the trainer's --chunk-len), not a field: a saved
    config that names it reads as the same model, and a checkpoint holding one loads; a preset
    refuses it as an override like any other key that is no field."""
    c = FractusConfig.preset("tiny")
    assert FractusConfig.from_saved({**c.to_dict(), "chunk_len": 256}) == c
    old = {k: v for k, v in FractusConfig.preset("original-tiny").to_dict().items() if k not in model_mod.ORIGINAL}
    assert FractusConfig.from_saved({**old, "chunk_len": 32}) == FractusConfig.preset("original-tiny")
    model = FractusCTE(c)
    save_checkpoint(tmp_path / "m.pt", {"config": {**c.to_dict(), "chunk_len": 64}, "model": model.state_dict()})
    loaded = FractusCTE.load(tmp_path / "m.pt")
    assert loaded.cfg == c and all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ValueError, match=r"unknown config keys \['chunk_len'\]"):
        FractusConfig.preset("tiny", chunk_len=64)
    with pytest.raises(ValueError, match=r"bad config: n_layers must be"):
        FractusConfig.from_saved({**c.to_dict(), "chunk_len": 64, "n_layers": 0})
    with pytest.raises(ValueError, match=r"unknown config keys \['n_layer'\]"):
        FractusConfig.from_saved({**c.to_dict(), "chunk_len": 64, "n_layer": 4})


def test_1b_parameter_count():
    """The original architecture at 1b's dimensions, exactly (0.031 % above the original model's
    1,048,631,458 parameters; 183.46M active with the tied embedding, 119.14M without), and the
    default's, so that a change of either architecture shows here."""
    counts = {}
    for name in ("original-1b", "1b"):
        with torch.device("meta"):
            model = FractusCTE(FractusConfig.preset(name))
        counts[name] = (model.num_params(), model.num_params(active=True), model.num_params(active=True, embedding=False))
    assert counts["original-1b"] == (1_048_961_456, 183_464_432, 119_135_472), counts
    assert counts["1b"] == (1_076_261_952, 210_764_928, 146_435_968), counts


def test_presets_and_constants():
    for name in ("palier0", "palier1", "palier2", "palier3", "1b"):
        c, o = FractusConfig.preset(name), FractusConfig.preset(f"original-{name}")
        assert c.d_head == 64 and c.n_levels == 2 and c.top_k == 2
        assert {k: getattr(o, k) for k in model_mod.ORIGINAL} == model_mod.ORIGINAL
        assert {k: getattr(c, k) for k in model_mod.RECIPE if k != "attn_decay"} == {
            k: v for k, v in model_mod.RECIPE.items() if k != "attn_decay"}
        assert c.decays == model_mod.multiscale_decays(c.n_heads, c.n_levels) and o.decays == (1.0,) * c.n_heads
        assert {k: v for k, v in dataclasses.asdict(c).items() if k not in model_mod.ORIGINAL} == {
            k: v for k, v in dataclasses.asdict(o).items() if k not in model_mod.ORIGINAL}  # the same dimensions
    assert model_mod.multiscale_decays(2, 2) == (1 - 2 ** -4, 1 - 2 ** -8, 1 - 2 ** -6, 1 - 2 ** -10)
    assert model_mod.multiscale_decays(4, 2)[:2] == model_mod.multiscale_decays(2, 2)[:2]  # heads added keep theirs
    assert level_omegas(2)[0] == 1.0 and abs(level_omegas(2)[1] - 0.381966) < 1e-6
    ph = farey_phases(16)
    assert ph.shape == (16,) and ph.unique().numel() == 16 and ph.min() >= 0 and ph.max() < 6.2832


def test_tied_embedding_starts_small():
    """The tied embedding starts N(0, 0.02²), not nn.Embedding's N(0, 1) (a defect of the
    original: with a tied head each token's own logit then dominates the next-token prediction)."""
    torch.manual_seed(0)
    model = FractusCTE(FractusConfig.preset("palier0"))
    w = model.embed.weight.detach()
    assert abs(float(w.mean())) < 1e-3 and abs(float(w.std()) - 0.02) < 2e-4
    assert model.cfg.tie_head and model.head is None  # tied: the head reads the embedding


def test_training_loss_decreases():
    torch.manual_seed(0)
    model = FractusCTE(FractusConfig.preset("tiny", vocab_size=64))
    x = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        _, parts, _ = model(x[:, :-1], targets=x[:, 1:])
        opt.zero_grad()
        parts["loss"].backward()
        opt.step()
        losses.append(parts["ce"].item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("fused_ce,backend", [(True, "torch"), (False, "torch"), (True, "triton")])
def test_head_positions_last_supervises_last_position_only(fused_ce, backend):
    model = FractusCTE(FractusConfig.preset("tiny", fused_ce=fused_ce, backend=backend))
    x = torch.randint(0, 512, (3, 8))
    y = torch.randint(0, 512, (3, 8))
    _, parts, _ = model(x, targets=y, head_positions="last")
    logits, _, _ = model(x)
    ref = torch.nn.functional.cross_entropy(logits[:, -1], y[:, -1])
    assert parts["n"] == 3
    assert_rel(parts["ce"], ref, 1e-5, "head-partial CE")


@pytest.mark.parametrize("bad", [-1, 512, 10_000])
def test_token_ids_out_of_range(bad):
    model = FractusCTE(FractusConfig.preset("tiny"))
    x = torch.zeros(1, 4, dtype=torch.long)
    x[0, 2] = bad
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(x)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate([], 3)


def test_config_validation():
    with pytest.raises(ValueError):
        FractusConfig.preset("nope")
    with pytest.raises(ValueError):
        FractusConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError):
        FractusConfig(attn_decay=1.5)
    with pytest.raises(ValueError, match=r"attn_decay has 3 values: give one per head \(4\) or one per \(level, head\) \(8"):
        FractusConfig(n_heads=4, attn_decay=(0.9, 0.9, 0.9))
    with pytest.raises(ValueError):
        FractusConfig(top_k=5, n_experts=4)
    with pytest.raises(ValueError, match=r"unknown config keys \['n_layer'\]"):
        FractusConfig.preset("tiny", n_layer=4)


BAD_FIELDS = [("n_layers", 0), ("n_layers", 2.5), ("n_layers", "abc"), ("n_layers", True), ("vocab_size", 0),
              ("n_heads", 0), ("top_k", 0), ("expert_rank", -1), ("kuramoto_steps", 0),
              ("tie_head", "maybe"), ("fused_ce", 1), ("detach_kuramoto", "true"), ("kuramoto_dt", 0),
              ("kuramoto_dt", float("nan")), ("gate_tau", -1.0), ("gate_kappa", 0.0), ("lb_coef", -0.1),
              ("lb_coef", "x"), ("eps", float("inf")), ("kuramoto_damping", -1), ("backend", "cuda"),
              ("router", None), ("attn_decay", "0.9"), ("attn_decay", [0.9, True]), ("attn_decay", 0),
              ("attn_window", -1), ("attn_window", 2.0), ("decay_gate", 1)]


@pytest.mark.parametrize("name,value", BAD_FIELDS, ids=lambda v: repr(v))
def test_config_refuses_bad_field(name, value):
    """Each field is checked for type and range (what `--set KEY=VALUE` can pass) with its own message."""
    with pytest.raises(ValueError, match=rf"bad config: {name} must be .*, got {re.escape(repr(value))}$"):
        FractusConfig.preset("tiny", **{name: value})


def test_config_names_every_bad_field_and_checks_every_field():
    assert set(FIELD_CHECKS) == {f.name for f in dataclasses.fields(FractusConfig)}
    with pytest.raises(ValueError, match=r"n_layers must be .*, got 0; tie_head must be true or false"):
        FractusConfig(n_layers=0, tie_head="maybe")


def test_config_roundtrip_and_number_types():
    """Saved configs (JSON-like dicts, attn_decay as a list) load back equal; ints are accepted for
    float fields, numpy ints for int fields, and both are stored as the field's type."""
    c = FractusConfig.preset("tiny", attn_decay=[0.9, 1], kuramoto_dt=1, lb_coef=0, n_layers=np.int64(3),
                             expert_rank=0)
    assert c.attn_decay == (0.9, 1.0) and c.kuramoto_dt == 1.0 and c.lb_coef == 0.0
    assert type(c.kuramoto_dt) is float and type(c.n_layers) is int
    d = json.loads(json.dumps(c.to_dict()))
    assert FractusConfig.from_saved(d) == c and d["attn_decay"] == [0.9, 1.0]
    for name in ("tiny", "palier0", "1b"):
        p = FractusConfig.preset(name)
        assert FractusConfig.from_saved(json.loads(json.dumps(p.to_dict()))) == p


def test_forward_and_generate_refuse_bad_shapes():
    model = FractusCTE(FractusConfig.preset("tiny"))
    for idx in (torch.tensor([1, 2, 3]), torch.ones(1, 3), [[1, 2, 3]]):
        with pytest.raises(ValueError, match=r"idx must be a \[B, T\] int64"):
            model(idx)
    for prompt in (torch.ones(1, 1, 3, dtype=torch.long), torch.tensor([1.0, 2.5]), [1.5, 2.0]):
        with pytest.raises(ValueError, match="generate takes integer token ids"):
            model.generate(prompt, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer ≥ 0"):
        model.generate([1, 2, 3], -1)
    for t in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be finite and ≥ 0"):
            model.generate([1, 2, 3], 2, temperature=t)
    for pen in (0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="a finite repetition_penalty > 0"):
            model.generate([1, 2, 3], 2, repetition_penalty=pen)
    for vec in (torch.zeros(2, 5, 32), torch.zeros(32), torch.zeros(2, 16), torch.zeros(2, 32, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"tick_vec expects a floating \[B, 32\] tensor"):
            model.tick_vec(vec, None)
    assert model.tick_vec(torch.zeros(2, 32, dtype=torch.float64), None)[0].shape == (2, 512)
    state = model(torch.ones(1, 3, dtype=torch.long))[2]
    with pytest.raises(ValueError, match="state holds 1 blocks' state, the model has 2 blocks"):
        model(torch.ones(1, 3, dtype=torch.long), state[:1])
    x = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\) != idx shape \(2, 3\)"):
        model(x, targets=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="head_positions must be 'all' or 'last', got 'first'"):
        model(x, targets=x, head_positions="first")
    assert model.generate(torch.tensor([1, 2, 3]), 2, temperature=0) == model.generate([1, 2, 3], 2, temperature=0)


@pytest.mark.parametrize("router", ["phase", "linear"])
def test_every_parameter_gets_a_gradient(router):
    """No parameter is computed for nothing (DDP without find_unused_parameters needs it): the
    linear router has no Kuramoto clock."""
    model = FractusCTE(FractusConfig.preset("tiny", router=router))
    x = torch.randint(0, model.cfg.vocab_size, (2, 9))
    model(x[:, :-1], targets=x[:, 1:])[1]["loss"].backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    assert all(b.clock is None for b in model.blocks) == (router == "linear")


def test_generate_is_seeded_and_decodes_tick_by_tick():
    model = FractusCTE(FractusConfig.preset("tiny"))
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.3)
    a = model.generate([1, 2, 3], seed=7, **kw)
    assert a == model.generate([1, 2, 3], seed=7, **kw) and len(a) == 12
    rng = torch.get_rng_state()
    model.generate([1, 2, 3], 2)
    assert torch.equal(torch.get_rng_state(), rng), "seed=None leaves the global generator alone"
    greedy = model.generate([1, 2, 3], 6, temperature=0)
    with torch.no_grad():
        ids = [1, 2, 3]
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    assert greedy == ids[3:]


def test_a_compiled_step_generates_as_the_eager_one():
    """``generate(compile=True)``: each tick through torch.compile, the same tokens (a batch of two
    prompts, sampled and seeded) and logits equal to rounding."""
    torch.manual_seed(0)
    model = FractusCTE(FractusConfig.preset("tiny")).eval()
    kw = dict(max_new_tokens=8, temperature=0.9, top_k=50, seed=3)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert model.generate(prompts, compile=True, **kw) == model.generate(prompts, **kw)
    with torch.no_grad():
        state = model(torch.tensor(prompts))[2]
        tok = torch.tensor([9, 10])
        eager, _ = model.step(tok, state)
        compiled, _ = model.compiled_step()(tok, state)
    assert_rel(compiled, eager, 1e-5, "compiled step vs eager")
    with pytest.raises(ValueError, match="token ids"):  # checked outside the graph, as step checks them
        model.compiled_step()(torch.tensor([[1]]), state)


def test_checkpoint_roundtrip_and_errors(tmp_path):
    model = FractusCTE(FractusConfig.preset("tiny"))
    p = tmp_path / "m.pt"
    model.save(p)
    back = FractusCTE.load(p)
    x = torch.randint(0, 512, (1, 9))
    assert torch.equal(model(x)[0], back(x)[0])
    other = FractusCTE(FractusConfig.preset("tiny", n_experts=5))
    with pytest.raises(CheckpointError, match="does not match"):
        load_model_state(other, load_checkpoint(p)["model"], p)
    state = dict(model.state_dict())
    state["extra.weight"] = state.pop("embed.weight")
    with pytest.raises(CheckpointError, match=r"missing 1 tensors, e.g. \['embed.weight'\]; "
                                              r"unexpected 1 tensors, e.g. \['extra.weight'\]"):
        load_model_state(back, state, p)
    data = p.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        FractusCTE.load(tmp_path / "trunc.pt")
    compiled = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    load_model_state(back, compiled)


def test_malicious_checkpoint_is_refused(tmp_path):
    import os
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    p = tmp_path / "evil.pt"
    with open(p, "wb") as f:
        pickle.dump({"config": {}, "model": Evil()}, f)
    with pytest.raises(CheckpointError, match="refusing"):
        FractusCTE.load(p)
    assert not marker.exists()


def _two_chunks(backend, over, bf16=False):
    """The tiny model's cross-entropy and load balance over two chunks of 19 tokens (T not a multiple
    of any block) with the state carried, every parameter gradient, the routing, then three decode
    ticks' logits; under bf16 autocast if asked."""
    x = torch.randint(0, 512, (2, 2 * 19 + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = FractusCTE(FractusConfig.preset("tiny", backend=backend, **over))
    losses, routing, state = [], [], None
    for c in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, parts, state = model(x[:, 19 * c:19 * (c + 1)], state, x[:, 19 * c + 1:19 * (c + 1) + 1])
        parts["loss"].backward()
        losses.append(torch.stack([parts["ce"], parts["lb"]]).detach())
        routing += parts["routing"]
        state = FractusCTE.detach_state(state)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ticks = [model.step(x[:, t], state)[0].float() for t in range(3)]
    return (torch.stack(losses), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            torch.stack(ticks), routing)


MODEL_VARIANTS = dict(argvalues=[{}, {"expert_rank": 0, "attn_decay": (0.9, 0.97), "router": "linear"},
                                 model_mod.ORIGINAL, {"attn_update": "delta", "attn_norm": "rms", "decay_gate": True}],
                      ids=["default", "dense-decay-linear", "original", "delta-rule"])


@pytest.mark.parametrize("over", **MODEL_VARIANTS)
def test_triton_path_equals_torch_path(over):
    """The whole model on the GPU's path (every Triton kernel, interpreted) vs the CPU path: the
    cross-entropy, the load balance, the routing and every parameter gradient of two chunks with
    the state carried, then tick-by-tick decode."""
    (l0, g0, t0, r0), (l1, g1, t1, r1) = (_two_chunks(b, over) for b in ("torch", "triton"))
    assert_rel(l1[:, 0], l0[:, 0], 1e-5, "cross-entropy")
    assert_rel(l1[:, 1], l0[:, 1], 1e-5, "load balance")  # a term too small to show in the loss
    for (i1, p1), (i0, p0) in zip(r1, r0):  # the kernels leave the routing as it was
        assert torch.equal(i1, i0)
        assert_rel(p1, p0, 1e-5, "routing probabilities")
    assert g1.keys() == g0.keys() and len(g0) > 20
    scale = max(g.norm() for g in g0.values())
    for n in g0:
        if g0[n].norm() > 1e-3 * scale:  # near-cancelling gradients are left to the global check
            assert_rel(g1[n], g0[n], 1e-4, n)
    assert_rel(torch.cat([g.flatten() for g in g1.values()]), torch.cat([g.flatten() for g in g0.values()]),
               1e-5, "all gradients")
    assert_rel(t1, t0, 1e-4, "decode logits")


@pytest.mark.parametrize("over", **MODEL_VARIANTS)
def test_triton_path_under_bf16_autocast(over, monkeypatch):
    """Training's setting on the GPU's path: the whole model under bf16 autocast, every Triton
    kernel interpreted with bf16 rounded as a GPU does (the attention, the experts and the head
    given bf16 activations), judged by the low-precision rule: against the fp32 CPU path, no worse
    than the PyTorch path under the same autocast plus a small tolerance. A token's expert may flip
    under bf16 (on either path), so the errors are bf16's, not the kernels' (the PyTorch path errs
    by about 2e-5 in the cross-entropy, 1e-2 to 7e-2 in the gradients, 5e-3 in the decode logits)."""
    (l0, g0, t0, _) = _two_chunks("torch", over)
    (lb, gb, tb, _) = _two_chunks("torch", over, bf16=True)
    given = {}
    attention = "delta_rule" if over.get("attn_update") == "delta" else "linear_attention"
    for mod, op in ((layers, attention), (layers, "moe"), (model_mod, "linear_cross_entropy")):
        def record(x, *args, _op=op, _fn=getattr(mod, op), **kw):
            given.setdefault(_op, set()).add(x.dtype)
            return _fn(x, *args, **kw)
        monkeypatch.setattr(mod, op, record)
    (l1, g1, t1, _) = _two_chunks("triton", over, bf16=True)
    assert given == dict.fromkeys((attention, "moe", "linear_cross_entropy"), {torch.bfloat16})
    assert g1.keys() == g0.keys() == gb.keys()

    def flat(g):
        return torch.cat([x.flatten() for x in g.values()])
    for what, got, same, truth, tol in (("cross-entropy", l1[:, 0], lb[:, 0], l0[:, 0], 1e-4),
                                        ("load balance", l1[:, 1], lb[:, 1], l0[:, 1], 1e-2),
                                        ("all gradients", flat(g1), flat(gb), flat(g0), 2e-2),
                                        ("decode logits", t1, tb, t0, 5e-3)):
        assert_lowp(got, same, truth, tol, what)
