"""The layers the Fractus CTE and the Transformer++ are built from, and the checks both share.

Shared: the config-field checks (:func:`check_fields` with its rules, :func:`check_config_keys`),
the input checks and sampling of ``forward`` and ``generate`` (:func:`check_token_ids`,
:func:`prompt_tensor`, :func:`next_token`), the causal short convolution (:class:`ShortConv`) and
:func:`autocast_input`. The CTE's block (:class:`Block`, math: ``docs/model.md``): multi-level
linear attention with an optional softmax window level (:class:`LinearAttention`), the Kuramoto
phase clock (:class:`KuramotoClock`) and the phase-routed experts (:class:`PhaseRoutedMoE`) with
their load balance. Each of these takes the model's config (a :class:`fractus.model.FractusConfig`)
and reads its fields; the hot ops they call are :mod:`fractus.ops`'.

Shapes: B rows (batch), T positions, d = d_model, H heads of D, Lv levels, E experts, K = top_k.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import fields
from fractions import Fraction
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from fractus.ops.common import first_order_only
from fractus.ops.delta_rule import delta_rule
from fractus.ops.kuramoto import kuramoto_phase
from fractus.ops.linear_attention import linear_attention
from fractus.ops.moe import moe
from fractus.ops.window_attention import window_attention


# -- config checks --------------------------------------------------------------------------
def is_finite_number(v, kind=numbers.Real) -> bool:
    """True when ``v`` is a finite number of ``kind`` (a bool is not a number here)."""
    return isinstance(v, kind) and not isinstance(v, bool) and math.isfinite(v)


def is_decay(gam) -> bool:
    """True when ``gam`` is a decay factor: a finite number in (0, 1]."""
    return is_finite_number(gam) and 0 < gam <= 1


def int_at_least(lo: int):
    """The check of an integer field ≥ ``lo``: (what it must be, check)."""
    return f"an integer ≥ {lo}", lambda v: is_finite_number(v, numbers.Integral) and v >= lo


# the checks of a number field > 0, of one ≥ 0 and of a bool field: (what it must be, check)
POSITIVE = "a finite number > 0", lambda v: is_finite_number(v) and v > 0
NON_NEGATIVE = "a finite number ≥ 0", lambda v: is_finite_number(v) and v >= 0
BOOLEAN = "true or false", lambda v: isinstance(v, bool)


def one_of(*choices: str):
    """The check of a string field that takes one of ``choices``: (what it must be, check)."""
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


def check_config_keys(cls, d: dict) -> None:
    """ValueError naming the keys of ``d`` that are no field of the dataclass ``cls`` (a saved config
    or a preset's overrides read as ``cls``), and listing the fields."""
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown config keys {sorted(map(str, unknown))}; the fields are {sorted(known)}")


# -- input checks and sampling ---------------------------------------------------------------
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
                  device, seed=None) -> tuple[torch.Tensor, bool]:
    """Every model's ``generate`` arguments checked (ValueError naming the bad one); the prompts as
    a [B, T] int64 tensor on ``device``, and whether they came as a batch: one sequence (a list or
    a [T] tensor) is a batch of one, several (a list of equal-length lists or a [B, T] tensor) a
    batch of B. Prompts of one batch have equal lengths: there is no padding."""
    if not torch.is_tensor(prompt_ids):
        prompt_ids = list(prompt_ids)
        rows = [list(r) if isinstance(r, (list, tuple)) or torch.is_tensor(r) else None for r in prompt_ids]
        if prompt_ids and all(r is not None for r in rows):
            if len({len(r) for r in rows}) > 1:
                raise ValueError(f"the prompts of one batch must have equal lengths (no padding), got lengths "
                                 f"{sorted({len(r) for r in rows})}: generate them in groups of one length")
            prompt_ids = rows
    ids = torch.as_tensor(prompt_ids)
    if ids.dim() not in (1, 2) or ids.numel() and (ids.is_floating_point() or ids.is_complex()
                                                  or ids.dtype == torch.bool):
        raise ValueError(f"generate takes integer token ids: one sequence (a list or a [T] tensor) or a batch of "
                         f"equal-length ones ([B, T]), got shape {tuple(ids.shape)} {ids.dtype}")
    if not is_finite_number(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer ≥ 0, got {max_new_tokens!r}")
    if top_k is not None and not (is_finite_number(top_k, numbers.Integral) and top_k >= 1):
        raise ValueError(f"top_k must be an integer ≥ 1 or None, got {top_k!r}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be finite and ≥ 0 (0 = greedy), got {temperature}")
    if top_p is not None and not 0 < top_p <= 1 or not 0 < repetition_penalty < math.inf:
        raise ValueError(f"need top_p in (0, 1] or None and a finite repetition_penalty > 0; "
                         f"got {top_p}, {repetition_penalty}")
    if seed is not None and not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
                                 and 0 <= seed < 2 ** 63 - ids.shape[0]):
        raise ValueError(f"seed must be None or an integer in [0, 2^63), got {seed!r}")
    batched = ids.dim() == 2
    ids = ids.to(device=device, dtype=torch.long).view(-1, ids.shape[-1])
    check_token_ids(ids, vocab_size)
    return ids, batched


