"""Function-preserving growth: a trained Fractus CTE → a larger one that computes the same logits.

``grow(model_or_ckpt, target_cfg)`` builds the target model with its own random initialisation,
then writes the old weights into it so that, on any token input, the grown model's logits (so
its cross-entropy) equal the old model's up to float rounding. Every dimension that the presets
change can grow (palier0 → 1 → 2 → 3 → 1b): d_model (as new heads of the same d_head), n_layers,
n_experts, expert_d_ff, expert_rank, n_oscillators (by a whole factor) and coupling_rank. The
vocabulary, levels, top-k, router kind, expert kind and Kuramoto integration must stay the same.
The trainer exposes it as ``python -m fractus.train --grow-from CKPT --preset palier1 …``.

Method (width d → d' = d + Δ, c = √(d'/d)):

* Residual stream. The grown stream is h' = c·[h ; μ(h)·1_Δ], μ(h) the mean of h's d entries.
  Every tensor that writes into the stream (embedding rows, attention out projection, expert
  U2/W2 and b2) is scaled by c and gets, for each new coordinate, the mean of its old output
  coordinates, which keeps that form through every residual update. The mean of h' is then c·μ
  and its centred part c·[h − μ ; 0], whose variance over d' entries is the old variance over d
  entries exactly (so LayerNorm's eps acts as before): every LayerNorm sees c·n on the old
  coordinates (n the old normalised vector) and exactly 0 on the new ones. (Zero new columns
  would not do: the mean and variance over d' entries would change with every token.)
* LayerNorms: old coordinates γ/c, β, so they output the old values; new coordinates γ = 1,
  β = 0, so they output 0. The final norm feeds the tied head W_emb' (scaled by c), so it uses
  γ/c², β/c on the old coordinates (untied head: γ/c, β; the new head columns read zeros).
* Readers (q/k/v, Kuramoto encoder, expert V1/W1, linear router): the old weights on the old
  input columns; the new input columns keep their random initialisation — they multiply the
  norms' zero outputs, and give the new coordinates gradients from the first step.
* Heads: old heads keep their q/k/v rows; new heads get random q/k/v and zero columns in the
  out projection, so they add nothing until the projection learns them.
* Kuramoto clock: new oscillators are twins. With N' = m·N each old oscillator gets m − 1
  copies (same ω and encoder row) and all m copies get its row of U divided by √m, so each old
  oscillator feels the same coupling Σ_j K_ij sin(θ_j − θ_i) and the routing angle
  atan2(Σ sin θ, Σ cos θ) is unchanged. The fixed offsets 2πn/N become 2πn/N' and the encoder
  bias absorbs the difference. New coupling ranks get random U columns and λ = 0. The twins
  separate once the new encoder columns and coupling ranks receive gradients.
* Experts: old experts keep their phases and weights. New hidden units (d_ff) get random input
  rows and zero rows in V2/W2; new rank components random V1/V2 columns and zero U1/U2 columns.
  New experts get the target's random initialisation (small, not zeros) and a gate bias b_e
  (the model's learned per-expert bias, 0 for ordinary experts) low enough that they are never
  among an old token's top-k: for every routing angle ψ, below the k-th largest old logit minus
  their own (computed on a grid of ψ, with the Lipschitz bound κ/τ·2π/G plus GATE_MARGIN as
  margin; for the linear router from a bound on |m·W_r| over LayerNorm outputs). The top-k and
  their renormalised weights are then exactly the old ones. The load-balance loss, which pulls
  every expert's mean probability towards 1/E', raises the new biases until the new experts
  are routed to and trained. New experts' phases are taken from the Farey phases of E' experts,
  farthest from the phases already in use first.
* Depth (``depth="interleave"``, the default): new blocks, interleaved evenly between the old
  ones, have zero attention out projections and zero expert U2/W2 and b2: they add nothing, and
  their gradients are not zero.
* Depth by stacking (``depth="stack"``, G_stack of Du et al., "Stacking Your Transformers", 2024):
  block j of the target is old block j mod L, each copy grown in width as above — the trained
  stack repeated rather than blocks that add nothing. The logits are then not preserved (each
  copy adds its update again); what it gives up in function it may gain in learning speed, and
  the growth experiment (:mod:`fractus.experiments.growth`) measures it against the default.

Not preserved: the load-balance term lb = E·Σ_e (P_e − 1/E)² depends on E by definition and new
blocks add their own, so the training loss ce + lb_coef·lb moves by lb_coef·Δlb; the logits and
the cross-entropy do not. Vectors given to ``tick_vec`` must be mapped the same way (c·[v ; μ(v)]).
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import torch

from fractus.checkpoint import check_finite
from fractus.model import FractusConfig, FractusCTE, farey_phases

# Config fields that growth keeps, and those that may only grow.
FIXED = ("vocab_size", "n_levels", "top_k", "router", "tie_head", "kuramoto_steps", "kuramoto_dt",
         "kuramoto_damping", "gate_tau", "eps", "attn_norm", "attn_gate", "short_conv", "qk_norm", "eot_reset",
         "attn_window", "decay_gate")
GROWN = ("d_model", "n_heads", "n_layers", "n_experts", "expert_d_ff", "expert_rank",
         "n_oscillators", "coupling_rank", "shared_expert")
GATE_MARGIN = 0.5  # logits by which a new expert stays below every old token's k-th expert
PSI_GRID = 4096  # routing angles on which the phase router's bound is evaluated


def check_growable(src: FractusConfig, dst: FractusConfig) -> None:
    """Raise ValueError naming every reason ``src`` cannot grow into ``dst``."""
    errors = [f"{k} {getattr(src, k)!r} → {getattr(dst, k)!r} must stay the same"
              for k in FIXED if getattr(src, k) != getattr(dst, k)]
    errors += [f"{k} {getattr(src, k)} → {getattr(dst, k)} would shrink"
               for k in GROWN if getattr(dst, k) < getattr(src, k)]
    if src.d_head != dst.d_head:
        errors.append(f"d_head {src.d_head} → {dst.d_head}: width grows by whole heads of the same size")
    if (src.expert_rank == 0) != (dst.expert_rank == 0):
        errors.append("dense (expert_rank=0) and low-rank experts cannot be converted into each other")
    if dst.n_oscillators % src.n_oscillators:
        errors.append(f"n_oscillators {src.n_oscillators} → {dst.n_oscillators}: must grow by a whole factor")
    old, new = decay_matrix(src), decay_matrix(dst)
    if any(n[:src.n_heads] != o for o, n in zip(old, new)):
        errors.append(f"attn_decay of the old heads {old} → {[n[:src.n_heads] for n in new]} (per level) must stay")
    if errors:
        raise ValueError("cannot grow this model into the target config: " + "; ".join(errors))


def decay_matrix(cfg: FractusConfig) -> list[tuple[float, ...]]:
    """γ per level, per head: [Lv][H]."""
    g, H = cfg.decays, cfg.n_heads
    return [g[l * H:(l + 1) * H] if len(g) > H else g for l in range(cfg.n_levels)]


def _lead(t: torch.Tensor, shape) -> torch.Tensor:
    """The leading block t[:s0, :s1, …] of ``t``."""
    return t[tuple(slice(0, s) for s in shape)]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A reader: old values into the leading block; the rest keeps its initialisation."""
    _lead(dst, src.shape).copy_(src)


