"""The Fractus CTE language model (the math: ``docs/model.md``).

A stack of pre-norm blocks, each: multi-level causal linear attention with a carried state
per (level, head) → a Kuramoto phase clock integrated per token → phase-routed top-k sparse
low-rank experts (beside a dense shared expert when ``shared_expert`` > 0, off by default). Tied head behind a
final LayerNorm. The only state that crosses positions is each block's attention state
(:data:`State`): (S, z) per (level, head) and, when the config has them, the short convolution's
last inputs and the window level's last keys and values with their presence; so ``forward`` over a
chunk and ``step`` token by token compute the same logits.

:class:`FractusConfig` holds the dimensions and the levers; :data:`RECIPE` is the default
architecture, :data:`ORIGINAL` the original one (presets ``original-<name>``).

Shapes: B rows (batch), T positions, d = d_model, H heads of D, Lv levels, E experts, K = top_k.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from fractus.ops.common import BACKENDS, first_order_only
from fractus.ops.cross_entropy import linear_cross_entropy
from fractus.ops.delta_rule import delta_rule
from fractus.ops.kuramoto import kuramoto_phase
from fractus.ops.linear_attention import linear_attention
from fractus.ops.moe import moe

PHI = (1 + 5 ** 0.5) / 2

# per block: (S [B, Lv, H, D, D], z [B, Lv, H, D]) fp32; with a short convolution its last
# short_conv − 1 inputs [B, short_conv − 1, 3d] fp32; with a window level its last P = attn_window − 1
# keys and values [B, P, H, D] fp32 and which of them exist yet [B, P] (1.0 or 0.0)
State = list[tuple[torch.Tensor, ...]]


@dataclass
class FractusConfig:
    vocab_size: int = 8192
    d_model: int = 128
    n_heads: int = 2
    n_layers: int = 2
    n_levels: int = 2
    # the levers (defaults: the recipe at palier0; ORIGINAL holds the original architecture's values)
    attn_decay: float | tuple[float, ...] | str = "multiscale"  # γ: one for all, per head, per (level, head), "multiscale"
    decay_gate: bool = True  # data-dependent decay: γ_t = γ^softplus(LN(h_t)·a + c) per (level, head)
    attn_norm: str = "denominator"  # "denominator" (f(q)ᵀz) or "rms" (per-head RMSNorm of the numerator)
    attn_update: str = "add"  # "add" (S += f(k)vᵀ) or "delta" (the gated delta rule, read with attn_norm "rms")
    attn_gate: bool = True  # swish output gate: o ← o ⊙ silu(LN(h)·W_g)
    short_conv: int = 4  # width of a causal depthwise convolution on q, k, v (0: none)
    qk_norm: bool = False  # RMS-normalise q and k per head before the feature map
    attn_window: int = 64  # > 0: one more level, softmax attention over the last attn_window positions (RoPE)
    eot_reset: bool = False  # an end-of-text token (id vocab_size − 1) starts the state afresh
    shared_expert: int = 0  # d_ff of a dense expert every token uses beside the routed ones (0: none)
    expert_init_std: float = 0.02  # std of W2 is this / √(2·n_layers); of a low-rank U2, / √(2·n_layers·r)
    n_experts: int = 4
    top_k: int = 2
    expert_d_ff: int = 128
    expert_rank: int = 32  # 0 = dense experts
    n_oscillators: int = 8
    coupling_rank: int = 4
    kuramoto_steps: int = 2
    kuramoto_dt: float = 0.1
    kuramoto_damping: float = 0.1
    detach_kuramoto: bool = False
    router: str = "phase"  # "phase" (von Mises gate on the Kuramoto angle) or "linear"
    gate_kappa: float = 4.0  # κ, initial value of the learned gate concentration
    gate_tau: float = 1.0  # τ
    lb_coef: float = 0.01
    tie_head: bool = True
    fused_ce: bool = True  # tied-head loss without forming [tokens, V] logits
    eps: float = 1e-6
    backend: str = "auto"  # kernels: auto | triton | torch | reference

    def __post_init__(self):
        """Check every field (one message per bad field) and normalise numbers to their field's type."""
        check_fields(self, _FIELD_CHECKS)
        if self.attn_decay == "multiscale":
            self.attn_decay = multiscale_decays(self.n_heads, self.n_levels)
        if isinstance(self.attn_decay, (list, tuple)):
            self.attn_decay = tuple(float(gam) for gam in self.attn_decay)
            if len(self.attn_decay) not in (self.n_heads, self.n_levels * self.n_heads):
                raise ValueError(f"attn_decay has {len(self.attn_decay)} values: give one per head ({self.n_heads}) "
                                 f"or one per (level, head) ({self.n_levels * self.n_heads}, level-major)")
        if self.attn_update == "delta" and self.attn_norm != "rms":
            raise ValueError("attn_update 'delta' keeps no denominator: it needs attn_norm 'rms'")
        if self.short_conv == 1:
            raise ValueError("short_conv must be 0 (none) or a width ≥ 2, got 1")
        if self.attn_window == 1:
            raise ValueError("attn_window must be 0 (none) or a window ≥ 2, got 1")
        if self.attn_window and self.d_model // self.n_heads % 2:
            raise ValueError(f"attn_window needs an even d_head for its rotary positions, got {self.d_model // self.n_heads}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def decays(self) -> tuple[float, ...]:
        """γ per head [H] (the same at every level) or per (level, head) [Lv·H], level-major."""
        gam = self.attn_decay
        return tuple(gam) if isinstance(gam, tuple) else (float(gam),) * self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "FractusConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls._from_dict({**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(d["attn_decay"], tuple):
            d["attn_decay"] = list(d["attn_decay"])
        return d

    @classmethod
    def from_saved(cls, d: dict) -> "FractusConfig":
        """The config a checkpoint saved as ``d``. Unlike ``FractusConfig(**d)``, whose missing
        fields take the default architecture's values, a lever ``d`` does not name takes the
        original architecture's (:data:`ORIGINAL`): a config without a lever's field has that
        lever off. Keys of :data:`TRAINING_KEYS` (training settings a
        saved config may name, not fields of the model) are ignored."""
        return cls._from_dict({k: v for k, v in d.items() if k not in TRAINING_KEYS})

    @classmethod
    def _from_dict(cls, d: dict) -> "FractusConfig":
        """``d`` over :data:`ORIGINAL`; ValueError naming the keys of ``d`` that are no field."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys {sorted(map(str, unknown))}; the fields are {sorted(known)}")
        return cls(**{**ORIGINAL, **d})


# Keys a checkpoint's saved config may name that are training settings, not the model's (the
# trainer records its own in the checkpoint's ``args``): FractusConfig.from_saved ignores them.
TRAINING_KEYS = ("chunk_len",)


def _finite(v, kind=numbers.Real) -> bool:
    return isinstance(v, kind) and not isinstance(v, bool) and math.isfinite(v)


def _decay(gam) -> bool:
    return _finite(gam) and 0 < gam <= 1


def _int_min(lo: int):
    return f"an integer ≥ {lo}", lambda v: _finite(v, numbers.Integral) and v >= lo


_POSITIVE = "a finite number > 0", lambda v: _finite(v) and v > 0
_NON_NEGATIVE = "a finite number ≥ 0", lambda v: _finite(v) and v >= 0
_BOOL = "true or false", lambda v: isinstance(v, bool)


def _one_of(*choices: str):
    return f"one of {choices}", lambda v: isinstance(v, str) and v in choices


def check_fields(cfg, checks: dict) -> None:
    """Check each field of the dataclass ``cfg`` named in ``checks`` (field → (what it must be,
    check)): one ValueError naming every bad field; numbers that pass become their field's type
    (1 → 1.0, numpy ints → int)."""
    errors = []
    for name, (rule, check) in checks.items():
        value = getattr(cfg, name)
        if not check(value):
            errors.append(f"{name} must be {rule}, got {value!r}")
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            kind = type(getattr(type(cfg), name))
            setattr(cfg, name, kind(value) if kind in (int, float) else float(value))
    if errors:
        raise ValueError("bad config: " + "; ".join(errors))


_FIELD_CHECKS = {  # field → (what it must be, check)
    "vocab_size": _int_min(1), "d_model": _int_min(1), "n_heads": _int_min(1), "n_layers": _int_min(1),
    "n_levels": _int_min(1),
    "attn_decay": ("a number in (0, 1], a list of one per head or per (level, head), or 'multiscale'",
                   lambda v: _decay(v) or v == "multiscale" or isinstance(v, (list, tuple)) and all(map(_decay, v))),
    "attn_norm": _one_of("denominator", "rms"), "attn_update": _one_of("add", "delta"), "decay_gate": _BOOL, "attn_gate": _BOOL,
    "short_conv": _int_min(0), "qk_norm": _BOOL,
    "eot_reset": _BOOL, "attn_window": _int_min(0),
    "shared_expert": _int_min(0), "expert_init_std": _POSITIVE,
    "n_experts": _int_min(1), "top_k": _int_min(1), "expert_d_ff": _int_min(1), "expert_rank": _int_min(0),
    "n_oscillators": _int_min(1), "coupling_rank": _int_min(1), "kuramoto_steps": _int_min(1),
    "kuramoto_dt": _POSITIVE, "kuramoto_damping": _NON_NEGATIVE, "detach_kuramoto": _BOOL,
    "router": _one_of("phase", "linear"), "gate_kappa": _POSITIVE, "gate_tau": _POSITIVE,
    "lb_coef": _NON_NEGATIVE, "tie_head": _BOOL, "fused_ce": _BOOL,
    "eps": _POSITIVE, "backend": _one_of(*BACKENDS),
}


# The levers as the original architecture has them: one state with no decay (γ = 1), read through
# the z-denominator, no output norm or gate, no convolution, no shared expert, a state that runs
# across documents. Presets "original-<name>" are these at <name>'s dimensions.
ORIGINAL = dict(attn_decay=1.0, decay_gate=False, attn_norm="denominator", attn_update="add", attn_gate=False,
                short_conv=0,
                qk_norm=False, attn_window=0, eot_reset=False, shared_expert=0, expert_init_std=0.02)
# The default: the levers the ablation keeps (notebooks/06_architecture.ipynb), the window level and
# the decay gate, the best measured against the Transformer++ (results/compare_cpu.csv).
RECIPE = {f.name: f.default for f in fields(FractusConfig) if f.name in ORIGINAL}

# The dimensions of each size ("palier": a rung of the growth ladder, each one grown from the last).
DIMS = {  # d_model, n_heads, n_layers, n_experts, expert_d_ff, expert_rank, n_oscillators, coupling_rank, vocab
    "tiny": (32, 2, 2, 4, 32, 8, 4, 2, 512),
    "palier0": (128, 2, 2, 4, 128, 32, 8, 4, 8192),
    "palier1": (256, 4, 4, 8, 256, 32, 8, 4, 8192),
    "palier2": (512, 8, 8, 16, 512, 64, 8, 4, 8192),
    "palier3": (768, 12, 12, 32, 768, 64, 8, 4, 8192),
    "1b": (1280, 20, 16, 128, 2048, 64, 16, 8, 50257),
}


def _dims(d, h, layers, e, f, r, n_osc, k_rank, vocab):
    return dict(d_model=d, n_heads=h, n_layers=layers, n_experts=e, expert_d_ff=f, expert_rank=r,
                n_oscillators=n_osc, coupling_rank=k_rank, vocab_size=vocab, n_levels=2, top_k=2)


PRESETS = {**{name: {**_dims(*dims), **RECIPE} for name, dims in DIMS.items()},
           **{f"original-{name}": {**_dims(*dims), **ORIGINAL} for name, dims in DIMS.items()}}


MULTISCALE = (4.0, 2.0, 12.0)  # −log2(1 − γ): first, step, cap (see multiscale_decays)


def multiscale_decays(n_heads: int, n_levels: int) -> tuple[float, ...]:
    """γ per (level, head), level-major [Lv·H]: 1 − 2^−min(m₀ + s·i, m_max) with i = h·Lv + l,
    (m₀, s, m_max) = MULTISCALE, so the memory 1/(1 − γ) of the (level, head) pairs runs from 2^m₀
    tokens up by factors of 2^s to at most 2^m_max. Indexed head-major, so adding heads keeps every existing head's values."""
    m0, s, m_max = MULTISCALE
    return tuple(1 - 2 ** -min(m0 + s * (h * n_levels + l), m_max) for l in range(n_levels) for h in range(n_heads))


def level_omegas(n_levels: int) -> list[float]:
    """Feature-map offsets ω_l = φ^(−2l)."""
    return [PHI ** (-2 * l) for l in range(n_levels)]


def farey_phases(n_experts: int) -> torch.Tensor:
    """[E] expert phases 2π·a/b: E fractions picked evenly from the Farey sequence F_{2E} on [0, 1)."""
    return torch.tensor(_farey_angles(n_experts))


@lru_cache(maxsize=None)
def _farey_angles(n_experts: int) -> tuple[float, ...]:
    n = 2 * n_experts
    seq = sorted({Fraction(a, b) for b in range(1, n + 1) for a in range(0, b)})
    return tuple(2 * math.pi * float(seq[(i * len(seq)) // n_experts]) for i in range(n_experts))


class ShortConv(nn.Module):
    """Causal depthwise convolution over time, width W, whose last W − 1 inputs are carried.

    y_t = Σ_j w_j ⊙ x_{t−j} (j = 0 … W − 1); the inputs before the chunk come from the carried
    buffer (zeros for a fresh state), so a chunk and its positions one by one give the same
    outputs. With resets, x_{t−j} counts only if no reset lies in (t − j, t]."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.empty(width, channels))  # weight[j] multiplies x_{t−j}
        nn.init.uniform_(self.weight, -1 / math.sqrt(width), 1 / math.sqrt(width))  # nn.Conv1d's default

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None, resets: torch.Tensor | None = None):
        """x [B, T, C], prev [B, W − 1, C] fp32 or None, resets [B, T] bool or None →
        (y [B, T, C], new buffer [B, W − 1, C] fp32)."""
        B, T, C = x.shape
        W = self.width
        if prev is None:
            prev = x.new_zeros(B, W - 1, C, dtype=torch.float32)
        xp = torch.cat([prev.to(x.dtype), x], 1)  # [B, W − 1 + T, C]
        w = self.weight.to(x.dtype)
        if resets is None:
            return _Taps.apply(xp, w), xp[:, T:].float()
        seen = resets.cumsum(1)  # resets up to t [B, T]
        y = x * w[0]
        for j in range(1, W):  # x_{t−j} counts if no reset in (t − j, t]: seen_t = seen_{t−j} (none before the chunk)
            before = F.pad(seen, (j, 0))[:, :T]
            y = y + xp[:, W - 1 - j:W - 1 - j + T] * w[j] * (seen == before).unsqueeze(-1).to(x.dtype)
        after = seen[:, -1:] - F.pad(seen, (W - 1, 0))[:, T:]  # resets after each buffered input: those
        buf = xp[:, T:] * (after == 0).unsqueeze(-1).to(x.dtype)  # before the chunk's last one leave as zeros
        return y, buf.float()


def rope_tables(T: int, D: int, device, base: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] in ``dtype`` of the rotary angle t·base^(−2i/D) at positions t = 0 … T−1
    (computed in fp64)."""
    inv = base ** (-torch.arange(0, D, 2, device=device, dtype=torch.float64) / D)
    angle = torch.arange(T, device=device, dtype=torch.float64)[:, None] * inv
    return angle.cos().to(dtype), angle.sin().to(dtype)


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


class _Taps(torch.autograd.Function):
    """y_t = Σ_j w_j ⊙ xp_{t+W−1−j} (xp [B, W − 1 + T, C], w [W, C] → y [B, T, C]); the backward
    adds each tap's gradient into one buffer instead of a zero-filled tensor per slice."""

    @staticmethod
    def forward(ctx, xp, w):
        W, T = w.shape[0], xp.shape[1] - w.shape[0] + 1
        y = xp[:, W - 1:] * w[0]
        for j in range(1, W):
            y.addcmul_(xp[:, W - 1 - j:W - 1 - j + T], w[j])
        ctx.save_for_backward(xp, w)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        xp, w = ctx.saved_tensors
        W, T = w.shape[0], dy.shape[1]
        dxp = torch.empty_like(xp)
        dxp[:, :W - 1].zero_()
        torch.mul(dy, w[0], out=dxp[:, W - 1:])
        dw = torch.empty_like(w)
        for j in range(W):
            tap = slice(W - 1 - j, W - 1 - j + T)
            if j:
                dxp[:, tap].addcmul_(dy, w[j])
            dw[j] = (xp[:, tap] * dy).sum((0, 1))
        return dxp, dw


class LinearAttention(nn.Module):
    """Multi-level causal linear attention; carries (S, z) per (level, head) and, when the config
    has them, the short convolution's last inputs and the window level's last keys and values.

    q, k, v = LN(h)·W + b in H heads of D (through a short causal convolution when
    ``short_conv``; RMS-normalised per head when ``qk_norm``). Level l, feature map
    f_l(u) = elu(u + ω_l) + 1: S_t = γ_{l,h}·S_{t−1} + f_l(k_t) v_tᵀ, z_t = γ_{l,h}·z_{t−1} + f_l(k_t)
    (inclusive of t; with ``decay_gate`` the decay is the token's own, γ_{t,l,h} = γ_{l,h}^Δ,
    Δ = softplus(LN(h_t)·a_{l,h} + c_{l,h}), a = 0 and Δ = 1 at initialisation);
    y_l = f_l(q_t)ᵀ S_t / (f_l(q_t)ᵀ z_t + ε) with ``attn_norm="denominator"``,
    y_l = f_l(q_t)ᵀ S_t with "rms"; with ``attn_update="delta"`` the state follows the gated delta
    rule instead (β = σ(LN(h)·W_β + b_β) per (level, head), :mod:`fractus.ops.delta_rule`) and
    z stays 0; o = Σ_l softmax(level_logits)_l·y_l, then for "rms" a per-head
    RMSNorm over D, for ``attn_gate`` ⊙ silu(LN(h)·W_g), then W_o, b_o. With ``attn_window`` = W,
    one more level reads the same q, k, v by softmax attention over the last W positions
    (:func:`window_attention`), its weight the softmax of ``window_logit`` beside ``level_logits``.
    S [B, Lv, H, D, D] and z [B, Lv, H, D] stay fp32 (:mod:`fractus.ops.linear_attention`).
    """

    def __init__(self, cfg: FractusConfig):
        super().__init__()
        self.cfg = cfg
        d, H, Lv = cfg.d_model, cfg.n_heads, cfg.n_levels
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, (4 if cfg.attn_gate else 3) * d)  # q, k, v and the gate's W_g, b_g: one matmul
        self.conv = ShortConv(3 * d, cfg.short_conv) if cfg.short_conv else None
        self.rms_scale = nn.Parameter(torch.ones(H, cfg.d_head)) if cfg.attn_norm == "rms" else None
        self.decay_proj = None
        if cfg.decay_gate:  # starts as the fixed decay: a = 0, softplus(c) = 1
            self.decay_proj = nn.Linear(d, Lv * H)
            nn.init.zeros_(self.decay_proj.weight)
            nn.init.constant_(self.decay_proj.bias, math.log(math.e - 1))
        self.beta_proj = None
        if cfg.attn_update == "delta":  # write strengths β = σ(LN(h)·W_β + b_β), ½ at initialisation
            self.beta_proj = nn.Linear(d, Lv * H)
            nn.init.zeros_(self.beta_proj.weight)
            nn.init.zeros_(self.beta_proj.bias)
        self.out = nn.Linear(d, d)
        self.level_logits = nn.Parameter(torch.zeros(Lv))
        self.window_logit = nn.Parameter(torch.zeros(1)) if cfg.attn_window else None
        gam = torch.tensor(cfg.decays)
        self.register_buffer("decay", gam.view(Lv, H) if gam.numel() == Lv * H else gam, persistent=False)
        self.omegas = level_omegas(Lv)

    def forward(self, h: torch.Tensor, state, resets: torch.Tensor | None = None):
        """h [B, T, d], state or None, resets [B, T] bool or None (the state starts afresh before
        those positions) → (residual update [B, T, d], new state of the same form).

        The state is a tuple, all fp32: S [B, Lv, H, D, D] and z [B, Lv, H, D]; then, when
        ``short_conv`` > 0, the convolution's last inputs [B, short_conv − 1, 3d]; then, when
        ``attn_window`` > 0, the window's last keys and values [B, P, H, D] (P = attn_window − 1)
        and which of them exist yet [B, P] (1.0 or 0.0)."""
        B, T, d = h.shape
        H, D = self.cfg.n_heads, self.cfg.d_head
        x = self.ln(h)
        qkv = self.qkv(x)
        gate = None
        if self.cfg.attn_gate:
            qkv, gate = qkv[..., :3 * d], qkv[..., 3 * d:]
        attn_state = None if state is None else state[:2]
        conv_state, window_state = (), ()
        if self.conv is not None:
            qkv, buf = self.conv(qkv, None if state is None else state[2], resets)
            conv_state = (buf,)
        q, k, v = qkv.view(B, T, 3, H, D).unbind(2)
        if self.cfg.qk_norm:
            q, k = F.rms_norm(q, (D,)), F.rms_norm(k, (D,))
        decay = None if all(gam == 1 for gam in self.cfg.decays) else self.decay  # from the config: no sync
        if self.decay_proj is not None:  # [B, T, Lv, H], fp32
            delta = F.softplus(self.decay_proj(x).float()).view(B, T, self.cfg.n_levels, H)
            decay = torch.exp(delta * torch.log(self.decay.expand(self.cfg.n_levels, H)))
        logits = self.level_logits if self.window_logit is None else torch.cat([self.level_logits, self.window_logit])
        weights = logits.softmax(0)
        if self.beta_proj is None:
            o, new_state = linear_attention(q, k, v, weights[:self.cfg.n_levels], self.omegas,
                                            decay=decay, state=attn_state, eps=self.cfg.eps,
                                            backend=self.cfg.backend, normalize=self.rms_scale is None, resets=resets)
        else:  # z stays zero: the state keeps its form
            beta = torch.sigmoid(self.beta_proj(x).float()).view(B, T, self.cfg.n_levels, H)
            o, S = delta_rule(q, k, v, weights[:self.cfg.n_levels], self.omegas, beta, decay=decay,
                              state=None if attn_state is None else attn_state[0], resets=resets,
                              backend=self.cfg.backend)
            new_state = (S, torch.zeros(S.shape[:-1], dtype=S.dtype, device=S.device))
        if self.window_logit is not None:
            y, window_state = window_attention(q, k, v, None if state is None else state[-3:], self.cfg.attn_window,
                                               resets)
            o = o + weights[-1].to(o.dtype) * y.to(o.dtype)
        if self.rms_scale is not None:
            o = F.rms_norm(o, (D,), eps=self.cfg.eps) * self.rms_scale.to(o.dtype)
        o = o.reshape(B, T, d)
        if gate is not None:
            o = o * F.silu(gate)
        return self.out(o), (*new_state, *conv_state, *window_state)


class KuramotoClock(nn.Module):
    """Per-token Kuramoto phase clock: u [.., d] → routing angle ψ [..]."""

    def __init__(self, cfg: FractusConfig):
        super().__init__()
        self.cfg = cfg
        N = cfg.n_oscillators
        self.ln = nn.LayerNorm(cfg.d_model)
        self.encoder = nn.Linear(cfg.d_model, N)  # W_θ, b_θ
        self.omega = nn.Parameter(0.1 * torch.randn(N))  # natural frequencies ω_i
        self.U = nn.Parameter(torch.randn(N, cfg.coupling_rank) / math.sqrt(N))
        self.lam = nn.Parameter(torch.full((cfg.coupling_rank,), 0.5))
        self.register_buffer("offsets", 2 * math.pi * torch.arange(N) / N, persistent=False)
        if cfg.detach_kuramoto:  # no gradient reaches a detached clock: frozen, so DDP and optimizers skip it
            self.requires_grad_(False)

    def integrate(self, u: torch.Tensor) -> torch.Tensor:
        """u [.., d] → ψ [..]: θ⁰ = u·W_θ + b_θ + 2πn/N, RK4 steps of dθ/dt = ω − damping·θ +
        Σ_j K_ij sin(θ_j − θ_i) with K = U diag(λ) Uᵀ, then ψ = atan2(Σ sin θ, Σ cos θ)
        (:mod:`fractus.ops.kuramoto`)."""
        theta = self.encoder(u) + self.offsets
        c = self.cfg
        psi = kuramoto_phase(theta.reshape(-1, theta.shape[-1]), self.omega, self.U, self.lam,
                             c.kuramoto_dt, c.kuramoto_steps, c.kuramoto_damping, backend=c.backend)
        return psi.view(theta.shape[:-1])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, d] → ψ [B, T], always in fp32 (phases are too fine for bf16)."""
        with torch.autocast(h.device.type, enabled=False), torch.set_grad_enabled(
                torch.is_grad_enabled() and not self.cfg.detach_kuramoto):
            return self.integrate(self.ln(h.float()))


class PhaseRoutedMoE(nn.Module):
    """Top-k experts chosen per token by a von Mises gate on ψ (or a linear router).

    p = softmax(gate_logits), its top-K renormalised to weights w; out = Σ_k w_k·f_{e_k}(m),
    m = LN(h), with f_e(m) = s2_e·(gelu(s1_e·(m V1_e) U1_eᵀ + b1_e) V2_e) U2_eᵀ + b2_e (rank r),
    or gelu(m W1_e + b1_e) W2_e + b2_e when expert_rank = 0 (:mod:`fractus.ops.moe`).
    """

    def __init__(self, cfg: FractusConfig):
        super().__init__()
        self.cfg = cfg
        E, d, Fd, r = cfg.n_experts, cfg.d_model, cfg.expert_d_ff, cfg.expert_rank
        self.ln = nn.LayerNorm(d)
        out_std = cfg.expert_init_std / math.sqrt(2 * cfg.n_layers)
        if cfg.router == "phase":
            self.register_buffer("phases", farey_phases(E))
            self.log_kappa = nn.Parameter(torch.tensor(math.log(cfg.gate_kappa)))
        else:
            self.router = nn.Linear(d, E, bias=False)
        self.gate_bias = nn.Parameter(torch.zeros(E))  # b_e: 0, very negative for experts added by growth
        if r > 0:
            self.V1 = nn.Parameter(torch.randn(E, d, r) / math.sqrt(d))
            self.U1 = nn.Parameter(torch.randn(E, Fd, r) / math.sqrt(r))
            self.s1 = nn.Parameter(torch.ones(E))
            self.V2 = nn.Parameter(torch.randn(E, Fd, r) / math.sqrt(Fd))
            self.U2 = nn.Parameter(torch.randn(E, d, r) * out_std / math.sqrt(r))
            self.s2 = nn.Parameter(torch.ones(E))
        else:
            self.W1 = nn.Parameter(torch.randn(E, d, Fd) / math.sqrt(d))
            self.W2 = nn.Parameter(torch.randn(E, Fd, d) * out_std)
        self.b1 = nn.Parameter(torch.zeros(E, Fd))
        self.b2 = nn.Parameter(torch.zeros(E, d))
        self.shared = None
        if cfg.shared_expert:
            self.shared = nn.Sequential(nn.Linear(d, cfg.shared_expert), nn.GELU(), nn.Linear(cfg.shared_expert, d))
            nn.init.normal_(self.shared[2].weight, std=out_std)
            nn.init.zeros_(self.shared[2].bias)

    def experts(self) -> dict[str, torch.Tensor]:
        names = ("V1", "U1", "b1", "s1", "V2", "U2", "b2", "s2") if self.cfg.expert_rank > 0 \
            else ("W1", "b1", "W2", "b2")
        return {n: getattr(self, n) for n in names}

    def gate_logits(self, m: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
        """[.., E]: (κ/τ)·cos(ψ − φ_e) + b_e, or m·W_r + b_e for the linear router."""
        if self.cfg.router == "linear":
            return self.router(m) + self.gate_bias
        phase = self.log_kappa.exp() / self.cfg.gate_tau * torch.cos(psi.unsqueeze(-1) - self.phases)
        return phase + self.gate_bias

    def forward(self, h: torch.Tensor, psi: torch.Tensor | None):
        """h [B, T, d], ψ [B, T] (None for the linear router) → (update [B, T, d], probs [B, T, E],
        expert ids [B, T, K])."""
        B, T, d = h.shape
        m = self.ln(h)
        p = self.gate_logits(m, psi).float().softmax(-1)
        top_p, idx = p.topk(self.cfg.top_k, dim=-1)
        w = top_p / top_p.sum(-1, keepdim=True)
        m = autocast_input(m)  # the experts stay fp32: the kernels cast the tiles they load
        out = moe(m.reshape(B * T, d), idx.reshape(B * T, -1), w.reshape(B * T, -1).to(m.dtype),
                  self.experts(), backend=self.cfg.backend).view(B, T, d)
        if self.shared is not None:
            out = out + self.shared(m)
        return out, p, idx


def autocast_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the autocast dtype when autocast is on for its device (custom kernels are not
    autocast-aware; LayerNorm outputs stay fp32 under autocast), else ``t`` unchanged."""
    if torch.is_autocast_enabled(t.device.type):
        return t.to(torch.get_autocast_dtype(t.device.type))
    return t


def load_balance(p: torch.Tensor) -> torch.Tensor:
    """lb = E·Σ_e (P_e − 1/E)², P_e = mean of p_e [.., E] over the tokens."""
    E = p.shape[-1]
    P = p.reshape(-1, E).mean(0)
    return E * ((P - 1 / E) ** 2).sum()


class Block(nn.Module):
    def __init__(self, cfg: FractusConfig):
        super().__init__()
        self.attn = LinearAttention(cfg)
        self.clock = KuramotoClock(cfg) if cfg.router == "phase" else None  # the linear router reads m
        self.moe = PhaseRoutedMoE(cfg)

    def forward(self, h, state, resets=None):
        with record_function("attention"):
            a, state = self.attn(h, state, resets)
            h = h + a
        psi = None
        if self.clock is not None:
            with record_function("kuramoto"):
                psi = self.clock(h)
        with record_function("moe"):
            out, p, idx = self.moe(h, psi)
        return h + out, state, p, idx


class FractusCTE(nn.Module):
    def __init__(self, cfg: FractusConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = None if cfg.tie_head else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if self.head is not None:
            nn.init.normal_(self.head.weight, std=0.02)

    # -- state --------------------------------------------------------------------------
    def init_state(self, batch_size: int, device=None) -> State:
        """The zero state of every block (:data:`State`): S, z, and the short convolution's buffer
        and the window's keys, values and presence when the config has them, all fp32."""
        c = self.cfg
        device = device or self.embed.weight.device
        conv = (torch.zeros(batch_size, c.short_conv - 1, 3 * c.d_model, device=device),) if c.short_conv else ()
        P = c.attn_window - 1
        window = ((torch.zeros(batch_size, P, c.n_heads, c.d_head, device=device),) * 2
                  + (torch.zeros(batch_size, P, device=device),)) if c.attn_window else ()
        return [(torch.zeros(batch_size, c.n_levels, c.n_heads, c.d_head, c.d_head, device=device),
                 torch.zeros(batch_size, c.n_levels, c.n_heads, c.d_head, device=device), *conv, *window)
                for _ in range(c.n_layers)]

    @staticmethod
    def detach_state(state: State | None, device=None) -> State | None:
        """The state without its graph (and on ``device`` when given)."""
        return None if state is None else [tuple(t.detach().to(device) for t in block) for block in state]

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def num_params(self, active: bool = False, embedding: bool = True) -> int:
        """All parameters, or those one token uses (top_k of n_experts experts per block)."""
        n = sum(p.numel() for p in self.parameters())
        if active:
            per_expert = sum(p[0].numel() for p in self.blocks[0].moe.experts().values())
            n -= self.cfg.n_layers * (self.cfg.n_experts - self.cfg.top_k) * per_expert
        if not embedding:
            n -= self.embed.weight.numel()
        return n

    # -- forward ------------------------------------------------------------------------
    def check_tokens(self, idx: torch.Tensor) -> None:
        """Raise ValueError unless idx is a [B, T] int64 (or int32) tensor of ids in [0, vocab_size)."""
        check_token_ids(idx, self.cfg.vocab_size)

    def check_state(self, state: State, batch_size: int) -> None:
        """Raise ValueError unless ``state`` is a state of this model for ``batch_size`` rows: one
        tuple per block of (S, z), then the short convolution's buffer when ``short_conv`` > 0, then
        the window's keys, values and presence when ``attn_window`` > 0 (:data:`State`), each a
        tensor [B, …] with B = ``batch_size``."""
        if not isinstance(state, (list, tuple)) or len(state) != len(self.blocks):
            n = len(state) if isinstance(state, (list, tuple)) else type(state).__name__
            raise ValueError(f"state holds {n} blocks' state, the model has {len(self.blocks)} blocks")
        names = ["S", "z"] + ["convolution buffer"] * bool(self.cfg.short_conv) \
            + ["window keys", "window values", "window presence"] * bool(self.cfg.attn_window)
        parts, what = len(names), f"({', '.join(names)})"
        for i, s in enumerate(state):
            if not isinstance(s, (list, tuple)) or len(s) != parts or not all(isinstance(t, torch.Tensor) for t in s):
                raise ValueError(f"block {i}'s state must be {what} tensors: this model's state (init_state, or "
                                 f"what forward or step returned)")
            if any(t.dim() == 0 or t.shape[0] != batch_size for t in s):
                raise ValueError(f"the state was made for {s[0].shape[0] if s[0].dim() else 0} stream(s), the "
                                 f"input has {batch_size}: carry a state of the same batch size, or start "
                                 f"afresh with state=None")

    def run_blocks(self, x: torch.Tensor, state: State | None, resets: torch.Tensor | None = None):
        """x [B, T, d], resets [B, T] bool or None → (final normed hidden [B, T, d], new state, lb total,
        routing)."""
        if state is not None:
            self.check_state(state, x.shape[0])
        new_state, lb, routing = [], x.new_zeros((), dtype=torch.float32), []
        h = x
        for i, block in enumerate(self.blocks):
            h, s, p, idx = block(h, None if state is None else state[i], resets)
            new_state.append(s)
            lb = lb + load_balance(p)
            routing.append((idx.detach(), p.detach()))
        return self.ln_f(h), new_state, lb, routing

    def forward(self, idx: torch.Tensor, state: State | None = None, targets: torch.Tensor | None = None,
                head_positions: str = "all"):
        """idx [B, T] → (logits [B, T, V] or None when targets are given, parts, new state).

        parts: ``loss`` = ce + lb_coef·lb (None without targets), ``ce`` (nats/token, mean over
        supervised positions), ``lb`` (sum over blocks), ``n`` (supervised positions, a 0-dim
        tensor: reading it waits for the device),
        ``routing`` [(expert ids [B, T, K], probs [B, T, E]) per block]. With targets the
        fused tied-head cross-entropy runs and logits are not formed. ``head_positions="last"``
        supervises only the chunk's last position (the original's head-partial). With ``eot_reset``
        the state starts afresh at every end-of-text token (id vocab_size − 1), which the prepared
        data appends after each document.
        """
        self.check_tokens(idx)
        with record_function("embedding"):
            x = self.embed(idx)
        resets = None
        if self.cfg.eot_reset:
            resets = idx == self.cfg.vocab_size - 1
        return self.forward_embeds(x, state, targets, head_positions, resets)

    def forward_embeds(self, x, state=None, targets=None, head_positions="all", resets=None):
        """As :meth:`forward` from input vectors x [B, T, d] instead of token ids; resets [B, T] bool
        or None: the state starts afresh before those positions."""
        if x.shape[0] == 0:  # no streams: empty logits, the empty state carried on
            if targets is not None:
                raise ValueError("the batch is empty (0 streams): there is no position to score")
            parts = {"lb": x.new_zeros((), dtype=torch.float32), "routing": [], "loss": None, "ce": None, "n": 0}
            logits = x.new_zeros(0, x.shape[1], self.cfg.vocab_size)
            return logits, parts, state if state is not None else self.init_state(0, x.device)
        h, new_state, lb, routing = self.run_blocks(x, state, resets)
        with record_function("head_loss"):
            return self._head(h, new_state, lb, routing, targets, head_positions)

    def _head(self, h, new_state, lb, routing, targets, head_positions):
        parts = {"lb": lb, "routing": routing, "loss": None, "ce": None, "n": 0}
        if targets is None:
            return self.logits(h), parts, new_state
        B, T, d = h.shape
        if targets.shape != (B, T):
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {(B, T)}")
        positions = None
        if head_positions == "last":
            positions = torch.arange(T - 1, B * T, T, device=h.device)
        elif head_positions != "all":
            raise ValueError(f"head_positions must be 'all' or 'last', got {head_positions!r}")
        h, targets = h.reshape(B * T, d), targets.reshape(-1)
        scored = targets if positions is None else targets[positions]
        if self.cfg.fused_ce:
            ce = linear_cross_entropy(autocast_input(h), self.head_weight(), targets, positions=positions,
                                      backend=self.cfg.backend)
        else:
            ce = F.cross_entropy(self.logits(h if positions is None else h[positions]).float(), scored)
        parts.update(ce=ce, loss=ce + self.cfg.lb_coef * lb, n=(scored != -100).sum())
        return None, parts, new_state

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head_weight())

    @torch.no_grad()
    def step(self, token: torch.Tensor, state: State | None):
        """One position: token [B] → (logits [B, V], new state)."""
        logits, _, state = self.forward(token.view(-1, 1), state)
        return logits[:, 0], state

    @torch.no_grad()
    def tick_vec(self, vec: torch.Tensor, state: State | None):
        """One position whose input is a d-vector (an image patch, a 'thinking' tick):
        vec [B, d] → (logits [B, V], new state)."""
        if vec.dim() != 2 or vec.shape[-1] != self.cfg.d_model or not vec.is_floating_point():
            raise ValueError(f"tick_vec expects a floating [B, {self.cfg.d_model}] tensor, "
                             f"got shape {tuple(vec.shape)} {vec.dtype}")
        vec = vec.to(self.embed.weight.dtype)  # it stands where an embedding row would
        logits, _, state = self.forward_embeds(vec[:, None], state)
        return logits[:, 0], state

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 repetition_penalty: float = 1.0, seed: int | None = None) -> list[int]:
        """Prefill one prompt with the chunked forward, then sample tick by tick.

        prompt_ids: one sequence of token ids, a list or a [T] tensor (no batch). temperature ≥ 0,
        0 is greedy. repetition_penalty > 1 divides positive (multiplies negative) logits of tokens
        already in the context. Returns the max_new_tokens new ids as a list[int].
        """
        ids = prompt_tensor(prompt_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                            self.cfg.vocab_size, self.embed.weight.device)
        gen = torch.Generator(device=ids.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()  # seed None: fresh, global RNG untouched
        was_training = self.training
        self.eval()
        logits, _, state = self.forward(ids.view(1, -1))
        logits = logits[0, -1]
        seen = torch.zeros(self.cfg.vocab_size, dtype=torch.bool, device=ids.device)
        seen[ids] = True
        out = []
        for _ in range(max_new_tokens):
            nxt = next_token(logits.float(), temperature, top_k, top_p, repetition_penalty, seen, gen)
            out.append(nxt)
            seen[nxt] = True
            logits, state = self.step(torch.tensor([nxt], device=ids.device), state)
            logits = logits[0]
        self.train(was_training)
        return out

    # -- checkpoints --------------------------------------------------------------------
    def save(self, path, **extra) -> None:
        """Write config + weights (+ ``extra`` entries) atomically; see :mod:`fractus.checkpoint`."""
        from fractus.checkpoint import save_checkpoint
        save_checkpoint(path, {"arch": "cte", "config": self.cfg.to_dict(), "model": self.state_dict(), **extra})

    @classmethod
    def load(cls, path, backend: str | None = None) -> "FractusCTE":
        """The model of a Fractus CTE checkpoint, on the CPU (``.to(device)`` moves it); ``backend``
        replaces the kernels' backend it was saved with (a run setting, e.g. 'triton' from a GPU).
        :func:`fractus.training.registry.load_model` reads any model's checkpoint."""
        from fractus.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
        ckpt = load_checkpoint(path)
        if ckpt.get("arch", "cte") != "cte":
            raise CheckpointError(f"{path} holds a {ckpt['arch']!r} model, not a Fractus CTE")
        return model_from_checkpoint(ckpt, path, cls, FractusConfig, backend)


def check_token_ids(idx, vocab_size: int) -> None:
    """Raise ValueError unless idx is a [B, T] int64 (or int32) tensor of ids in [0, vocab_size):
    every model's input check."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
        got = f"shape {tuple(idx.shape)} {idx.dtype}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"idx must be a [B, T] int64 (or int32) tensor of token ids, got {got}")
    if idx.numel():
        lo, hi = torch.stack(torch.aminmax(idx)).tolist()  # one device sync
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}); got min {lo}, max {hi}")


def prompt_tensor(prompt_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty, vocab_size: int,
                  device) -> torch.Tensor:
    """Every model's ``generate`` arguments checked (ValueError naming the bad one); the prompt as a
    [T] int64 tensor on ``device``."""
    ids = torch.as_tensor(prompt_ids if torch.is_tensor(prompt_ids) else list(prompt_ids))
    if ids.dim() != 1 or ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise ValueError(f"generate takes one sequence of integer token ids (a list or a [T] tensor), "
                         f"got shape {tuple(ids.shape)} {ids.dtype}")
    if not _finite(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer ≥ 0, got {max_new_tokens!r}")
    if top_k is not None and not (_finite(top_k, numbers.Integral) and top_k >= 1):
        raise ValueError(f"top_k must be an integer ≥ 1 or None, got {top_k!r}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be finite and ≥ 0 (0 = greedy), got {temperature}")
    if top_p is not None and not 0 < top_p <= 1 or not 0 < repetition_penalty < math.inf:
        raise ValueError(f"need top_p in (0, 1] or None and a finite repetition_penalty > 0; "
                         f"got {top_p}, {repetition_penalty}")
    ids = ids.to(device=device, dtype=torch.long)
    check_token_ids(ids.view(1, -1), vocab_size)
    return ids


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
               repetition_penalty: float, seen: torch.Tensor, gen: torch.Generator) -> int:
    """Pick one token id from logits [V]; drawing from non-finite probabilities is a ValueError."""
    if repetition_penalty != 1.0:
        pen = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, pen, logits)
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    if not torch.isfinite(probs).all():  # an infinite or NaN logit
        raise ValueError("the next-token probabilities are not finite: the logits overflowed (the model's "
                         "activations, or a temperature or repetition penalty that scales them out of fp32's range)")
    return int(torch.multinomial(probs, 1, generator=gen))
