"""linear_attention: every path vs the token-by-token reference (fp64 truth), output, final state
and every gradient; split-and-resume; decode steps; fp16 and bf16 by the low-precision rule, also
with a state beyond fp16's range; a decay that requires grad refused off the reference path; a
decay of each position's own (the model's decay gate) on the PyTorch path."""
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fractus.ops.linear_attention import kernels as la_kernels
from fractus.ops.linear_attention import linear_attention, linear_attention_reference
from fractus.ops.linear_attention.kernels import _round_mantissa
from fractus.model import level_omegas
from util import LOWP, Launches, assert_lowp, assert_rel, lowp_tol

OMEGAS = level_omegas(2)
FP32_TOL = 1e-5  # fp32 paths vs the fp64 truth (measured errors are below 1e-6)


pytestmark = pytest.mark.usefixtures("one_thread")


def make(B, T, H, D, decay, state, dtype=torch.float32, levels=2, history=0, v_mean=0.0):
    """Leaf inputs drawn in dtype and held in fp64 (the truth then sees exactly the rounded
    values the tested path sees): q, k, v, level_weights, decay ([H]; "level": [Lv, H]), state. With ``history``, the
    state is the one that many earlier tokens leave without decay (fp32 values), v of those and of
    the call drawn around ``v_mean``."""
    def r(x):
        return x.to(dtype).double()
    q, k, v = r(torch.randn(B, T, H, D)), r(torch.randn(B, T, H, D)), r(v_mean + torch.randn(B, T, H, D))
    w = r(torch.softmax(torch.randn(levels), 0))
    g = r(torch.rand(levels, H) * 0.3 + 0.65) if decay == "level" else r(torch.rand(H) * 0.3 + 0.65) if decay else None
    st = None
    if history:
        kh, vh = r(torch.randn(B, history, H, D)), r(v_mean + torch.randn(B, history, H, D))
        fk = torch.stack([F.elu(kh + om) + 1 for om in level_omegas(levels)], 1)  # [B, Lv, N, H, D]
        st = tuple(x.float().double() for x in (torch.einsum("blnhd,bnhe->blhde", fk, vh), fk.sum(2)))
    elif state:
        st = (r(torch.randn(B, levels, H, D, D) * 0.5), r(torch.rand(B, levels, H, D) * 2 + 1))
    return q, k, v, w, g, st


def run(inputs, dtype, grad=True, state_loss=True, bf16_autocast=False, loss_mean=0.0, **kw):
    """Call linear_attention on copies cast to dtype (the forward under bf16 autocast if asked, the
    backward outside it, as training does); returns (o, S, z) + grads of (q, k, v, w, S0, z0) for a
    fixed random loss on every output (on o only without state_loss), its weights around loss_mean."""
    q, k, v, w, g, st = inputs
    sdt = torch.float64 if dtype == torch.float64 else torch.float32  # state and level weights
    leaves = [x.detach().to(dtype).requires_grad_(grad) for x in (q, k, v)]
    leaves.append(w.detach().to(sdt).requires_grad_(grad))
    if st is not None:
        leaves += [x.detach().to(sdt).requires_grad_(grad) for x in st]
    state = tuple(leaves[4:]) if st is not None else None
    g = None if g is None else g.to(sdt)
    omegas = level_omegas(w.numel())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        o, (S, z) = linear_attention(*leaves[:4], omegas, decay=g, state=state, **kw)
    outs = [o, S, z]
    if grad:
        gen = torch.Generator().manual_seed(1)
        loss = sum((x.double() * (loss_mean + torch.randn(x.shape, generator=gen, dtype=torch.float64))).sum()
                   for x in (outs if state_loss else outs[:1]))
        outs += list(torch.autograd.grad(loss, leaves))
    return outs


NAMES = ["o", "S", "z", "dq", "dk", "dv", "dw", "dS0", "dz0"]


def compare(got, truth, tol, T, state):
    for name, x, ref in zip(NAMES, got, truth):
        if name == "dq" and T == 1 and not state:
            # o = v·(f(q)·f(k))/(f(q)·f(k) + eps): dq is of order eps, pure rounding noise.
            assert x.abs().max() < 1e-4, "dq (T=1, no state)"
            continue
        assert_rel(x.double(), ref.double(), tol, name)