def _writer(src: torch.Tensor, dim: int, d_new: int, c: float) -> torch.Tensor:
    """A tensor whose axis ``dim`` writes the residual stream: c·[src ; mean of src along dim]."""
    t = src.double()
    shape = list(t.shape)
    shape[dim] = d_new - t.shape[dim]
    return c * torch.cat([t, t.mean(dim, keepdim=True).expand(shape)], dim)


def _padded(src: torch.Tensor, shape) -> torch.Tensor:
    """``src`` in the leading block of a zero tensor of ``shape``."""
    out = src.new_zeros(shape)
    _lead(out, src.shape).copy_(src)
    return out


def _norm(dst: torch.nn.LayerNorm, src: torch.nn.LayerNorm, w_scale: float, b_scale: float) -> None:
    d = src.weight.shape[0]
    dst.weight.fill_(1.0)
    dst.bias.zero_()
    dst.weight[:d].copy_(src.weight * w_scale)
    dst.bias[:d].copy_(src.bias * b_scale)


@lru_cache(maxsize=None)
def _farey(n: int) -> torch.Tensor:
    return farey_phases(n).double()


def _added_phases(old: torch.Tensor, n_total: int) -> torch.Tensor:
    """Phases for n_total − len(old) new experts: Farey phases of n_total experts, each time the
    one farthest (on the circle) from every phase already in use."""
    cand = _farey(n_total)
    old = old.detach().double().cpu()

    def dist(a, b):
        return ((a - b + math.pi) % (2 * math.pi) - math.pi).abs()

    nearest = dist(cand[:, None], old[None, :]).min(1).values
    picked = []
    for _ in range(n_total - len(old)):
        i = int(nearest.argmax())
        picked.append(float(cand[i]))
        nearest = torch.minimum(nearest, dist(cand, cand[i]))
    return torch.tensor(picked)


