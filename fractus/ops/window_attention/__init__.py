"""Causal softmax attention over a sliding window, its last keys and values carried between chunks.

The CTE's window level (:class:`fractus.layers.LinearAttention` with ``attn_window``): queries and
keys rotated by position (RoPE), each query against the ``window`` positions that end at it. One
PyTorch path on every device, no Triton kernel: the chunk is cut into blocks of queries, each read
by :func:`torch.nn.functional.scaled_dot_product_attention` against its own keys under a mask.
:func:`rope_tables` and :func:`rotate` are the rotary positions it uses, and the Transformer++'s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_tables(T: int, D: int, device, base: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] in ``dtype`` of the rotary angle t·base^(−2i/D) at positions t = 0 … T−1
    (computed in fp64)."""
    inv = base ** (-torch.arange(0, D, 2, device=device, dtype=torch.float64) / D)
    angle = torch.arange(T, device=device, dtype=torch.float64)[:, None] * inv
    return angle.cos().to(dtype), angle.sin().to(dtype)


_TABLES: dict = {}


def _window_tables(n: int, D: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_tables` of the ``n`` positions a decoded query and its window span, kept: the
    same for every token."""
    key = (n, D, str(device), dtype)
    if key not in _TABLES:
        _TABLES[key] = rope_tables(n, D, device, dtype=dtype)
    return _TABLES[key]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [.., T, D] with each pair (x_i, x_{i+D/2}) rotated by its position's angle (cos, sin [T, D/2]),
    computed in cos's dtype, returned in x's."""
    a, b = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


def window_attention(q, k, v, cache, window: int, resets: torch.Tensor | None = None):
    """Causal softmax attention over the last ``window`` positions, the earlier ones carried.

    q, k, v [B, T, H, D]; cache (keys, values [B, P, H, D] fp32, present [B, P]) of the P =
    window − 1 positions before the chunk, or None (a fresh state: none present); resets [B, T]
    bool or None (the window starts afresh before those positions). Position t sees the keys of
    t − window + 1 … t that are present and that no reset separates from t, rotated by position
    (RoPE, so scores depend on distances only). The chunk is read in blocks of Q = min(window, T) queries, each against its
    Q + P keys, so the scores cost T·(Q + P) rather than T·(T + P). Returns (y [B, T, H, D] in q's
    dtype, the new cache)."""
    B, T, H, D = q.shape
    P = window - 1
    if cache is None:
        cache = (k.new_zeros(B, P, H, D, dtype=torch.float32), k.new_zeros(B, P, H, D, dtype=torch.float32),
                 k.new_zeros(B, P, dtype=torch.float32))
    kc, vc, present = cache
    keys, values = torch.cat([kc.to(k.dtype), k], 1), torch.cat([vc.to(v.dtype), v], 1)  # [B, P + T, H, D]
    seen = torch.cat([present, present.new_ones(B, T)], 1) > 0  # [B, P + T]
    if T == 1:
        return _one_query(q, keys, values, seen, resets)
    Q = min(window, T)
    nb = -(-T // Q)
    pad = nb * Q - T  # padded queries at the end: each still sees real keys, and is dropped
    cos, sin = rope_tables(P + T + pad, D, q.device, dtype=torch.promote_types(q.dtype, torch.float32))
    qr = rotate(F.pad(q, (0, 0, 0, 0, 0, pad)).transpose(1, 2), cos[P:], sin[P:])  # [B, H, nb·Q, D]
    kr = rotate(F.pad(keys, (0, 0, 0, 0, 0, pad)).transpose(1, 2), cos, sin)  # [B, H, P + nb·Q, D]
    vr = F.pad(values, (0, 0, 0, 0, 0, pad)).transpose(1, 2)
    # block b: queries bQ … bQ + Q − 1 against keys bQ … bQ + Q + P − 1 (key index = position + P):
    # with several blocks (Q = window > P), the first P of key segment b, then the block's own Q
    kb, vb = (t[:, :, None] if nb == 1 else torch.cat([t[:, :, :nb * Q].view(B, H, nb, Q, D)[:, :, :, :P],
                                                      t[:, :, P:].view(B, H, nb, Q, D)], 3)
              for t in (kr, vr))  # [B, H, nb, Q + P, D]
    i = torch.arange(Q, device=q.device)[:, None]
    j = torch.arange(Q + P, device=q.device)[None, :]
    band = (j >= i) & (j <= i + P)  # [Q, Q + P]: query i sees itself and the P keys before it
    present_b = F.pad(seen, (0, pad)).unfold(1, Q + P, Q)  # [B, nb, Q + P] (no gradient)
    mask = band & present_b[:, None, :, None, :]  # [B, 1, nb, Q, Q + P]
    if resets is not None:  # segments between resets: a query sees the keys of its own segment
        seg = resets.long().cumsum(1)  # [B, T]; the cached keys are segment 0
        seg_k = F.pad(torch.cat([seg.new_zeros(B, P), seg], 1), (0, pad), value=-1).unfold(1, Q + P, Q)
        seg_q = torch.cat([seg, seg[:, -1:].expand(B, pad)], 1).view(B, nb, Q)  # padded: the last segment
        mask = mask & (seg_k[:, None, :, None, :] == seg_q[:, None, :, :, None])
        seen = seen & (torch.cat([seg.new_zeros(B, P), seg], 1) == seg[:, -1:])  # later queries: last segment
    mask = mask.expand(B, H, nb, Q, Q + P)
    y = F.scaled_dot_product_attention(qr.reshape(B, H * nb, Q, D), kb.reshape(B, H * nb, Q + P, D),
                                       vb.reshape(B, H * nb, Q + P, D), attn_mask=mask.reshape(B, H * nb, Q, Q + P))
    new = (keys[:, T:].float(), values[:, T:].float(), seen[:, T:].float())
    return y.reshape(B, H, nb * Q, D)[:, :, :T].transpose(1, 2), new


def _one_query(q, keys, values, seen, resets):
    """T = 1 (decoding): the query against the window's keys, as the blocked path reads it with
    one block, without its padding and masks."""
    B, W, H, D = keys.shape
    if resets is not None:  # a reset before the query: only its own key remains
        seen = seen & torch.cat([~resets.view(B, 1).expand(B, W - 1), resets.new_ones(B, 1)], 1)
    cos, sin = _window_tables(W, D, q.device, torch.promote_types(q.dtype, torch.float32))
    qr = rotate(q.transpose(1, 2), cos[W - 1:], sin[W - 1:])  # [B, H, 1, D]
    kr = rotate(keys.transpose(1, 2), cos, sin)  # [B, H, W, D]
    y = F.scaled_dot_product_attention(qr, kr, values.transpose(1, 2), attn_mask=seen[:, None, None, :])
    return y.transpose(1, 2), (keys[:, 1:].float(), values[:, 1:].float(), seen[:, 1:].float())