SWEEP = ([(T, 48, dec, st) for T in (1, 17, 64, 100, 257) for dec in (False, True) for st in (False, True)]
         + [(T, D, True, True) for T in (1, 17, 64, 100, 257) for D in (32, 64)])


@pytest.mark.parametrize("T,D,decay,state", SWEEP)
def test_torch_path_vs_reference(T, D, decay, state):
    inputs = make(2, T, 2, D, decay, state)
    truth = run(inputs, torch.float64, backend="reference")
    got = run(inputs, torch.float32, backend="torch")
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    compare(got, truth, FP32_TOL, T, state)
    for x, ref in zip(got[:3], truth[:3]):  # the model's decode == chunked check runs at 1e-5
        assert_rel(x.double(), ref, 1e-5, "forward")


def test_reference_fp32_returns():
    q, k, v, w, g, st = (x if x is None or isinstance(x, tuple) else x.float()
                         for x in make(2, 5, 2, 16, True, False))
    o, (S, z) = linear_attention_reference(q.half(), k, v, w, OMEGAS, g)
    assert o.dtype == torch.float16 and S.dtype == torch.float32
    assert S.shape == (2, 2, 2, 16, 16) and z.shape == (2, 2, 2, 16)


# every T with and without a state, and with and without a decay; every D
TRITON_CASES = [(1, 32, False, False), (1, 48, True, True), (17, 48, True, True), (64, 32, True, False),
                (64, 64, False, True), (100, 64, True, False), (100, 48, False, True),
                (257, 48, False, False), (257, 64, True, True), (17, 32, False, False)]


@pytest.mark.parametrize("T,D,decay,state", TRITON_CASES)
def test_triton_vs_reference(T, D, decay, state):
    inputs = make(2, T, 2, D, decay, state)
    truth = run(inputs, torch.float64, backend="reference")
    got = run(inputs, torch.float32, backend="triton")
    compare(got, truth, FP32_TOL, T, state)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_eps_zero(path):
    """eps = 0 is valid (the features are positive): no 0/0 from the padding rows of a chunk."""
    inputs = make(2, 20, 2, 32, True, True)
    truth = run(inputs, torch.float64, backend="reference", eps=0.0)
    got = run(inputs, torch.float32, backend=path, eps=0.0)
    compare(got, truth, FP32_TOL, 20, True)


# without the denominator (normalize=False): every path, one decay per (level, head) or per head
UNNORMALIZED = [(1, 48, "level", True), (17, 32, "level", False), (64, 64, True, True), (100, 48, "level", True),
                (257, 32, False, False), (257, 64, "level", True)]


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("T,D,decay,state", UNNORMALIZED)
def test_unnormalized_vs_reference(path, T, D, decay, state):
    inputs = make(2, T, 2, D, decay, state)
    truth = run(inputs, torch.float64, backend="reference", normalize=False)
    got = run(inputs, torch.float32, backend=path, normalize=False)
    compare(got, truth, FP32_TOL, T, True)  # dq is not of order eps without the denominator


@pytest.mark.parametrize("normalize", [True, False])
def test_level_decays_are_per_level(normalize):
    """An [Lv, H] decay with equal rows equals the [H] decay; with distinct rows each level
    follows its own (the reference computes level by level)."""
    q, k, v, w, g, st = make(2, 30, 2, 32, "level", True)
    kw = dict(state=st, normalize=normalize, backend="reference")
    same = linear_attention(q, k, v, w, OMEGAS, g[:1].expand(2, 2), **kw)
    head = linear_attention(q, k, v, w, OMEGAS, g[0], **kw)
    assert_rel(same[0], head[0], 1e-12, "o")
    one_level = [linear_attention(q, k, v, torch.eye(2, dtype=q.dtype)[l], OMEGAS, g[l], **kw)[0] for l in (0, 1)]
    assert_rel(linear_attention(q, k, v, w, OMEGAS, g, **kw)[0], w[0] * one_level[0] + w[1] * one_level[1],
               1e-12, "o as the levels' own")