def _new_expert_bias(moe, n_old: int, top_k: int) -> torch.Tensor:
    """Gate biases for experts n_old… of a grown block that keep them out of every top-k."""
    bias = moe.gate_bias.detach().double().cpu()
    if moe.cfg.router == "phase":
        kappa = float(moe.log_kappa.exp()) / moe.cfg.gate_tau
        psi = torch.arange(PSI_GRID, dtype=torch.float64) * (2 * math.pi / PSI_GRID)
        g = kappa * torch.cos(psi[:, None] - moe.phases.detach().double().cpu()[None, :])  # [G, E']
        kth = (g[:, :n_old] + bias[:n_old]).topk(top_k, -1).values[:, -1]
        room = (kth[:, None] - g[:, n_old:]).min(0).values
        return room - kappa * 2 * math.pi / PSI_GRID - GATE_MARGIN
    # |m·W_e| ≤ ‖γ ⊙ W_e‖·√d + |β·W_e| for every LayerNorm output m = γ ⊙ n + β, ‖n‖ < √d
    W = moe.router.weight.detach().double().cpu()
    gam, bet = moe.ln.weight.detach().double().cpu(), moe.ln.bias.detach().double().cpu()
    bound = (W * gam).norm(dim=1) * math.sqrt(W.shape[1]) + (W @ bet).abs()
    lowest_old = (bias[:n_old] - bound[:n_old]).min()
    return lowest_old - bound[n_old:] - GATE_MARGIN


def _grow_block(new, old, src: FractusConfig, cfg: FractusConfig, c: float) -> None:
    """Write block ``old`` (of ``src``) into block ``new`` (of ``cfg``), c = √(d'/d) the grown
    stream's scale: attention, then the clock, then the experts."""
    _grow_attention(new.attn, old.attn, src, cfg, c)
    if new.clock is not None:
        _grow_clock(new.clock, old.clock, src, cfg, c)
    _grow_experts(new.moe, old.moe, src, cfg, c)


