"""Offsets past 2³¹ elements: every Triton kernel's integer arithmetic at sizes whose element offsets
leave int32, where a GPU wraps an int32 offset silently (a wrong address, read or written). The
interpreter runs each launch's last programs only (the largest offsets) in
:func:`fractus.verify.interpret.address_check`, which raises on int32 overflow; the buffers come
from ``torch.empty`` unpoisoned, so their untouched pages cost no memory (tens of GiB of address
space, well under 1 GiB resident). What is checked is that no launch raises, not the values: the
programs that did not run left the outputs unwritten."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

from fractus.ops import common as backend
from fractus.ops.cross_entropy import kernels as ce_kernels
from fractus.ops.cross_entropy import linear_cross_entropy
from fractus.ops.delta_rule import kernels as dr_kernels
from fractus.ops.kuramoto import kuramoto_phase
from fractus.ops.linear_attention import linear_attention
from fractus.ops.moe import moe
from fractus.ops.moe.kernels import Route, block_m
from fractus.verify import interpret
from util import make_experts

# the programs that did not run leave garbage (an uninitialised lse, say) that later ones compute on
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

PAST = 2 ** 31  # elements: the first offset int32 cannot hold


@pytest.fixture(autouse=True)
def _unpoisoned():
    """NaN-filling a buffer would touch every page of it."""
    with backend.poisoned(False):
        yield


def big(*shape, dtype=torch.float16, grad=False):
    """An untouched buffer (``torch.empty``: pages nobody writes stay unallocated), or a skip where
    this machine refuses so much address space in one allocation (Linux's overcommit heuristic
    refuses one larger than RAM + swap; the largest here is 16 GiB)."""
    try:
        x = torch.empty(*shape, dtype=dtype)
    except RuntimeError as e:
        pytest.skip(f"a lazily allocated {list(shape)} {dtype} buffer was refused: {e}")
    return x.requires_grad_(grad)


@triton.jit
def _fill_kernel(x_ptr, n, n_ptr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, 1.0, mask=offs < n)
    tl.store(n_ptr, tl.num_programs(0))


def test_the_check_raises_on_int32_offsets():
    """The same kernel with its block index int32 (it wraps past 2³¹) and int64; only the last
    programs run, and they see the full grid."""
    n = PAST + 100
    x, progs = big(n), torch.zeros(1, dtype=torch.int32)
    grid = (triton.cdiv(n, 1024),)
    small = torch.zeros(40 * 16)
    with interpret.address_check(last=8):
        with pytest.raises(InterpreterError, match=r"int32 '\*' overflows"):
            _fill_kernel[grid](x, n, progs, BLOCK=1024, WIDE=False)
        _fill_kernel[grid](x, n, progs, BLOCK=1024, WIDE=True)
        assert progs.item() == grid[0]
        assert x[(grid[0] - 8) * 1024:].eq(1).all()
        _fill_kernel[(40,)](small, small.numel(), progs, BLOCK=16, WIDE=False)
        with pytest.raises(RuntimeError, match="already on"):
            with interpret.address_check():
                pass
    assert small.view(40, 16).sum(1).tolist() == [0.0] * 32 + [16.0] * 8
    _fill_kernel[(40,)](small, small.numel(), progs, BLOCK=16, WIDE=False)  # outside: every program
    assert small.eq(1).all()


@triton.jit
def _cast_kernel(x_ptr, n):
    tl.store(x_ptr, (tl.program_id(0).to(tl.int64) * n).to(tl.int32))


def test_the_check_raises_on_narrowing_casts():
    out = torch.zeros(1, dtype=torch.int32)
    with interpret.address_check():
        _cast_kernel[(4,)](out, 1000)
        assert out.item() == 3000
        with pytest.raises(InterpreterError, match="int32 cast overflows"):
            _cast_kernel[(4,)](out, 2 ** 30)


@triton.jit
def _loop_kernel(x_ptr, n, STRIDE: tl.constexpr, WIDE: tl.constexpr):
    if WIDE:
        n = n.to(tl.int64)
    for i in range(n):
        tl.store(x_ptr + i * STRIDE, 1.0)


def test_the_check_types_loop_variables():
    """A loop variable is int32 on a GPU, int64 when a bound is: ``i * STRIDE`` past 2³¹ wraps
    there, where the interpreter's Python int does not. The kernel's module is left as it was."""
    x = big(PAST + 1)
    _loop_kernel[(1,)](x, 5, STRIDE=2 ** 29, WIDE=False)  # outside the check: a Python int, no wrap
    with interpret.address_check():
        _loop_kernel[(1,)](x, 4, STRIDE=2 ** 29, WIDE=False)
        with pytest.raises(InterpreterError, match=r"int32 '\*' overflows"):
            _loop_kernel[(1,)](x, 5, STRIDE=2 ** 29, WIDE=False)
        _loop_kernel[(1,)](x, 5, STRIDE=2 ** 29, WIDE=True)
    assert x[::2 ** 29].eq(1).all() and "range" not in globals()


@triton.jit
def _const_loop_kernel(x_ptr, START: tl.constexpr):
    for i in range(START, START + 2):
        tl.store(x_ptr + (i - START), 1.0)


def test_the_check_widens_loops_with_constant_bounds_past_int32():
    x = torch.zeros(2)
    with interpret.address_check():
        _const_loop_kernel[(1,)](x, START=2 ** 32)
    assert x.eq(1).all()


def test_the_check_installs_the_emulation_first(monkeypatch):
    """Its builder is restored on exit: were the emulation installed inside the block (the first
    Triton op on CPU tensors installs it), the exit would undo it for good."""
    calls = []
    monkeypatch.setattr(interpret, "install", lambda: calls.append(1))
    with interpret.address_check():
        assert calls == [1]


# (B, T, H, D): many sequences (b·T·H·D past 2³¹), or one long sequence (t·H·D past 2³¹ within it)
CHUNKED = {"many sequences": (PAST // (64 * 64) + 1, 64, 1, 64), "one sequence": (1, 128, PAST // (127 * 16) + 1, 16)}
DECODE = {"many sequences": (PAST // (16 * 16) + 1, 16, 1, 16), "one sequence": (1, 16, PAST // (15 * 16) + 1, 16)}


@pytest.mark.parametrize("shape", CHUNKED.values(), ids=CHUNKED.keys())
def test_linear_attention_chunked(shape):
    """q, k, v [B, T, H, D] and the per-level y past 2³¹ elements, and in the first case the chunk
    states [B, Lv, H, NC, D, D] too (forward chunks of 64, backward's of 32): forward and backward,
    with a state and a decay."""
    B, T, H, D = shape
    q, k, v = (big(B, T, H, D, grad=True) for _ in range(3))
    S0 = big(B, 1, H, D, D, dtype=torch.float32, grad=True)
    z0 = big(B, 1, H, D, dtype=torch.float32, grad=True)
    w = torch.ones(1, requires_grad=True)
    with interpret.address_check():
        o, (S, z) = linear_attention(q, k, v, w, [0.0], decay=torch.full((H,), 0.9), state=(S0, z0),
                                     backend="triton")
        torch.autograd.backward([o, S, z], [big(B, T, H, D), big(*S.shape, dtype=torch.float32),
                                            big(*z.shape, dtype=torch.float32)])
    assert q.grad.shape == q.shape and S0.grad.shape == S0.shape


@pytest.mark.parametrize("shape", DECODE.values(), ids=DECODE.keys())
def test_linear_attention_decode(shape):
    """The one-launch decode kernel (T ≤ 16, no autograd) with q and the state past 2³¹ elements."""
    B, T, H, D = shape
    q, k, v = (big(B, T, H, D) for _ in range(3))
    state = (big(B, 1, H, D, D, dtype=torch.float32), big(B, 1, H, D, dtype=torch.float32))
    with torch.no_grad(), interpret.address_check():
        o, (S, z) = linear_attention(q, k, v, torch.ones(1), [0.0], decay=torch.full((H,), 0.9), state=state,
                                     backend="triton")
    assert o.shape == q.shape and S.shape == state[0].shape


def test_delta_rule_chunked():
    """The gated delta rule's chunked kernels, called through their autograd Function on folded
    features [N, T, D] with N·T·D past 2³¹ (the PyTorch around them, feature maps and level sum,
    would touch every page): forward and backward with a state and resets; the per-chunk buffers
    (M [N, NC, BT, BT], twice that size here, and the chunk states) too. One head's positions run
    in one program's loop, so a single head past 2³¹ (t·D) is not checked here: it would take the
    interpreter 2²⁶ iterations."""
    N, T, D = PAST // (64 * 16) + 1, 64, 16
    fq, fk, v = (big(N, T, D, dtype=torch.float32, grad=True) for _ in range(3))
    beta, g = (big(N, T, dtype=torch.float32, grad=True) for _ in range(2))
    S0 = big(N, D, D, dtype=torch.float32, grad=True)
    with interpret.address_check():
        y, S = dr_kernels._TritonDeltaRule.apply(fq, fk, v.view(N, 1, T, D), beta, g, S0, big(N, T, dtype=torch.int32),
                                                 1, 1, "ieee", dr_kernels.CHUNK)
        torch.autograd.backward([y, S], [big(N, T, D, dtype=torch.float32), big(N, D, D, dtype=torch.float32)])
    assert fq.grad.shape == fq.shape and S0.grad.shape == S0.shape and g.grad.shape == g.shape


def test_delta_rule_decode():
    """The one-launch decode kernel (T ≤ 16, no autograd) with the features and the state past 2³¹."""
    N, T, D = PAST // (15 * 16) + 1, 16, 16
    fq, fk, v, y = (big(N, T, D, dtype=torch.float32) for _ in range(4))
    beta, g = (big(N, T, dtype=torch.float32) for _ in range(2))
    S0, S = big(N, D, D, dtype=torch.float32), big(N, D, D, dtype=torch.float32)
    with interpret.address_check():
        dr_kernels._dr_decode_kernel[(N,)](fq, fk, v, beta, g, g, S0, y, S, T, 1, 1, D, HAS_INIT=True, RESETS=False,
                                           BD=16)


def test_cross_entropy_every_row():
    """h [N, d] and the dH partials [splits, N, d] past 2³¹ elements: forward and dH (W frozen:
    a dW program walks every token, too many to interpret)."""
    N, d, V = PAST // 64 + 1, 64, 100
    h = big(N, d, dtype=torch.float32, grad=True)
    with interpret.address_check():
        loss = linear_cross_entropy(h, torch.randn(V, d), torch.zeros(N, dtype=torch.int64), backend="triton")
        loss.backward()
    assert h.grad.shape == h.shape


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cross_entropy_positions(dtype):
    """Scored positions at the end of an h past 2³¹ elements, given as int32 (row offsets from them
    would wrap) or int64: forward and dW (h frozen: its gradient would be a zero-filled [N, d])."""
    N, d, V = PAST // 64 + 1, 64, 100
    h = big(N, d, dtype=torch.float32)
    w = torch.randn(V, d, requires_grad=True)
    with interpret.address_check():
        loss = linear_cross_entropy(h, w, torch.zeros(N, dtype=torch.int64),
                                    positions=torch.arange(N - 40, N, dtype=dtype),
                                    backend="triton")
        loss.backward()
    assert w.grad.shape == w.shape


def test_cross_entropy_vocabulary(monkeypatch):
    """The tied embedding W [V, d] and dW past 2³¹ elements (a vocabulary of 33.5 M rows): forward,
    dH and dW, on the GPU's fp32 tiles split 8,192 ways across the vocabulary (with the interpreter's
    2 splits, or an H200's 264, a program walks 260,000 or 2,000 vocab tiles)."""
    monkeypatch.setattr(ce_kernels, "tile_config", lambda h, V: ce_kernels.gpu_config(h.dtype, sms=4096))
    N, d = 40, 64
    V = PAST // d + 1
    h, w = torch.randn(N, d, requires_grad=True), big(V, d, dtype=torch.float32, grad=True)
    with interpret.address_check():
        loss = linear_cross_entropy(h, w, torch.full((N,), V - 1), backend="triton")
        loss.backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


def _routes(rows: int, E: int):
    """([N, 1] expert ids, how many last programs to run): ``rows`` (a multiple of the routing
    tile) on expert 0, then one token on each other expert. The routing tiles end in two empty
    ones, so the last three tiles hold the last tokens; the last three experts hold one each (the
    first expert's programs, which walk every row, do not run)."""
    BM = block_m()
    assert rows % BM == 0 and E - 1 <= BM
    idx = torch.zeros(rows + E - 1, 1, dtype=torch.int64)
    idx[rows:, 0] = torch.arange(1, E)
    route = Route(idx, E, BM)
    used = int((route.tile_hi > route.tile_lo).nonzero().max())
    assert used == route.T - 3 and route.tile_e[used] == E - 1
    return idx, 3


def test_moe_lowrank():
    """x [N, d], the per-slot rows and gradients [N·K, d] and the saved rank-r activations [N·K, r]
    past 2³¹ elements: forward and backward."""
    d, E = 64, 8
    idx, last = _routes(PAST // d, E)
    N = idx.shape[0]
    ex = {k: t.half() for k, t in make_experts(E, d, 32, r=64).items()}
    x, w = big(N, d, grad=True), big(N, 1, grad=True)
    with interpret.address_check(last):
        y = moe(x, idx, w, ex, backend="triton")
        y.backward(big(N, d))
    assert x.grad.shape == x.shape


def test_moe_dense():
    """The hidden activation z [N·K, F] of dense experts past 2³¹ elements (x stays below: the
    grouped GEMM indexes x and z alike): forward and backward."""
    d, F, E = 16, 4096, 8
    idx, last = _routes(PAST // F, E)
    N = idx.shape[0]
    ex = {k: t.half() for k, t in make_experts(E, d, F, lowrank=False).items()}
    x, w = big(N, d, grad=True), torch.ones(N, 1, dtype=torch.float16, requires_grad=True)
    with interpret.address_check(last):
        y = moe(x, idx, w, ex, backend="triton")
        y.backward(big(N, d))
    assert x.grad.shape == x.shape


def test_kuramoto():
    """θ⁰ [M, N] past 2³¹ elements, θ at the step boundaries [steps + 1, M, N] twice that: forward
    and backward."""
    M, N = PAST // 16 + 1, 16
    theta0 = big(M, N, dtype=torch.float32, grad=True)
    omega, U, lam = torch.randn(N), torch.randn(N, 4), torch.rand(4)
    with interpret.address_check():
        psi = kuramoto_phase(theta0, omega, U, lam, 0.1, 1, 0.0, backend="triton")
        psi.backward(big(M, dtype=torch.float32))
    assert theta0.grad.shape == theta0.shape


def test_moe_refuses_routing_past_int32():
    """The routing's row offsets and tiles are int32: 2³¹ (token, slot) pairs are refused from the
    shape (the ids, 16 GiB of address space, are never read)."""
    with pytest.raises(ValueError, match="int32"):
        Route(big(2 ** 30, 2, dtype=torch.int64), 8, block_m())