def per_position_decay(B, T, H, per: str, dt=torch.float64, low=0.4, high=1.0):
    """A decay of each position's own, in [low, high) ([0.4, 1) by default; strong decays: [0.01,
    0.3)): [B, T, Lv, H] ("level") or [B, T, H] ("head")."""
    return (torch.rand(B, T, *((2,) if per == "level" else ()), H) * (high - low) + low).float().to(dt)


PER_POSITION_NAMES = ["o", "S", "z", "dq", "dk", "dv", "dw", "ddecay", "dS0", "dz0"]


def run_per_position(inputs, g, dtype, resets=None, state_loss=True, **kw):
    """linear_attention with the decay ``g`` per position, q, k, v in dtype (the rest fp32; all fp64
    for the truth): (o, S, z) and the gradients of (q, k, v, w, decay, S0, z0) for a fixed random
    loss on every output (on o only without ``state_loss``)."""
    q, k, v, w, _, st = inputs
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    x += [t.detach().to(sdt).requires_grad_() for t in (w, g, *(st or ()))]
    o, (S, z) = linear_attention(*x[:4], OMEGAS, decay=x[4], state=tuple(x[5:]) or None, resets=resets, **kw)
    gen = torch.Generator().manual_seed(1)
    loss = sum((y.double() * torch.randn(y.shape, generator=gen, dtype=torch.float64)).sum()
               for y in ((o, S, z) if state_loss else (o,)))
    return [o, S, z, *torch.autograd.grad(loss, x)]


STRONG = (0.01, 0.3)  # decays that keep a few positions: the decay's gradient is small beside its parts


@pytest.mark.parametrize("path,per,T,D,state,resets,decays", [
    ("torch", "level", 1, 32, True, False, None), ("torch", "head", 64, 32, False, False, None),
    ("torch", "level", 100, 32, True, True, None), ("torch", "head", 257, 32, True, False, None),
    ("torch", "level", 4, 32, True, False, STRONG), ("torch", "head", 1, 32, False, False, STRONG),
    ("triton", "level", 17, 48, True, False, None), ("triton", "head", 100, 64, False, False, None),
    ("triton", "level", 257, 48, True, False, None), ("triton", "head", 1, 32, True, False, None),
    ("triton", "level", 4, 32, True, False, STRONG), ("triton", "head", 1, 32, False, False, STRONG),
    ("triton", "level", 100, 48, True, False, STRONG), ("triton", "head", 257, 32, False, False, STRONG)])
def test_decay_per_position_vs_reference(path, per, T, D, state, resets, decays):
    """A decay of each position's own ([B, T, Lv, H] or [B, T, H], the model's decay_gate) vs the
    reference's token loop: outputs, final state and every gradient, the decay's included — strong
    decays too (γ down to 0.01; at T = 1 without a state the decay's exact gradient is 0)."""
    inputs = make(2, T, 2, D, False, state)
    g = per_position_decay(2, T, 2, per, *((torch.float64, *decays) if decays else ()))
    r = random_resets(2, T) if resets else None
    truth = run_per_position(inputs, g, torch.float64, r, backend="reference")
    got = run_per_position(inputs, g, torch.float32, r, backend=path)
    for name, x, ref in zip(PER_POSITION_NAMES, got, truth):
        if name == "dq" and T == 1 and not state:
            continue
        assert_rel(x.double(), ref.double(), FP32_TOL, name)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("path,T", [("torch", 40), ("triton", 100)])
def test_decay_per_position_low_precision(path, T, dtype):
    """The same in fp16 and bf16, by the low-precision rule against the same-dtype reference, the
    loss on every output, the final state's included."""
    inputs = make(2, T, 2, 48, False, True, dtype=dtype)
    g = per_position_decay(2, T, 2, "level")
    truth = run_per_position(inputs, g, torch.float64, backend="reference")
    ref = run_per_position(inputs, g, dtype, backend="reference")
    got = run_per_position(inputs, g, dtype, backend=path)
    for name, x, r, t in zip(PER_POSITION_NAMES, got, ref, truth):
        assert_lowp(x, r, t, lowp_tol(3e-3 if name == "dw" else 5e-4, dtype), f"{dtype} {name}")