def _grow_attention(a, b, src: FractusConfig, cfg: FractusConfig, c: float) -> None:
    """Old heads keep their q/k/v rows; new heads are silent in the out projection."""
    d, d2 = src.d_model, cfg.d_model
    _norm(a.ln, b.ln, 1 / c, 1.0)
    for p in range(b.qkv.weight.shape[0] // d):  # q, k, v (and the gate): old heads' rows, old columns
        a.qkv.weight[p * d2:p * d2 + d, :d].copy_(b.qkv.weight[p * d:(p + 1) * d])
        a.qkv.bias[p * d2:p * d2 + d].copy_(b.qkv.bias[p * d:(p + 1) * d])
    if a.conv is not None:  # per channel of q, k, v: old heads' channels keep their filters
        for p in range(3):
            a.conv.weight[:, p * d2:p * d2 + d].copy_(b.conv.weight[:, p * d:(p + 1) * d])
    if a.rms_scale is not None:
        a.rms_scale[:src.n_heads].copy_(b.rms_scale)
    H, H2 = src.n_heads, cfg.n_heads
    for new, old in ((a.decay_proj, b.decay_proj), (a.beta_proj, b.beta_proj)):
        if new is not None:  # rows level-major (l·H + h): old heads' rows, old columns
            for lv in range(src.n_levels):
                new.weight[lv * H2:lv * H2 + H, :d].copy_(old.weight[lv * H:(lv + 1) * H])
                new.bias[lv * H2:lv * H2 + H].copy_(old.bias[lv * H:(lv + 1) * H])
    a.out.weight.copy_(_writer(_padded(b.out.weight, (d, d2)), 0, d2, c))
    a.out.bias.copy_(_writer(b.out.bias, 0, d2, c))
    a.level_logits.copy_(b.level_logits)
    if a.window_logit is not None:
        a.window_logit.copy_(b.window_logit)


def _grow_clock(k, o, src: FractusConfig, cfg: FractusConfig, c: float) -> None:
    """The Kuramoto clock (the phase router's): m twins per old oscillator."""
    _norm(k.ln, o.ln, 1 / c, 1.0)
    N, N2, R = src.n_oscillators, cfg.n_oscillators, src.coupling_rank
    m = N2 // N
    for t in range(m):
        rows = slice(t * N, (t + 1) * N)
        k.encoder.weight[rows, :src.d_model].copy_(o.encoder.weight)
        n_new = torch.arange(t * N, (t + 1) * N, dtype=torch.float64)
        n_old = torch.arange(N, dtype=torch.float64)
        shift = 2 * math.pi * (n_old / N - n_new / N2)
        k.encoder.bias[rows].copy_(o.encoder.bias.double() + shift.to(o.encoder.bias.device))
        k.omega[rows].copy_(o.omega)
        k.U[rows, :R].copy_(o.U / math.sqrt(m))
    k.lam.zero_()
    k.lam[:R].copy_(o.lam)


def _grow_experts(e, f, src: FractusConfig, cfg: FractusConfig, c: float) -> None:
    """Old experts keep their function (new hidden units and rank components reach nothing);
    added experts get phases between the old ones and a gate bias that keeps them unused."""
    d, d2, E = src.d_model, cfg.d_model, src.n_experts
    _norm(e.ln, f.ln, 1 / c, 1.0)
    if src.router == "phase":
        e.phases[:E].copy_(f.phases)
        e.phases[E:].copy_(_added_phases(f.phases, cfg.n_experts))
        e.log_kappa.copy_(f.log_kappa)
    else:
        _copy(e.router.weight, f.router.weight)
    if src.expert_rank > 0:
        Fd, r = src.expert_d_ff, src.expert_rank
        _copy(e.V1, f.V1)
        _copy(e.U1, f.U1)
        e.U1[:E, :Fd, r:].zero_()  # new rank components do not reach old hidden units
        _copy(e.V2, f.V2)
        e.V2[:E, Fd:].zero_()  # new hidden units do not reach the output
        U2 = _writer(_padded(f.U2, (E, d, cfg.expert_rank)), 1, d2, c)
        e.U2[:E].copy_(U2)  # new rank columns stay zero
        for n in ("s1", "s2", "b1"):
            _copy(getattr(e, n), getattr(f, n))
    else:
        _copy(e.W1, f.W1)
        e.W2[:E].copy_(_writer(_padded(f.W2, (E, cfg.expert_d_ff, d)), 2, d2, c))
        _copy(e.b1, f.b1)
    e.b2[:E].copy_(_writer(f.b2, 1, d2, c))
    if e.shared is not None:  # new hidden units do not reach the output; a new shared expert adds nothing
        w_out, b_out = e.shared[2].weight, e.shared[2].bias
        if f.shared is None:
            w_out.zero_()
            b_out.zero_()
        else:
            _copy(e.shared[0].weight, f.shared[0].weight)
            _copy(e.shared[0].bias, f.shared[0].bias)
            w_out.copy_(_writer(_padded(f.shared[2].weight, (d, cfg.shared_expert)), 0, d2, c))
            b_out.copy_(_writer(f.shared[2].bias, 0, d2, c))
    e.gate_bias[:E].copy_(f.gate_bias)
    if cfg.n_experts > E:
        e.gate_bias[E:].copy_(_new_expert_bias(e, E, cfg.top_k))


def _silence(block) -> None:
    """A new block: zero attention out projection and expert outputs (it adds nothing)."""
    block.attn.out.weight.zero_()
    block.attn.out.bias.zero_()
    (block.moe.U2 if block.moe.cfg.expert_rank > 0 else block.moe.W2).zero_()
    block.moe.b2.zero_()
    if block.moe.shared is not None:
        block.moe.shared[2].weight.zero_()
        block.moe.shared[2].bias.zero_()


DEPTHS = ("interleave", "stack")  # how new blocks are made (the module's docstring)


@torch.no_grad()
def grow(model_or_ckpt: FractusCTE | str | Path, target_cfg: FractusConfig, depth: str = "interleave") -> FractusCTE:
    """A ``target_cfg`` model computing the same logits as the given model or checkpoint file
    (see the module docstring for the construction; with ``depth="stack"`` the same logits only
    where the depth does not grow). Random parts come from torch's global RNG; the result is on
    the source model's device, in training mode."""
    if depth not in DEPTHS:
        raise ValueError(f"depth {depth!r} is not one of {DEPTHS}")
    old = model_or_ckpt if isinstance(model_or_ckpt, torch.nn.Module) else FractusCTE.load(model_or_ckpt)
    old = getattr(old, "_orig_mod", old)
    check_finite(old.state_dict(), model_or_ckpt if isinstance(model_or_ckpt, (str, Path)) else "the model to grow")
    src, cfg = old.cfg, target_cfg
    check_growable(src, cfg)
    new = FractusCTE(cfg)
    d, d2 = src.d_model, cfg.d_model
    c = math.sqrt(d2 / d)
    new.embed.weight.copy_(_writer(old.embed.weight, 1, d2, c))
    if src.tie_head:
        _norm(new.ln_f, old.ln_f, 1 / c ** 2, 1 / c)
    else:
        _norm(new.ln_f, old.ln_f, 1 / c, 1.0)
        _copy(new.head.weight, old.head.weight)
    L, L2 = src.n_layers, cfg.n_layers
    kept = [i * L2 // L for i in range(L)]
    for j, block in enumerate(new.blocks):
        if depth == "stack":
            _grow_block(block, old.blocks[j % L], src, cfg, c)
        elif j in kept:
            _grow_block(block, old.blocks[kept.index(j)], src, cfg, c)
        else:
            _silence(block)
    return new.to(old.embed.weight.device)
