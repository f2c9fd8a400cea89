"""Sparse low-rank / dense MoE: every path vs the fp32 per-token reference, output and every gradient."""
from contextlib import ExitStack

import pytest
import torch

from fractus.ops.moe import kernels as moe_kernels
from fractus.ops.moe import moe, moe_reference
from fractus.ops.moe.kernels import Route
from util import LOWP, Launches, assert_lowp, assert_rel, lowp_tol, make_experts, pinned
from util import MOE_D as D
from util import MOE_FF as FF


def make_inputs(N, E, K, d=D, route="random", dtype=torch.float32):
    """x [N, d], idx [N, K] (distinct experts per token, except with route "one" or "twice"), w [N, K] > 0."""
    x = torch.randn(N, d).to(dtype).requires_grad_()
    if route == "one":
        idx = torch.full((N, K), E - 1, dtype=torch.int64)
    else:
        idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    if route == "twice":  # every token's first expert also in its second slot
        idx[:, 1] = idx[:, 0]
    w = torch.softmax(torch.randn(N, K), -1).to(dtype).requires_grad_()
    return x, idx, w


def run(backend, x, idx, w, ex, dy):
    """Output and gradients for x, w and every expert tensor (in the dict's order)."""
    y = moe(x, idx, w, ex, backend=backend)
    return (y, *torch.autograd.grad(y, [x, w, *ex.values()], dy))