@pytest.mark.parametrize("per", ["level", "head"])
def test_triton_decode_kernel_with_a_decay_per_position(decode_launches, per):
    q, k, v, w, _, st = make(2, 9, 2, 48, False, True)
    g = per_position_decay(2, 9, 2, per)
    truth = linear_attention(q, k, v, w, OMEGAS, g, st, backend="reference")
    with torch.no_grad():
        got = linear_attention(*(x.float() for x in (q, k, v, w)), OMEGAS, g.float(), tuple(x.float() for x in st),
                               backend="triton")
    assert decode_launches.count == 1
    for name, a, b in zip(("o", "S", "z"), (got[0], *got[1]), (truth[0], *truth[1])):
        assert_rel(a.double(), b, FP32_TOL, name)


def test_a_decay_the_same_at_every_position_is_the_fixed_decay():
    q, k, v, w, g, st = make(2, 70, 2, 16, "level", True)
    fixed = linear_attention(q, k, v, w, OMEGAS, g, st, backend="torch")
    per_position = linear_attention(q, k, v, w, OMEGAS, g.expand(2, 70, 2, 2), st, backend="torch")
    for name, a, b in zip(("o", "S", "z"), (fixed[0], *fixed[1]), (per_position[0], *per_position[1])):
        assert_rel(b, a, 1e-6, name)


def random_resets(B, T, seed=3):
    """[B, T] resets: a few random positions, the first of row 0 and a chunk boundary of row 1."""
    r = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.04
    r[0, 0] = True
    r[1, min(64, T - 1)] = True
    return r


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("T,decay,state", [(1, "level", True), (40, True, True), (100, "level", True),
                                           (150, False, False), (257, "level", False)])
def test_resets_torch_path_vs_reference(T, decay, state, normalize):
    """Resets on the PyTorch path (masks within and across chunks) vs the reference's token loop,
    outputs, final state and every gradient."""
    inputs = make(2, T, 2, 32, decay, state)
    r = random_resets(2, T)
    truth = run(inputs, torch.float64, backend="reference", normalize=normalize, resets=r)
    got = run(inputs, torch.float32, backend="torch", normalize=normalize, resets=r)
    compare(got, truth, FP32_TOL, T, not normalize)  # T = 1, reset at 0, with the denominator: dq of order eps


def test_a_reset_starts_the_state_afresh():
    """From a reset on, the outputs are those of a call that starts there with no state, and the
    final state too; before it, those of the call without resets."""
    q, k, v, w, g, st = make(2, 90, 2, 16, "level", True)
    r = torch.zeros(2, 90, dtype=torch.bool)
    r[:, 37] = True
    for path, tol in (("reference", 1e-10), ("torch", 1e-6)):  # the torch path computes in fp32
        o, (S, z) = linear_attention(q, k, v, w, OMEGAS, g, st, backend=path, resets=r)
        fresh, (S1, z1) = linear_attention(q[:, 37:], k[:, 37:], v[:, 37:], w, OMEGAS, g, backend=path)
        plain, _ = linear_attention(q[:, :37], k[:, :37], v[:, :37], w, OMEGAS, g, st, backend=path)
        assert_rel(o[:, 37:], fresh, tol, f"{path}: after the reset")
        assert_rel(o[:, :37], plain, tol, f"{path}: before it")
        assert_rel(S, S1, tol, f"{path}: final S")
        assert_rel(z, z1, tol, f"{path}: final z")


@pytest.fixture
def decode_launches(monkeypatch):
    """Counts the decode kernel's launches."""
    counter = Launches(la_kernels._la_decode_kernel)
    monkeypatch.setattr(la_kernels, "_la_decode_kernel", counter)
    return counter


@pytest.mark.parametrize("T,D,decay,state", [(1, 48, True, True), (1, 32, False, False),
                                             (5, 64, True, False), (16, 48, False, True)])