def sample_loop(logits: torch.Tensor, step, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                top_k: int | None, top_p: float | None, repetition_penalty: float, seed: int | None) -> list[list[int]]:
    """Draw ``max_new_tokens`` tokens for each of B prompts: ``logits`` [B, V] are the prompts'
    last positions', ``step(tokens [B])`` reads one token a row and returns the next logits [B, V].
    Row i draws from its own generator, seeded ``seed + i`` (None: fresh seeds, the global RNG
    untouched), and its repetition penalty sees its own prompt and draws, so row i of a batch is
    what its prompt alone gives with seed ``seed + i``."""
    B, V = logits.shape
    gens = []
    for i in range(B):
        gen = torch.Generator(device=ids.device)
        gen.manual_seed(seed + i) if seed is not None else gen.seed()
        gens.append(gen)
    seen = torch.zeros(B, V, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
    out = [[] for _ in range(B)]
    for n in range(max_new_tokens):
        nxt = [next_token(logits[i].float(), temperature, top_k, top_p, repetition_penalty, seen[i], gens[i])
               for i in range(B)]
        for i, t in enumerate(nxt):
            out[i].append(t)
            seen[i, t] = True
        if n + 1 < max_new_tokens:
            logits = step(torch.tensor(nxt, device=ids.device))
    return out


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


# -- shared layers ---------------------------------------------------------------------------
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
            return Taps.apply(xp, w), xp[:, T:].float()
        seen = resets.cumsum(1)  # resets up to t [B, T]
        y = x * w[0]
        for j in range(1, W):  # x_{t−j} counts if no reset in (t − j, t]: seen_t = seen_{t−j} (none before the chunk)
            before = F.pad(seen, (j, 0))[:, :T]
            y = y + xp[:, W - 1 - j:W - 1 - j + T] * w[j] * (seen == before).unsqueeze(-1).to(x.dtype)
        after = seen[:, -1:] - F.pad(seen, (W - 1, 0))[:, T:]  # resets after each buffered input: those
        buf = xp[:, T:] * (after == 0).unsqueeze(-1).to(x.dtype)  # before the chunk's last one leave as zeros
        return y, buf.float()


class Taps(torch.autograd.Function):
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


def autocast_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the autocast dtype when autocast is on for its device (custom kernels are not
    autocast-aware; LayerNorm outputs stay fp32 under autocast), else ``t`` unchanged."""
    if torch.is_autocast_enabled(t.device.type):
        return t.to(torch.get_autocast_dtype(t.device.type))
    return t


# -- the CTE's block -------------------------------------------------------------------------
PHI = (1 + 5 ** 0.5) / 2  # the golden ratio: the levels' feature-map offsets are its powers


def level_omegas(n_levels: int) -> list[float]:
    """Feature-map offsets ω_l = φ^(−2l)."""
    return [PHI ** (-2 * l) for l in range(n_levels)]


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
    (:mod:`fractus.ops.window_attention`), its weight the softmax of ``window_logit`` beside
    ``level_logits``.
    S [B, Lv, H, D, D] and z [B, Lv, H, D] stay fp32 (:mod:`fractus.ops.linear_attention`).
    """

    def __init__(self, cfg):
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

    def __init__(self, cfg):
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


def farey_phases(n_experts: int) -> torch.Tensor:
    """[E] expert phases 2π·a/b: E fractions picked evenly from the Farey sequence F_{2E} on [0, 1)."""
    return torch.tensor(_farey_angles(n_experts))


@lru_cache(maxsize=None)
def _farey_angles(n_experts: int) -> tuple[float, ...]:
    n = 2 * n_experts
    seq = sorted({Fraction(a, b) for b in range(1, n + 1) for a in range(0, b)})
    return tuple(2 * math.pi * float(seq[(i * len(seq)) // n_experts]) for i in range(n_experts))


class PhaseRoutedMoE(nn.Module):
    """Top-k experts chosen per token by a von Mises gate on ψ (or a linear router).

    p = softmax(gate_logits), its top-K renormalised to weights w; out = Σ_k w_k·f_{e_k}(m),
    m = LN(h), with f_e(m) = s2_e·(gelu(s1_e·(m V1_e) U1_eᵀ + b1_e) V2_e) U2_eᵀ + b2_e (rank r),
    or gelu(m W1_e + b1_e) W2_e + b2_e when expert_rank = 0 (:mod:`fractus.ops.moe`).
    """

    def __init__(self, cfg):
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


def load_balance(p: torch.Tensor) -> torch.Tensor:
    """lb = E·Σ_e (P_e − 1/E)², P_e = mean of p_e [.., E] over the tokens."""
    E = p.shape[-1]
    P = p.reshape(-1, E).mean(0)
    return E * ((P - 1 / E) ** 2).sum()


class Block(nn.Module):
    """One pre-norm block: h ← h + LinearAttention(h); ψ = KuramotoClock(h) (none for the linear
    router); h ← h + PhaseRoutedMoE(h; ψ)."""

    def __init__(self, cfg):
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
