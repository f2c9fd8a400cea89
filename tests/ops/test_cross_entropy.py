"""Fused linear + cross-entropy: every path vs the fp32 reference (loss, per-token ce, dH, dW)."""
import pytest
import torch
import torch.nn.functional as F

from fractus.ops import common as backend
from fractus.ops.cross_entropy import kernels as ce_kernels
from fractus.ops.cross_entropy import pytorch as ce_torch
from fractus.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from util import LOWP, assert_lowp, assert_rel, lowp_tol

TOL = 1e-5  # fp32 vs the fp32 reference (measured errors are below 1e-6)


def _inputs(N, V, d, dtype=torch.float32, ignore_every=5):
    h = torch.randn(N, d).to(dtype).requires_grad_()
    w = (torch.randn(V, d) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,))
    if ignore_every:
        t[1::ignore_every] = -100
    return h, w, t


def _run(fn, h, w, t, g=2.5, **kw):
    """(loss, per-token ce, dH, dW) of fn with upstream gradient g on the loss."""
    h.grad = w.grad = None
    loss, ce = fn(h, w, t, return_per_token=True, **kw)
    (loss * g).backward()
    return loss.detach(), ce, h.grad, w.grad


def _compare(backend_name, N, V, d, **kw):
    h, w, t = _inputs(N, V, d)
    if "ignore_index" in kw:  # the ignored rows relabelled; -100 becomes an ordinary (out of range) id
        t[t == -100] = kw["ignore_index"]
    if kw.get("positions") == "subset":
        kw["positions"] = torch.tensor([N - 1, 0, 3, 3, N // 2, 2])
    ref = _run(linear_cross_entropy_reference, h, w, t, **kw)
    out = _run(lambda *a, **k: linear_cross_entropy(*a, backend=backend_name, **k), h, w, t, **kw)
    for x, r, what in zip(out, ref, ("loss", "per-token ce", "dH", "dW")):
        assert x.dtype == r.dtype
        assert_rel(x, r, TOL, f"{backend_name} {what}")


V_IGNORED = 7  # a custom ignore_index that is also a valid token id: those rows are not scored
OPTIONS = [
    dict(),
    dict(reduction="sum", z_loss=1e-3),
    dict(softcap=4.0, positions="subset"),
    dict(reduction="sum", z_loss=1e-2, softcap=3.0, positions="subset"),
    dict(ignore_index=V_IGNORED),
]


@pytest.fixture
def small_chunks(monkeypatch):
    """Force several token chunks (16 rows each, _chunk_rows' floor) on the chunked CPU path."""
    monkeypatch.setattr(ce_torch, "CHUNK_ELEMS", 1)


@pytest.mark.parametrize("N,V,d", [(37, 127, 48), (300, 8192, 128), (150, 50257, 48)])
@pytest.mark.parametrize("kw", OPTIONS, ids=["mean", "sum-z", "cap-pos", "all", "ignore7"])
def test_torch_path(small_chunks, N, V, d, kw):
    _compare("torch", N, V, d, **kw)


@pytest.mark.parametrize("N,V,d,kw", [
    (37, 127, 48, dict()),
    (37, 300, 48, dict(reduction="sum", z_loss=1e-2, softcap=3.0)),
    (20, 8192, 128, dict(z_loss=1e-3, positions="subset")),
    (5, 50257, 48, dict(reduction="sum", softcap=4.0)),
    (37, 127, 48, dict(ignore_index=V_IGNORED, positions="subset")),
])
def test_triton_path(N, V, d, kw):
    _compare("triton", N, V, d, **kw)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("subset", [False, True])
def test_strided_positions_and_targets(path, subset):
    """Views with stride 2 (the Triton kernels read both with stride 1: they get contiguous copies)."""
    h, w, t = _inputs(37, 127, 48)
    pos = (torch.arange(74) % 37).flip(0)[::2] if subset else None  # every row once, out of order
    t2 = torch.stack([t, t], 1)[:, 0]  # t
    assert t2.stride() == (2,) and (pos is None or pos.stride() == (2,))
    ref = _run(linear_cross_entropy_reference, h, w, t, positions=None if pos is None else pos.contiguous())
    out = _run(lambda *a, **k: linear_cross_entropy(*a, backend=path, **k), h, w, t2, positions=pos)
    for x, r, what in zip(out, ref, ("loss", "per-token ce", "dH", "dW")):
        assert_rel(x, r, TOL, f"{path} {what}")


def test_triton_vocab_splits():
    """Few scored rows: the vocab is split across programs in forward and dH."""
    cfg = ce_kernels.tile_config(torch.zeros(1), 300)
    assert ce_kernels._n_split(6, 300, cfg) > 1
    _compare("triton", 12, 300, 48, positions="subset", z_loss=1e-3)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), *LOWP])