def test_triton_decode_kernel(decode_launches, T, D, decay, state):
    """T <= 16 without autograd runs the one-launch decode kernel."""
    inputs = make(2, T, 3, D, decay, state)
    truth = run(inputs, torch.float64, grad=False, backend="reference")
    with torch.no_grad():
        got = run(inputs, torch.float32, grad=False, backend="triton")
    assert decode_launches.count == 1
    for name, x, ref in zip(NAMES, got, truth):
        assert_rel(x.double(), ref, 1e-5, name)


@pytest.mark.parametrize("T,D,state", [(1, 48, True), (16, 32, False)])
def test_triton_decode_kernel_unnormalized(decode_launches, T, D, state):
    inputs = make(2, T, 3, D, "level", state)
    truth = run(inputs, torch.float64, grad=False, backend="reference", normalize=False)
    with torch.no_grad():
        got = run(inputs, torch.float32, grad=False, backend="triton", normalize=False)
    assert decode_launches.count == 1
    for name, x, ref in zip(NAMES, got, truth):
        assert_rel(x.double(), ref, 1e-5, name)


def test_no_grad_forward_writes_nothing_for_backward(monkeypatch):
    """Leaves that require grad under no_grad (evaluation, generation's prefill): the chunked
    forward does not write the per-level outputs a backward would read."""
    out = Launches(la_kernels._la_out_kernel)
    monkeypatch.setattr(la_kernels, "_la_out_kernel", out)
    q, k, v, w, g, (S0, z0) = (x.float() if torch.is_tensor(x) else x for x in make(2, 40, 2, 32, True, True))
    omegas = level_omegas(w.numel())
    args = [t.requires_grad_() for t in (q, k, v, w)]
    truth = linear_attention(*args, omegas, decay=g, state=(S0, z0), backend="reference")
    with torch.no_grad():
        o, (S, z) = linear_attention(*args, omegas, decay=g, state=(S0, z0), backend="triton")
    assert o.grad_fn is None
    for name, x, ref in zip(NAMES, (o, S, z), (truth[0], *truth[1])):
        assert_rel(x, ref, 1e-5, name)
    linear_attention(*args, omegas, decay=g, state=(S0, z0), backend="triton")
    assert [kw["STORE_Y"] for kw in out.kwargs] == [False, True]


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("levels", [1, 3])
def test_level_counts(path, levels):
    inputs = make(3, 70, 2, 32, True, True, levels=levels)
    truth = run(inputs, torch.float64, backend="reference")
    got = run(inputs, torch.float32, backend=path)
    compare(got, truth, FP32_TOL, 70, True)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_partial_losses(path):
    """Gradients when only the output, or only the final state, enters the loss."""
    q, k, v, w, g, st = make(2, 40, 2, 32, True, True)
    for pick in (0, 1):
        res = {}
        for be, dt in (("reference", torch.float64), (path, torch.float32)):
            leaves = [x.to(dt).requires_grad_() for x in (q, k, v, w, *st)]
            o, (S, z) = linear_attention(*leaves[:4], OMEGAS, g.to(dt), tuple(leaves[4:]), backend=be)
            loss = (o * o).sum() if pick == 0 else (S * S).sum() + z.sum()
            res[be] = torch.autograd.grad(loss, leaves, allow_unused=True)
        for name, x, ref in zip(NAMES[3:], res[path], res["reference"]):
            what = f"{name} (loss on {'o' if pick == 0 else 'state'})"
            if ref is None:  # the final state does not depend on q
                assert x is None or not x.any(), what
            else:
                assert_rel(x.double(), ref, FP32_TOL, what)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_split_and_resume(path):
    """Two calls with the carried state == one call; T calls of one position == one call."""
    q, k, v, w, g = (x.float() for x in make(2, 100, 2, 32, True, True)[:5])
    st = tuple(x.float() for x in make(2, 1, 2, 32, False, True)[5])
    o, (S, z) = linear_attention(q, k, v, w, OMEGAS, g, st, backend=path)
    o1, s1 = linear_attention(q[:, :37], k[:, :37], v[:, :37], w, OMEGAS, g, st, backend=path)
    o2, (S2, z2) = linear_attention(q[:, 37:], k[:, 37:], v[:, 37:], w, OMEGAS, g, s1, backend=path)
    assert_rel(torch.cat([o1, o2], 1), o, 1e-5, "o")
    assert_rel(S2, S, 1e-5, "S")
    assert_rel(z2, z, 1e-5, "z")
    # the gradients through the carried state (not detached) equal those of the one call
    leaves = [x.detach().requires_grad_() for x in (q, k, v, w, *st)]
    gen = torch.Generator().manual_seed(2)
    dy = [torch.randn(x.shape, generator=gen) for x in (o, S, z)]
    grads = {}
    for split in (False, True):
        qq, kk, vv, ww, S0, z0 = leaves
        if split:
            oa, sa = linear_attention(qq[:, :37], kk[:, :37], vv[:, :37], ww, OMEGAS, g, (S0, z0), backend=path)
            ob, (Sb, zb) = linear_attention(qq[:, 37:], kk[:, 37:], vv[:, 37:], ww, OMEGAS, g, sa, backend=path)
            outs = (torch.cat([oa, ob], 1), Sb, zb)
        else:
            o_, (S_, z_) = linear_attention(qq, kk, vv, ww, OMEGAS, g, (S0, z0), backend=path)
            outs = (o_, S_, z_)
        grads[split] = torch.autograd.grad(sum((x * d).sum() for x, d in zip(outs, dy)), leaves)
    for name, a, b in zip(NAMES[3:], grads[True], grads[False]):
        assert_rel(a, b, 1e-5, f"{name} across the split")
    state, outs = st, []
    for t in range(6):
        ot, state = linear_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], w, OMEGAS, g, state,
                                     backend=path)
        outs.append(ot)
    o6, (S6, z6) = linear_attention(q[:, :6], k[:, :6], v[:, :6], w, OMEGAS, g, st, backend=path)
    assert_rel(torch.cat(outs, 1), o6, 1e-5, "decode o")
    assert_rel(torch.cat(outs, 1), o[:, :6], 1e-5, "decode o vs the long call")
    assert_rel(state[0], S6, 1e-5, "decode S")
    assert_rel(state[1], z6, 1e-5, "decode z")