def truth(x, idx, w, ex, dy):
    """The reference in fp64: what every path is judged against."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    return run("reference", x64, idx, w64, {k: v.detach().double().requires_grad_() for k, v in ex.items()},
               dy.double())


def check(backend, N, E, K, lowrank=True, r=16, route="random", tol=3e-5, d=D, F=FF):
    """Output and every gradient vs the fp64 truth (3e-5: s1, s2 sum every token of an expert,
    and with all 29 on one the fp32 sum's rounding reaches 1.5e-5)."""
    ex = make_experts(E, d, F, r=r, lowrank=lowrank)
    x, idx, w = make_inputs(N, E, K, d, route=route)
    dy = torch.randn(N, d)
    got = run(backend, x, idx, w, ex, dy)
    for name, a, b in zip(["y", "dx", "dw", *ex], got, truth(x, idx, w, ex, dy)):
        assert_rel(a, b, tol, f"{backend} {name}")


# ----------------------------------------------------------------------------- fast PyTorch path
@pytest.mark.parametrize("E,K", [(4, 1), (7, 2), (16, 2), (4, 4), (7, 7)])
@pytest.mark.parametrize("lowrank", [True, False])
@pytest.mark.parametrize("N", [13, 37])  # every expert on every token (decoding's few), sorted dispatch
def test_torch_matches_reference(N, E, K, lowrank):
    check("torch", N, E, K, lowrank=lowrank, r=16 if E != 7 else 32)


@pytest.mark.parametrize("N,E,K,route", [(1, 16, 2, "random"), (3, 16, 1, "random"),
                                         (29, 4, 1, "one"), (9, 16, 16, "random")])
def test_torch_routing_edge_cases(N, E, K, route):
    """A single token, experts with no tokens, every token on one expert, K = E."""
    check("torch", N, E, K, route=route)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("lowrank", [True, False])
def test_a_token_may_choose_an_expert_twice(backend, lowrank):
    """The model's top-k never repeats an expert; a direct caller's idx may: both slots count."""
    check(backend, 13, 7, 3, lowrank=lowrank, route="twice")


def test_torch_fp16_close_to_truth():
    ex = make_experts(4, dtype=torch.float16)
    x, idx, w = make_inputs(11, 4, 2, dtype=torch.float16)
    dy = torch.randn(11, D, dtype=torch.float16)
    got = run("torch", x, idx, w, ex, dy)
    ref = run("reference", x, idx, w, ex, dy)
    assert got[0].dtype == torch.float16
    for name, a, b in zip(["y", "dx", "dw", *ex], got, ref):
        assert_rel(a, b, 1e-2, f"torch fp16 {name}")


def test_auto_on_cpu_and_bad_keys():
    ex = make_experts(4)
    x, idx, w = make_inputs(5, 4, 2)
    assert torch.equal(moe(x, idx, w, ex), moe(x, idx, w, ex, backend="torch"))
    with pytest.raises(KeyError):
        moe(x, idx, w, {"V1": ex["V1"]})


def _set(ex, **kw):
    return {**ex, **kw}


# (name, lowrank, bad(x, idx, w, ex) -> (x, idx, w, ex), error, message naming the argument);
# N, E, K = 4, 3, 2
BAD = [
    ("x fewer rows", True, lambda x, i, w, ex: (x[:3], i, w, ex), ValueError, r"idx must be \[N, K\] with N=3"),
    ("idx, w one row short", True, lambda x, i, w, ex: (x, i[:3], w[:3], ex), ValueError, r"idx must be"),
    ("w [N, K+1]", True, lambda x, i, w, ex: (x, i, torch.ones(4, 3), ex), ValueError, r"w must be"),
    ("w [K, N]", False, lambda x, i, w, ex: (x, i, w.t(), ex), ValueError, r"w must be"),
    ("x d+1 columns", True, lambda x, i, w, ex: (torch.randn(4, D + 1), i, w, ex), ValueError, r"experts\['V1'\]"),
    ("x d+1 dense", False, lambda x, i, w, ex: (torch.randn(4, D + 1), i, w, ex), ValueError, r"experts\['W1'\]"),
    ("b1 [E-1, F]", False, lambda x, i, w, ex: (x, i, w, _set(ex, b1=ex["b1"][:2])), ValueError, r"from b1"),
    ("s1 [E-1]", True, lambda x, i, w, ex: (x, i, w, _set(ex, s1=ex["s1"][:2])), ValueError, r"experts\['s1'\]"),
    ("U2 rank r+1", True, lambda x, i, w, ex: (x, i, w, _set(ex, U2=torch.randn(3, D, 17))), ValueError,
     r"experts\['U2'\]"),
    ("3-D x", True, lambda x, i, w, ex: (x.view(2, 2, D), i, w, ex), ValueError, r"x must be \[N, d\]"),
    ("idx = -1", True, lambda x, i, w, ex: (x, i.masked_fill(i == i[0, 0], -1), w, ex), ValueError,
     r"idx must lie in \[0, E=3\)"),
    ("idx = E", False, lambda x, i, w, ex: (x, i.masked_fill(i == i[0, 0], 3), w, ex), ValueError,
     r"idx must lie in \[0, E=3\)"),
    ("float idx", True, lambda x, i, w, ex: (x, i.float(), w, ex), TypeError, r"idx"),
    ("int w", True, lambda x, i, w, ex: (x, i, torch.ones(4, 2, dtype=torch.int64), ex), TypeError, r"w"),
    ("b1 [E]", True, lambda x, i, w, ex: (x, i, w, _set(ex, b1=ex["b1"][:, 0])), ValueError,
     r"experts\['b1'\] must be \[E, F\]"),
    ("int U1", True, lambda x, i, w, ex: (x, i, w, _set(ex, U1=ex["U1"].long())), TypeError,
     r"experts\['U1'\] must be floating"),
    ("fp64 dense on Triton", False,
     lambda x, i, w, ex: (x.double(), i, w.double(), {k: v.double() for k, v in ex.items()}), TypeError,
     r"Triton MoE takes fp32/fp16/bf16 x"),
]


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@pytest.mark.parametrize("name,lowrank,bad,err,msg", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise(backend, name, lowrank, bad, err, msg):
    """Mismatched shapes, dtypes and expert ids raise an error naming the argument on every path
    (fp64 is only refused by Triton) instead of corrupting memory or giving wrong results."""
    if name.endswith("on Triton") and backend != "triton":
        pytest.skip("fp64 is valid on the PyTorch paths")
    torch.manual_seed(0)
    ex = {k: v.detach() for k, v in make_experts(3, lowrank=lowrank).items()}
    x, idx, w = (t.detach() for t in make_inputs(4, 3, 2))
    with pytest.raises(err, match=msg):
        moe(*bad(x, idx, w, ex), backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@pytest.mark.parametrize("lowrank", [True, False])
def test_no_tokens(backend, lowrank):
    """N = 0: an empty [0, d] output on every path, and backward runs through it."""
    ex = make_experts(3, lowrank=lowrank)
    x, idx, w = make_inputs(4, 3, 2)
    y = moe(x[:0], idx[:0], w[:0], ex, backend=backend)
    assert y.shape == (0, D) and y.dtype == x.dtype and y.grad_fn is not None
    y.sum().backward()
    assert all(t.grad is None or not t.grad.any() for t in (x, w, *ex.values()))


# ----------------------------------------------------------------------------- Triton (interpreter)
@pytest.mark.parametrize("N,E,K", [(37, 16, 2), (40, 4, 1), (1, 7, 7)])
def test_route_tiles_cover_each_row_once(N, E, K):
    """Device-side bookkeeping: sorted pairs, per-expert offsets, ≤ ceil(NK/BM) + E one-expert tiles,
    the unused ones empty at 0 (so a tile's int32 rows stay below NK + BM, which the route bounds)."""
    BM = 16
    idx = torch.randint(0, E, (N, K))
    rt = Route(idx, E, BM)
    flat = idx.reshape(-1)
    assert torch.equal(flat[rt.order], rt.sexp) and torch.equal(rt.stok, rt.order // K)
    assert rt.T == -(-N * K // BM) + E and rt.offs[-1] == N * K
    assert torch.equal(rt.offs[1:] - rt.offs[:-1], torch.bincount(flat, minlength=E).int())
    seen = torch.zeros(N * K, dtype=torch.int64)
    for e, lo, hi in zip(rt.tile_e.tolist(), rt.tile_lo.tolist(), rt.tile_hi.tolist()):
        assert 0 <= hi - lo <= BM and (0 <= lo < N * K or lo == hi == 0)  # rows lo + [0, BM) below NK + BM
        seen[lo:hi] += 1
        assert (rt.sexp[lo:hi] == e).all()
    assert (seen == 1).all()


# d = 47, F = 81: every d- and F-block of the kernels (16 or 32 wide in the interpreter) has a ragged edge
@pytest.mark.parametrize("N,E,K,r,route,d,F", [(13, 7, 2, 16, "random", 47, 81), (5, 4, 4, 32, "random", D, FF),
                                               (37, 4, 1, 24, "one", D, FF), (1, 16, 2, 16, "random", D, FF),
                                               (9, 7, 7, 64, "random", D, FF)])
def test_triton_lowrank_matches_reference(N, E, K, r, route, d, F):
    """Odd token counts and sizes, several tiles per expert, K = E (4 and 7), r not a power of two
    and the presets' r = 64, empty experts, a single token."""
    check("triton", N, E, K, r=r, route=route, d=d, F=F)


@pytest.mark.parametrize("N,E,K,route,d,F", [(13, 7, 2, "random", 47, 81), (19, 4, 1, "one", D, FF),
                                             (1, 16, 16, "random", D, FF)])
def test_triton_dense_matches_reference(N, E, K, route, d, F):
    """Ragged d and F, every token on one expert, a single token routed to all 16 experts."""
    check("triton", N, E, K, lowrank=False, route=route, d=d, F=F)


GPU_TUNED = {n: k for n, k in vars(moe_kernels).items() if hasattr(k, "gpu_configs")}


@pytest.mark.parametrize("i", range(max(len(k.gpu_configs) for k in GPU_TUNED.values())))
@pytest.mark.parametrize("lowrank", [True, False])
def test_triton_gpu_tiles(monkeypatch, lowrank, i):
    """The GPU's routing tiles (64 rows) and the i-th of its autotune configs for every kernel (the
    other tests run the interpreter's small blocks): several ragged blocks along d and F, experts
    with two tiles, the second partial."""
    monkeypatch.setattr(moe_kernels, "block_m", lambda: moe_kernels.GPU_BLOCK_M)
    path = [n for n in GPU_TUNED if n.startswith("_lr_" if lowrank else "_gmm")]
    assert len(path) == (4 if lowrank else 2)
    configs = {n: k.gpu_configs[i % len(k.gpu_configs)] for n, k in GPU_TUNED.items()}
    with ExitStack() as stack:
        for n, k in GPU_TUNED.items():
            k.best_config = None
            stack.enter_context(pinned(k, configs[n]))
        check("triton", 150, 4, 2, lowrank=lowrank, d=150, F=200)
        assert all(GPU_TUNED[n].best_config is configs[n] for n in path)


def test_triton_forward_without_grad(monkeypatch):
    """Leaves that require grad under no_grad: right output, and no activations saved."""
    fwd = Launches(moe_kernels._lr_fwd_kernel)
    monkeypatch.setattr(moe_kernels, "_lr_fwd_kernel", fwd)
    ex = make_experts(7)
    x, idx, w = make_inputs(13, 7, 2)
    with torch.no_grad():
        assert_rel(moe(x, idx, w, ex, backend="triton"), moe_reference(x, idx, w, ex), 1e-5, "no-grad y")
    moe(x, idx, w, ex, backend="triton")
    assert [k["SAVE"] for k in fwd.kwargs] == [False, True]


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("lowrank", [True, False])
def test_triton_low_precision(lowrank, masters, dtype):
    """fp16 or bf16 tokens: error vs the fp32 truth within that of the same-dtype PyTorch path (+ tol),
    with experts in that dtype or (``masters``, as under autocast) fp32 experts whose gradients stay fp32."""
    E, K, N = 7, 2, 13
    exl = make_experts(E, lowrank=lowrank, dtype=dtype)
    xl, idx, wl = make_inputs(N, E, K, dtype=dtype)
    dyl = torch.randn(N, D, dtype=dtype)
    ex32 = {k: v.detach().float().requires_grad_() for k, v in exl.items()}
    x32, w32 = xl.detach().float().requires_grad_(), wl.detach().float().requires_grad_()
    truth = run("reference", x32, idx, w32, ex32, dyl.float())
    ex = ex32 if masters else exl
    same = run("torch", xl, idx, wl, ex, dyl)
    got = run("triton", xl, idx, wl, ex, dyl)
    assert got[0].dtype == dtype
    assert [g.dtype for g in got[3:]] == [v.dtype for v in ex.values()]
    for name, a, b, t in zip(["y", "dx", "dw", *ex], got, same, truth):
        assert_lowp(a, b, t, lowp_tol(3e-4, dtype), f"triton {dtype} {name}")


def test_no_expert_per_token_is_refused_on_every_path():
    """K = 0: every path refuses it alike (the reference once returned an output without a graph,
    the others zeros with one)."""
    experts = make_experts(E=4, d=D, F=FF, r=8)
    x = torch.randn(5, D, requires_grad=True)
    for backend in ("reference", "torch"):
        with pytest.raises(ValueError, match="K = 0 experts per token"):
            moe(x, torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, 0), experts, backend=backend)