def test_triton_gpu_tiles(monkeypatch, dtype):
    """The GPU's tiles for the dtype (the other tests run the interpreter's small ones): 64-row
    token blocks (dW's: 128 rows in fp16 and bf16, the second ragged), the vocab split across the programs
    of an H200 (132 multiprocessors), a ragged last vocab tile, ragged d along BLOCK_K and BLOCK_D;
    fp16 or bf16 weights: dW in two slabs of 132 vocab tiles, the second partial."""
    monkeypatch.setattr(ce_kernels, "tile_config", lambda h, V: ce_kernels.gpu_config(h.dtype))
    cfg = ce_kernels.gpu_config(dtype)
    N, d = 150, 200
    V = 3000 if dtype == torch.float32 else cfg["slab_tiles"] * cfg["DW_BLOCK_V"] + 500
    assert ce_kernels._n_split(N, V, cfg) > 1
    h, w, t = _inputs(N, V, d, dtype=dtype)
    kw = dict(z_loss=1e-3, softcap=4.0)
    out = _run(lambda *a, **k: linear_cross_entropy(*a, backend="triton", **k), h, w, t, **kw)
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    truth = _run(linear_cross_entropy_reference, h32, w32, t, **kw)
    same = _run(linear_cross_entropy_reference, h, w, t, **kw)  # fp32 math, gradients in dtype
    for x, s, r, what in zip(out, same, truth, ("loss", "per-token ce", "dH", "dW")):
        assert x.dtype == s.dtype
        if dtype == torch.float32:
            assert_rel(x, r, TOL, f"GPU tiles {what}")
        else:
            assert_lowp(x.float(), s.float(), r, lowp_tol(3e-4, dtype), f"GPU tiles {dtype} {what}")


@pytest.mark.parametrize("path,N,V,d,w32", [("torch", 37, 300, 48, False), ("triton", 37, 300, 48, False),
                                              ("triton", 40, 8192, 128, False),
                                              ("torch", 37, 300, 48, True), ("triton", 37, 300, 48, True)])
@pytest.mark.parametrize("dtype", LOWP)
def test_low_precision(small_chunks, path, N, V, d, w32, dtype):
    """fp16 or bf16 h: error vs the fp32 truth no worse than PyTorch's own computation in that dtype.
    The weight is in dtype, or (``w32``: the model under autocast) an fp32 master whose gradient
    comes back fp32."""
    h, w, t = _inputs(N, V, d, dtype=dtype)
    if w32:
        w = w.detach().float().requires_grad_()
    truth = _run(linear_cross_entropy_reference, h.detach().float().requires_grad_(),
                 w.detach().float().requires_grad_(), t)

    def naive(h, w, t, return_per_token):
        ce = F.cross_entropy(F.linear(h, w.to(dtype)), t, reduction="none")
        return ce.sum() / (t != -100).sum(), ce

    same = _run(naive, h, w, t)
    out = _run(lambda *a, **k: linear_cross_entropy(*a, backend=path, **k), h, w, t)
    assert out[2].dtype == dtype and out[3].dtype == w.dtype
    for x, s, r, what in zip(out, same, truth, ("loss", "per-token ce", "dH", "dW")):
        assert_lowp(x.float(), s.float(), r, lowp_tol(3e-4, dtype), f"{path} {dtype} (weight {w.dtype}) {what}")