def _assert_lowp(inputs, grad, path, dtype=torch.float16, state_loss=True, loss_mean=0.0, tol=5e-4, **kw):
    """A run of path in dtype vs the fp64 truth, by the low-precision rule against the same-dtype
    reference (which computes in fp32); tol is fp16's (:func:`lowp_tol`); ``kw`` to every call."""
    truth = run(inputs, torch.float64, grad, state_loss, loss_mean=loss_mean, backend="reference", **kw)
    ref = run(inputs, dtype, grad, state_loss, loss_mean=loss_mean, backend="reference", **kw)
    with torch.set_grad_enabled(grad):
        got = run(inputs, dtype, grad, state_loss, loss_mean=loss_mean, backend=path, **kw)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for name, x, r, t in zip(NAMES, got, ref, truth):
        # dw = Σ dO·y_l over B·T·H·D terms that largely cancel: the rounding of the dot operands
        # in y (fp16: ~3e-4) comes out ~10x larger there; the references compute y in fp32.
        assert_lowp(x, r, t, lowp_tol(3e-3 if name == "dw" else tol, dtype), f"{dtype} {name}")


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("path,T,grad", [("torch", 40, True), ("triton", 100, True), ("triton", 5, False)])
def test_low_precision(path, T, grad, dtype):
    _assert_lowp(make(2, T, 2, 48, True, True, dtype=dtype), grad, path, dtype)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("path,T,grad", [("torch", 40, True), ("triton", 100, True), ("triton", 5, False)])
def test_low_precision_unnormalized(path, T, grad, dtype):
    _assert_lowp(make(2, T, 2, 48, "level", True, dtype=dtype), grad, path, dtype, normalize=False)


def large_state(inputs, scale=1e5):
    """inputs with the state (S, z) scaled by scale and held at fp32 values: a state carried
    over ~scale tokens, beyond fp16's range (65504)."""
    *rest, (S, z) = inputs
    return (*rest, tuple((x * scale).float().double() for x in (S, z)))


