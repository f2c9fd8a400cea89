"""The layers and the checks both models share: the short convolution, the rotary positions and
the window attention (:mod:`fractus.ops.window_attention`) against loops over positions, sampling,
and the experts' load balance."""
import pytest
import torch

from fractus.layers import ShortConv, Taps, load_balance, next_token
from fractus.ops.window_attention import rope_tables, rotate, window_attention
from util import assert_rel


def test_short_convolution_paths():
    """The convolution's fast path (its hand-written backward, gradchecked in fp64) equals the
    path with resets when no reset falls in the chunk, outputs, carried buffer and gradients."""
    torch.manual_seed(0)
    conv = ShortConv(12, 4).double()
    x = torch.randn(3, 9, 12, dtype=torch.float64, requires_grad=True)
    prev = torch.randn(3, 3, 12, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: Taps.apply(torch.cat([prev, x], 1), w), (x, conv.weight))
    fast, masked = conv(x, prev), conv(x, prev, torch.zeros(3, 9, dtype=torch.bool))
    for a, b in zip(fast, masked):
        assert_rel(a, b, 1e-12, "outputs and buffer")
    for a, b in zip(torch.autograd.grad(fast[0].sum(), (x, conv.weight)),
                    torch.autograd.grad(masked[0].sum(), (x, conv.weight))):
        assert_rel(a, b, 1e-12, "gradients")


def test_rope_scores_depend_on_relative_position_only():
    """Rotated q·k is a function of the distance between positions: shifting both by s keeps it."""
    torch.manual_seed(0)
    D = 16
    cos, sin = rope_tables(40, D, "cpu")
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def score(tq, tk):
        return float((rotate(q, cos[tq:tq + 1], sin[tq:tq + 1]) * rotate(k, cos[tk:tk + 1], sin[tk:tk + 1])).sum())
    assert abs(score(7, 3) - score(30, 26)) < 1e-5 and abs(score(7, 3) - score(7, 5)) > 1e-3


def test_window_attention_is_softmax_over_the_last_w_positions():
    """Each position's output is the softmax-weighted mean of the values of the last W positions
    (itself included), scored on RoPE-rotated q, k: a loop over positions in fp64, against the
    window read as one chunk and as chunks carrying the window's keys."""
    torch.manual_seed(0)
    B, T, H, D, W = 2, 23, 3, 8, 6
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64) for _ in range(3))
    cos, sin = rope_tables(T, D, "cpu", dtype=torch.float64)
    qr, kr = (rotate(t.transpose(1, 2), cos, sin) for t in (q, k))  # [B, H, T, D]
    ref = torch.empty_like(q)
    for t in range(T):
        lo = max(0, t - W + 1)
        p = (qr[:, :, t:t + 1] @ kr[:, :, lo:t + 1].transpose(-1, -2) / D ** 0.5).softmax(-1)
        ref[:, t] = (p @ v[:, lo:t + 1].transpose(1, 2)).squeeze(2)
    y, _ = window_attention(q, k, v, None, W)
    assert_rel(y, ref, 1e-12, "one chunk")
    y1, cache = window_attention(q[:, :4], k[:, :4], v[:, :4], None, W)
    y2, _ = window_attention(q[:, 4:], k[:, 4:], v[:, 4:], cache, W)
    assert_rel(torch.cat([y1, y2], 1), ref, 1e-6, "two chunks, the window's keys carried (fp32)")
    # resets: a position sees only the keys from the last reset at or before it
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[0, [2, 5, 13]] = resets[1, 20] = True
    for b in range(B):
        for t in range(T):
            lo = max([0, t - W + 1] + [r for r in range(t + 1) if resets[b, r]])
            p = (qr[b, :, t:t + 1] @ kr[b, :, lo:t + 1].transpose(-1, -2) / D ** 0.5).softmax(-1)
            ref[b, t] = (p @ v[b, lo:t + 1].transpose(0, 1)).squeeze(1)
    y, _ = window_attention(q, k, v, None, W, resets)
    assert_rel(y, ref, 1e-12, "one chunk with resets")
    for cut in (4, 5, 16):  # the second chunk starts before a reset, on one, and inside a segment
        y1, cache = window_attention(q[:, :cut], k[:, :cut], v[:, :cut], None, W, resets[:, :cut])
        y2, _ = window_attention(q[:, cut:], k[:, cut:], v[:, cut:], cache, W, resets[:, cut:])
        assert_rel(torch.cat([y1, y2], 1), ref, 1e-6, f"two chunks with resets, cut at {cut}")
    cache, ys = None, []  # decoding: one position at a time, the window's keys carried
    for t in range(T):
        y1, cache = window_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, W, resets[:, t:t + 1])
        ys.append(y1)
    assert_rel(torch.cat(ys, 1), ref, 1e-6, "one position at a time, with resets")


def test_sampling_filters():
    """top-k, top-p and the repetition penalty each change which tokens can be drawn; non-finite
    probabilities are refused (greedy still takes the largest logit)."""
    logits = torch.tensor([3.0, 2.9, 2.8, -1.0, 0.5])
    none = torch.zeros(5, dtype=torch.bool)

    def draws(logits=logits, **kw):
        kw = {"temperature": 1.0, "top_k": None, "top_p": None, "repetition_penalty": 1.0, "seen": none, **kw}
        gen = torch.Generator().manual_seed(0)
        return {next_token(logits, gen=gen, **kw) for _ in range(300)}
    assert draws() == {0, 1, 2, 3, 4}
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.5) == {0, 1}  # p ≈ (0.36, 0.33, 0.30, …): the smallest prefix reaching 0.5
    assert draws(top_k=1, temperature=5.0) == {0}
    seen = torch.tensor([True, False, False, True, False])
    assert draws(top_k=1, repetition_penalty=2.0, seen=seen) == {1}  # 3.0 / 2 < 2.9
    assert next_token(logits, 0.0, None, None, 100.0, seen, torch.Generator()) == 1  # greedy, penalised
    assert next_token(torch.tensor([-1.0, -1.5]), 0.0, None, None, 2.0, torch.tensor([True, False]),
                      torch.Generator()) == 1  # a negative logit is multiplied: -2.0 < -1.5
    for bad in (float("inf"), float("nan")):  # overflowed activations: a clear error, not torch's
        with pytest.raises(ValueError, match="not finite"):
            draws(logits=torch.tensor([0.0, bad, 1.0]))
    assert next_token(torch.tensor([0.0, float("inf"), 1.0]), 0.0, None, None, 1.0, none, torch.Generator()) == 1


def test_load_balance_closed_form():
    """lb = E·Σ_e (P_e − 1/E)²: 0 for uniform routing, E − 1 when every token picks one expert."""
    for E in (4, 7, 16):
        assert float(load_balance(torch.full((3, 5, E), 1 / E))) == pytest.approx(0, abs=1e-7)
        collapsed = torch.zeros(3, 5, E)
        collapsed[..., 2] = 1
        assert float(load_balance(collapsed)) == pytest.approx(E - 1, rel=1e-6)
        half = torch.zeros(2, E)
        half[0, 0] = half[1, 1] = 1  # P = (1/2, 1/2, 0, …)
        assert float(load_balance(half)) == pytest.approx(E * (2 * (0.5 - 1 / E) ** 2 + (E - 2) / E ** 2), rel=1e-6)