@pytest.mark.parametrize("path", ["torch", "triton", "reference"])
def test_out_of_range_target(path):
    h, w, t = _inputs(8, 127, 48)
    for bad in (127, -1):
        t2 = t.clone()
        t2[3] = bad
        with pytest.raises(ValueError, match="targets must lie"):
            linear_cross_entropy(h, w, t2, backend=path)


@pytest.mark.parametrize("path", ["torch", "triton", "reference"])
def test_bad_shapes_reduction_and_positions(path):
    """Mismatched shapes, an unknown reduction and positions outside the rows are errors naming
    the argument on every path."""
    h, w, t = _inputs(8, 127, 48)
    cases = [((h[0], w, t), {}, r"h must be \[N, d\] and weight \[V, d\], got \(48,\)"),
             ((h, w[:, :40], t), {}, r"got \(8, 48\) and \(127, 40\)"),
             ((h, w, t[:7]), {}, r"targets must be \[N\]=8, got \(7,\)"),
             ((h, w, t), {"reduction": "none"}, "reduction must be 'mean' or 'sum', got 'none'"),
             ((h, w, t), {"positions": torch.zeros(2, 2, dtype=torch.long)}, r"positions must be \[M\]"),
             ((h, w, t), {"positions": torch.tensor([0, 8])}, r"positions must lie in \[0, 8\), got range \[0, 8\]"),
             ((h, w, t), {"positions": torch.tensor([-1, 3])}, r"got range \[-1, 3\]")]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            linear_cross_entropy(*args, backend=path, **kw)


@pytest.mark.parametrize("path", ["torch", "triton", "reference"])
def test_non_integer_targets_or_positions(path):
    """A bool mask as positions, or float targets, is refused on every path (read as indices,
    a mask would score positions 0 and 1)."""
    h, w, t = _inputs(8, 127, 48)
    for kw, msg in (({"positions": t > 60}, "positions must hold integer token indices, got torch.bool"),
                    ({"targets": t.float()}, "targets must hold integer token indices, got torch.float32")):
        args = {"targets": t, **kw}
        with pytest.raises(TypeError, match=msg):
            linear_cross_entropy(h, w, args.pop("targets"), backend=path, **args)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_no_scored_rows(path):
    """All rows ignored, or no positions: loss 0 with zero gradients."""
    h, w, t = _inputs(9, 127, 48, ignore_every=0)
    for kw in (dict(positions=torch.zeros(0, dtype=torch.long)), dict(ignore_index=-7)):
        tt = torch.full_like(t, -7) if "ignore_index" in kw else t
        loss, ce, dh, dw = _run(lambda *a, **k: linear_cross_entropy(*a, backend=path, **k), h, w, tt, **kw)
        assert loss.item() == 0.0 and torch.all(ce == 0)
        assert torch.all(dh == 0) and torch.all(dw == 0)


def test_torch_path_backward_twice_is_a_clear_error():
    """The CPU path hands its forward-computed gradients over once (scaled in place)."""
    h, w, t = _inputs(9, 127, 48)
    loss = linear_cross_entropy(h, w, t, backend="torch") * 0.5
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_grad_only_for_h(path):
    """weight without requires_grad: its gradient is skipped, dH still right; outputs finite
    although every Triton buffer starts NaN-poisoned."""
    assert backend._POISON
    h, w, t = _inputs(37, 127, 48)
    w.requires_grad_(False)
    ref = _run(linear_cross_entropy_reference, h, w, t)
    out = _run(lambda *a, **k: linear_cross_entropy(*a, backend=path, **k), h, w, t)
    assert out[3] is None
    for x, r, what in zip(out[:3], ref[:3], ("loss", "per-token ce", "dH")):
        assert torch.isfinite(x).all()
        assert_rel(x, r, TOL, f"{path} {what}")


def test_torch_path_no_grad_skips_gradients(monkeypatch):
    """Under no_grad (evaluation) the CPU path computes the loss only: no dH/dW matmuls."""
    h, w, t = _inputs(37, 127, 48)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(1) or real_mm(*a, **k))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, backend="torch")
    assert len(calls) == 1  # the logits only
    assert_rel(loss, linear_cross_entropy_reference(h, w, t).detach(), TOL, "no-grad loss")