@pytest.mark.parametrize("state_loss", [True, False])
def test_fp16_large_state(state_loss):
    """fp16 inputs, no decay, fp32 state ~1e5 (so dO/den ~1e-7): the chunked forward and backward
    (several chunks) keep the state, its gradient and dO/den out of fp16. Output, final state and
    every gradient by the low-precision rule; the loss on o only is training's (state detached)."""
    inputs = large_state(make(2, 70, 2, 32, False, True, dtype=torch.float16))
    _assert_lowp(inputs, True, "triton", state_loss=state_loss)


def test_fp16_large_state_decode(decode_launches):
    """The decode kernel with the same state (it keeps every state quantity in fp32)."""
    _assert_lowp(large_state(make(2, 5, 2, 32, False, True, dtype=torch.float16)), False, "triton")
    assert decode_launches.count == 1


@triton.jit
def _round_kernel(x_ptr, y_ptr, N, DROP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, _round_mantissa(tl.load(x_ptr + i, mask=i < N), DROP), mask=i < N)


def test_round_mantissa_gives_the_dot_operands_values():
    """The state dots' operand rounding: to the nearest bf16 (DROP 16: torch's own rounding, ties
    aside) and tf32 (DROP 13) value, kept in fp32, at every scale and sign, subnormals included;
    zeros and infinities kept, NaN kept NaN whatever its bits (CUDA's own NaN is 0x7FFFFFFF)."""
    x = torch.randn(4000, dtype=torch.float64).mul(torch.logspace(-30, 30, 4000, dtype=torch.float64)).float()
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -3e-39])
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, special, nans])
    bits, finite = x.view(torch.int32), x.isfinite()
    normal = finite & (x.abs() >= torch.finfo(torch.float32).tiny)
    for drop, mantissa in ((16, 7), (13, 10)):
        y = torch.full_like(x, 1.0)
        _round_kernel[(1,)](x, y, x.numel(), DROP=drop, BLOCK=4096)
        assert y[-4:].isnan().all() and torch.equal(y[-10:-6], special[:4])
        assert (y[finite].view(torch.int32) & ((1 << drop) - 1) == 0).all()  # representable
        assert ((y - x)[normal].abs() <= x[normal].abs() * 2.0 ** -(mantissa + 1)).all()  # and the nearest
        if drop == 16:
            tie = bits & 0xFFFF == 0x8000
            assert torch.equal(y[finite & ~tie], x[finite & ~tie].bfloat16().float())


LONG = dict(history=8192, v_mean=1.0)  # a state carried over 8,192 tokens, v around a mean of its spread


def test_long_carried_state_under_bf16_autocast():
    """Training's setting on the PyTorch path (bf16 autocast, no decay, a long carried state, v with
    a mean): S ≈ z·v̄ᵀ grows with the tokens seen while dq = (S·dO − (dO·y)·z)/den stays the size of
    v's spread, so the product with the state must stay fp32 (in bf16, dq's error is 0.56)."""
    inputs = make(1, 64, 2, 64, False, False, **LONG)
    truth = run(inputs, torch.float64, backend="reference")
    got = run(inputs, torch.float32, bf16_autocast=True, backend="torch")
    for name, x, ref in zip(NAMES, got, truth):
        assert_rel(x.double(), ref, 1e-2, name)


@pytest.mark.parametrize("dtype", LOWP)
def test_long_sequence_low_precision(dtype):
    """One call over 2,048 tokens, v and dO with a mean, the loss on o (training's): the state
    built within the call and the intra-chunk term must enter the numerator and the denominator
    with the same rounded f(k) and A (denominators summing unrounded ones exceed the fp16 reference's
    dq error, the reference computing in fp32, by 2.2e-3). The kernels' 10-bit dot operands exceed it
    by 5e-4 (at 1,024 and 2,048 tokens, dO means 0 to 3), hence fp16's tol 1e-3 (bf16's 8-bit ones
    by 4.7e-3)."""
    _assert_lowp(make(1, 2048, 1, 16, False, False, dtype=dtype, levels=1, v_mean=1.0), True,
                 "triton", dtype, state_loss=False, loss_mean=3.0, tol=1e-3)


@pytest.mark.parametrize("dtype", LOWP)
def test_long_carried_state_low_precision(dtype):
    """The Triton kernels with the same state in fp16 and bf16, by the low-precision rule; the state
    dots run in tf32 (fp16) or bf16, which the tests' interpreter rounds as a GPU does; S split in
    two operands keeps dq's error that of the other operands (an unsplit S: fp16 dq 4e-2)."""
    _assert_lowp(make(1, 70, 2, 64, False, False, dtype=dtype, **LONG), True, "triton", dtype)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_decay_requiring_grad_is_an_error(path):
    """Only the reference differentiates through decay: the other paths refuse a decay that
    requires grad instead of dropping its gradient; under no_grad nothing is dropped."""
    q, k, v, w, _, _ = (x.float() if torch.is_tensor(x) else x for x in make(2, 20, 2, 16, False, False))
    g = torch.full((2,), 0.9, requires_grad=True)
    with pytest.raises(ValueError, match="no gradient for decay"):
        linear_attention(q, k, v, w, OMEGAS, g, backend=path)
    o, _ = linear_attention(q, k, v, w, OMEGAS, g, backend="reference")
    assert torch.autograd.grad(o.sum(), g)[0].abs().sum() > 0
    with torch.no_grad():
        o2, _ = linear_attention(q, k, v, w, OMEGAS, g, backend=path)
    assert_rel(o2, o.detach(), 1e-5, "o under no_grad")


def test_bad_state_shape():
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError):
        linear_attention(q, q, q, torch.ones(2) / 2, OMEGAS,
                         state=(torch.zeros(1, 2, 2, 8, 8), torch.zeros(1, 2, 2, 9)))


@pytest.mark.parametrize("path", ["torch", "triton", "reference"])
def test_bad_inputs(path):
    """A decay outside (0, 1] (the torch path gave NaN for 0), a list instead of a tensor, integer
    q/k/v, mismatched shapes, T=0 and the wrong number of level weights are errors on every path;
    fp64 and D > 128 on the Triton path."""
    q = torch.randn(1, 3, 2, 16)
    w = torch.ones(2) / 2
    cases = [({"decay": torch.tensor([0.9, 0.0])}, ValueError, r"decay must lie in \(0, 1\]"),
             ({"decay": torch.tensor([0.9, 1.5])}, ValueError, r"decay must lie in \(0, 1\]"),
             ({"decay": [0.9, 0.9]}, ValueError,
              r"decay must be None or a tensor \[H\]=\(2,\), \[Lv, H\]=\(2, 2\), \[B, T, H\]=\(1, 3, 2\) or \[B, T, Lv, H\]"),
             ({"q": q.long()}, TypeError, "q, k, v must be floating"),
             ({"q": q[:, :2]}, ValueError, r"q, k, v must all be \[B, T, H, D\]; got \(1, 2, 2, 16\)"),
             ({"q": q[0]}, ValueError, r"q, k, v must all be \[B, T, H, D\]"),
             ({"q": q[:, :0], "k": q[:, :0], "v": q[:, :0]}, ValueError, "need T >= 1 and at least one level; got T=0"),
             ({"w": torch.ones(3) / 3}, ValueError, r"level_weights must be \[Lv\]=2, got \(3,\)")]
    cases += [({"resets": torch.zeros(1, 4, dtype=torch.bool)}, ValueError, r"resets must be None or a \[B, T\]")]
    if path == "triton":
        cases += [({"resets": torch.zeros(1, 3, dtype=torch.bool)}, ValueError, "has no resets"),
                  ({"q": q.double(), "k": q.double(), "v": q.double()}, TypeError,
                   "the Triton linear attention takes fp32/fp16/bf16 inputs, got torch.float64"),
                  ({"q": torch.randn(1, 3, 1, 256), "k": torch.randn(1, 3, 1, 256), "v": torch.randn(1, 3, 1, 256)},
                   ValueError, "D <= 128, got 256")]
    for kw, err, msg in cases:
        args = {"q": q, "k": q, "v": q, "w": w, **kw}
        with pytest.raises(err, match=msg):
            linear_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("w"), OMEGAS, backend=path, **args)
