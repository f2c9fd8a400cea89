"""Analytic cost model of a Fractus CTE training step: FLOPs and bytes per token per component,
a roofline time per component, and time-to-train.

Counting rules (per token, forward; a multiply-add is 2 FLOPs):

- attention: q/k/v and output projections (8·d²; the output gate's projection 2·d² more), the
  short convolution (2·3d·W), the feature maps, and the chunked algorithm the kernels run: per
  level, an intra-chunk part over ``attn_chunk`` positions (4·d·c) and the D×D state read and
  update (4·d·D); ``attn_chunk=1`` is the plain recurrence. A softmax window level
  (``attn_window`` = W) reads each block of Q = min(W, chunk) queries against its Q + W − 1 keys:
  4·d·(Q + W − 1) for the scores and their weighted values, a softmax over them, RoPE on q and k.
- kuramoto: the encoder (2·d·N) and ``kuramoto_steps`` RK4 steps of 4 rate evaluations
  (the low-rank coupling products 8·N·r of the PyTorch path; the Triton kernels multiply by the
  dense K = U diag(λ) Uᵀ, 4·N², the same at every preset's r = N/2; sin/cos counted as
  ``TRANSCENDENTAL`` FLOPs each); none with the linear router, which has no clock.
- moe: the gate, then ``top_k`` experts (low-rank: 4·d·r + 4·F·r, dense: 4·d·F) plus gelu, and
  the shared expert (4·d·F_s) when there is one.
- head: the tied (or separate) head and its cross-entropy, 2·d·V + 5·V, on the supervised
  positions only (``head_positions="last"`` divides it by the chunk length).
- norms: every LayerNorm (3 per block + the final one), ``NORM_FLOPS`` per element.
- embedding: a row gather (0 FLOPs; its backward is a d-wide scatter-add).

Each count takes the training chunk length ``chunk_len`` (C, positions per forward: the trainer's
``--chunk-len``): the attention's chunk (``attn_chunk``, by default min(64, C)), the window level's
blocks and the supervised share of the head depend on it.

Training multiplies matmul FLOPs by 3 (forward, input gradient, weight gradient) and elementwise
FLOPs by 3 as well (a rough rule); a detached Kuramoto clock has no backward. The optimizer is
counted per step (:func:`optimizer_cost`), not per token, because it depends on the batch.

Bytes: activations are read and written once per op in the forward (``dtype_bytes`` each, states
fp32) and twice more in the backward; weights are read once in the forward and read + gradient
written + accumulated in the backward, shared by the ``batch_tokens`` tokens of a micro-step.
The roofline time of a component is max(FLOPs / peak FLOP/s, bytes / peak B/s); a step adds the
optimizer's memory traffic and a per-op dispatch cost (``n_ops`` × ``op_overhead_s``).

On a GPU (:func:`gpu_step`) the model is the one :mod:`fractus.bench.cpu_costmodel` checks on this
CPU, a step's work plus a host cost per op, with the work counted here (the GPU's path does not run
on a CPU) at the GPU's peak rates, and the host's launches overlapping the device's work: eager CUDA
queues kernels ahead of the device, where a CPU runs each op as it is dispatched.
"""
from __future__ import annotations

import math

from fractus.bench.profile import gpu_launch_count
from fractus.model import FractusConfig

COMPONENTS = ("embedding", "attention", "kuramoto", "moe", "head", "norms")
TRANSCENDENTAL = 8.0  # FLOPs charged per sin/cos/exp/erf (a polynomial evaluation)
NORM_FLOPS = 8.0  # FLOPs per element of a LayerNorm (mean, variance, normalise, scale, shift)
GELU_FLOPS = 2.0 + TRANSCENDENTAL
# Optimizer memory traffic per parameter per step, in stored values: AdamW reads p, g, m, v
# and writes p, m, v; SGD with momentum reads p, g, buf and writes p, buf; RMSprop as SGD.
OPT_VALUES = {"adamw": 7, "sgd": 5, "rmsprop": 5}
OPT_FLOPS = {"adamw": 12, "sgd": 4, "rmsprop": 6}

# NVIDIA datasheet peaks (dense: half the "with sparsity" figures) and memory, by the words of the
# name CUDA reports ("NVIDIA H100 80GB HBM3" is the H100 SXM, "NVIDIA H200 NVL" the H200 NVL card)
DATASHEETS = {
    "H200": {"hbm_gbs": 4800.0, "bf16_tflops": 989.0, "tf32_tflops": 494.0, "fp32_tflops": 67.0, "memory_gb": 141.0},
    "H200 NVL": {"hbm_gbs": 4800.0, "bf16_tflops": 835.5, "tf32_tflops": 417.5, "fp32_tflops": 60.0, "memory_gb": 141.0},
    "H100": {"hbm_gbs": 3350.0, "bf16_tflops": 989.0, "tf32_tflops": 494.0, "fp32_tflops": 67.0, "memory_gb": 80.0},
    "H100 NVL": {"hbm_gbs": 3900.0, "bf16_tflops": 835.5, "tf32_tflops": 417.5, "fp32_tflops": 60.0, "memory_gb": 94.0},
    "H100 PCIe": {"hbm_gbs": 2000.0, "bf16_tflops": 756.0, "tf32_tflops": 378.0, "fp32_tflops": 51.0, "memory_gb": 80.0},
}
H200_DATASHEET = DATASHEETS["H200"]  # the SXM card: the GPU the cost model's column predicts


def datasheet(device_name: str) -> dict | None:
    """The datasheet of a CUDA device by its name, the most specific entry whose words it contains
    ("NVIDIA H100 PCIe" → "H100 PCIe", "NVIDIA H100 80GB HBM3" → "H100"); None for another GPU."""
    words = device_name.split()
    for key in sorted(DATASHEETS, key=len, reverse=True):
        if all(w in words for w in key.split()):
            return DATASHEETS[key]
    return None


def _attn_chunk(chunk_len: int, attn_chunk: int | None) -> int:
    """Positions per chunk of the linear attention's algorithm: ``attn_chunk``, or the kernels' 64
    capped at a forward's ``chunk_len``."""
    return attn_chunk if attn_chunk is not None else min(64, chunk_len)


def _head_share(chunk_len: int, head_positions: str) -> float:
    """The share of a forward's ``chunk_len`` positions the head scores."""
    if head_positions not in ("all", "last"):
        raise ValueError(f"head_positions must be 'all' or 'last', got {head_positions!r}")
    return 1.0 if head_positions == "all" else 1.0 / chunk_len


def _window_keys(cfg: FractusConfig, chunk_len: int) -> int:
    """Keys each query of the softmax window level scores (0 without one): its block's Q =
    min(W, chunk_len) queries read Q + W − 1 keys."""
    return min(cfg.attn_window, chunk_len) + cfg.attn_window - 1 if cfg.attn_window else 0


def _norms(cfg: FractusConfig) -> int:
    """LayerNorms per block: attention's, the clock's (the phase router only) and the experts'."""
    return 3 if cfg.router == "phase" else 2


def _forward_flops(cfg: FractusConfig, chunk_len: int, head_positions: str, attn_chunk: int | None) -> dict:
    """{component: (matmul FLOPs, elementwise FLOPs)} of one token's forward, in forwards of
    ``chunk_len`` positions."""
    d, D, Lv, L = cfg.d_model, cfg.d_head, cfg.n_levels, cfg.n_layers
    N, r_c, E, K, Fd, r = (cfg.n_oscillators, cfg.coupling_rank, cfg.n_experts, cfg.top_k,
                           cfg.expert_d_ff, cfg.expert_rank)
    c = _attn_chunk(chunk_len, attn_chunk)
    gate, W = cfg.attn_gate, cfg.short_conv
    attn_mm = (8 + 2 * gate) * d * d + Lv * (4 * d * c + 4 * d * D)
    attn_ew = Lv * 2 * d * (TRANSCENDENTAL + 2) + Lv * 3 * d + 2 * d  # features, divide, mix, residual
    attn_ew += 2 * 3 * d * W + gate * d * (TRANSCENDENTAL + 3) + (cfg.attn_norm == "rms") * d * NORM_FLOPS
    G = Lv * cfg.n_heads * cfg.decay_gate  # the decay gate: one decay per (level, head) and token
    attn_mm += 2 * d * G
    attn_ew += G * (3 * TRANSCENDENTAL + 4)  # softplus, the power of γ, its log; the sums within a chunk
    keys = _window_keys(cfg, chunk_len)
    attn_mm += 4 * d * keys
    attn_ew += (keys > 0) * (cfg.n_heads * keys * (TRANSCENDENTAL + 3) + 2 * 3 * d + 2 * d)  # softmax, RoPE, mix
    rate_mm = 8 * N * r_c
    rate_ew = 2 * N * TRANSCENDENTAL + 8 * N
    clock = cfg.router == "phase"  # the linear router has no clock
    kur_mm = clock * (2 * d * N + cfg.kuramoto_steps * 4 * rate_mm)
    kur_ew = clock * (cfg.kuramoto_steps * (4 * rate_ew + 12 * N) + 2 * N * TRANSCENDENTAL + TRANSCENDENTAL)
    expert_mm = 4 * d * r + 4 * Fd * r if r > 0 else 4 * d * Fd
    gate_mm = 2 * d * E if cfg.router == "linear" else 0
    Fs = cfg.shared_expert
    moe_mm = gate_mm + K * expert_mm + 4 * d * Fs
    moe_ew = E * (TRANSCENDENTAL + 3) + K * (Fd * GELU_FLOPS + 2 * Fd + 3 * d) + d + Fs * (GELU_FLOPS + 1) + d
    share = _head_share(chunk_len, head_positions)
    head_mm = share * 2 * d * cfg.vocab_size
    head_ew = share * cfg.vocab_size * (3 + TRANSCENDENTAL)
    norms_ew = (_norms(cfg) * L + 1) * d * NORM_FLOPS
    return {"embedding": (0.0, 0.0), "attention": (L * attn_mm, L * attn_ew),
            "kuramoto": (L * kur_mm, L * kur_ew), "moe": (L * moe_mm, L * moe_ew),
            "head": (head_mm, head_ew), "norms": (0.0, norms_ew)}


def flops_per_token(cfg: FractusConfig, training: bool = True, *, chunk_len: int, head_positions: str = "all",
                    attn_chunk: int | None = None) -> dict[str, float]:
    """FLOPs per token of each component (:data:`COMPONENTS`) in forwards of ``chunk_len``
    positions; training = forward + backward.

    Sum the values for the model FLOPs of a token (e.g. for MFU = Σ · tok/s / peak).
    """
    out = {}
    for comp, (mm, ew) in _forward_flops(cfg, chunk_len, head_positions, attn_chunk).items():
        total = mm + ew
        if training and not (comp == "kuramoto" and cfg.detach_kuramoto):
            total *= 3
        out[comp] = float(total)
    if training:
        out["embedding"] = float(cfg.d_model)  # scatter-add of the embedding gradient
    return out


def weight_counts(cfg: FractusConfig) -> dict[str, int]:
    """Parameters of each component (all experts; the tied embedding counts as 'embedding')."""
    d, L, E, Fd, r = cfg.d_model, cfg.n_layers, cfg.n_experts, cfg.expert_d_ff, cfg.expert_rank
    N = cfg.n_oscillators
    expert = (2 * d * r + 2 * Fd * r + 2) if r > 0 else 2 * d * Fd
    expert += Fd + d
    Fs = cfg.shared_expert
    gate = cfg.attn_gate
    attention = (4 + gate) * d * d + (4 + gate) * d + cfg.n_levels + 3 * d * cfg.short_conv
    attention += d * (cfg.attn_norm == "rms") + (cfg.attn_window > 0)  # the window level's logit
    attention += (d + 1) * cfg.n_levels * cfg.n_heads * cfg.decay_gate  # the decay gate's projection
    return {"embedding": cfg.vocab_size * d,
            "attention": L * attention,
            "kuramoto": L * (d * N + N + N + N * cfg.coupling_rank + cfg.coupling_rank) * (cfg.router == "phase"),
            "moe": L * (E * expert + E + (d * E if cfg.router == "linear" else 1)  # + gate bias
                        + (2 * d * Fs + Fs + d if Fs else 0)),
            "head": 0 if cfg.tie_head else cfg.vocab_size * d,
            "norms": (_norms(cfg) * L + 1) * 2 * d}


def num_params(cfg: FractusConfig) -> int:
    return sum(weight_counts(cfg).values())


def _activation_elems(cfg: FractusConfig, chunk_len: int, head_positions: str, attn_chunk: int | None,
                      fused_ce: bool) -> dict:
    """{component: (elements moved per token in a forward of ``chunk_len`` positions, of which fp32
    state elements)}."""
    d, D, Lv, L, H = cfg.d_model, cfg.d_head, cfg.n_levels, cfg.n_layers, cfg.n_heads
    N, K, Fd, r = cfg.n_oscillators, cfg.top_k, cfg.expert_d_ff, cfg.expert_rank
    c = _attn_chunk(chunk_len, attn_chunk)
    attn = 4 * d + 4 * d + Lv * 4 * d + Lv * 4 * d + 2 * d + 3 * d  # qkv, features, chunks, out, residual
    attn += 2 * 3 * d * (cfg.short_conv > 0) + 3 * d * cfg.attn_gate  # the convolution, the gate
    attn += 3 * Lv * H * cfg.decay_gate  # the decay gate's logits and decays
    keys = _window_keys(cfg, chunk_len)
    attn += (keys > 0) * (8 * d + H * keys)  # the window: rotated q and k, keys, values, y; scores
    state = Lv * H * D * (D + 1) * 2 / c  # S read + written once per chunk
    kur = (2 * d + N + cfg.kuramoto_steps * 4 * 10 * N + 2 * N) * (cfg.router == "phase")
    inner = (r if r > 0 else 0) * 2 + Fd * 3
    moe = cfg.n_experts * 3 + K * (2 * d + 2 * inner) + 2 * K * d + 3 * d
    moe += (2 * d + 3 * cfg.shared_expert) * (cfg.shared_expert > 0)
    share = _head_share(chunk_len, head_positions)
    head = share * (2 * d + (0 if fused_ce else 4 * cfg.vocab_size))
    norms = (_norms(cfg) * L + 1) * 2 * d
    return {"embedding": (d, 0.0), "attention": (L * attn, L * state), "kuramoto": (L * kur, 0.0),
            "moe": (L * moe, 0.0), "head": (head, 0.0), "norms": (norms, 0.0)}


def bytes_per_token(cfg: FractusConfig, batch_tokens: int, training: bool = True, *, chunk_len: int,
                    dtype_bytes: int = 4, head_positions: str = "all", attn_chunk: int | None = None,
                    fused_ce: bool | None = None) -> dict[str, float]:
    """Memory traffic per token of each component for micro-steps of ``batch_tokens`` tokens in
    forwards of ``chunk_len`` positions.

    Weights are fp32 master copies read once per micro-step (the head reads the whole V×d
    matrix); the embedding gathers one row per token and, in training, writes and accumulates a
    dense V×d gradient per micro-step.
    """
    fused = cfg.fused_ce if fused_ce is None else fused_ce
    weights = weight_counts(cfg)
    weights["head"] = cfg.vocab_size * cfg.d_model
    out = {}
    for comp, (elems, state) in _activation_elems(cfg, chunk_len, head_positions, attn_chunk, fused).items():
        act = (elems - state) * dtype_bytes + state * 4
        backward = training and not (comp == "kuramoto" and cfg.detach_kuramoto)
        if comp == "embedding":
            w = 2 * weights["embedding"] * 4 / batch_tokens if training else 0.0
        else:
            w = weights[comp] * 4 / batch_tokens * (4 if backward else 1)
        out[comp] = float((3 * act if backward else act) + w)
    return out


def optimizer_cost(cfg: FractusConfig, optimizer: str, tokens_per_step: int) -> dict[str, float]:
    """FLOPs and bytes per token of the optimizer update, amortised over a step's tokens."""
    if optimizer not in OPT_VALUES:
        raise ValueError(f"optimizer must be one of {sorted(OPT_VALUES)}, got {optimizer!r}")
    n = num_params(cfg)
    return {"flops": OPT_FLOPS[optimizer] * n / tokens_per_step,
            "bytes": OPT_VALUES[optimizer] * 4 * n / tokens_per_step}


def roofline(cfg: FractusConfig, *, peak_flops: float, peak_bw: float, batch_size: int = 8,
             chunk_len: int, accum: int = 1, optimizer: str = "adamw",
             dtype_bytes: int = 4, head_positions: str = "all", n_ops: float = 0.0,
             op_overhead_s: float = 0.0, attn_chunk: int | None = None) -> dict:
    """Predicted seconds per token of each component (roofline), the optimizer, op dispatch,
    and the resulting tok/s of micro-steps of ``batch_size`` × ``chunk_len`` tokens. ``n_ops`` is
    the op count of one micro-step (forward + backward).

    Returns {"components": {name: s/token}, "intensity": {name: FLOP/byte}, "bound": {name:
    "compute"|"memory"}, "tok_s": float, "flops_per_token": float}.
    """
    batch_tokens = batch_size * chunk_len
    fl = flops_per_token(cfg, True, chunk_len=chunk_len, head_positions=head_positions, attn_chunk=attn_chunk)
    by = bytes_per_token(cfg, batch_tokens, True, chunk_len=chunk_len, dtype_bytes=dtype_bytes,
                         head_positions=head_positions, attn_chunk=attn_chunk)
    comps, inten, bound = {}, {}, {}
    for k in COMPONENTS:
        tc, tm = fl[k] / peak_flops, by[k] / peak_bw
        comps[k] = max(tc, tm)
        inten[k] = fl[k] / by[k] if by[k] else math.inf
        bound[k] = "compute" if tc >= tm else "memory"
    opt = optimizer_cost(cfg, optimizer, batch_tokens * accum)
    comps["optimizer"] = max(opt["flops"] / peak_flops, opt["bytes"] / peak_bw)
    bound["optimizer"] = "memory"
    comps["dispatch"] = n_ops * op_overhead_s / batch_tokens
    bound["dispatch"] = "latency"
    total = sum(comps.values())
    return {"components": comps, "intensity": inten, "bound": bound, "tok_s": 1.0 / total,
            "flops_per_token": sum(fl.values())}


def time_to_train(tokens: float, tok_s: float) -> float:
    """Seconds to train on ``tokens`` at ``tok_s``."""
    if tok_s <= 0:
        raise ValueError(f"tok_s must be positive, got {tok_s}")
    return tokens / tok_s


def active_params(cfg: FractusConfig) -> int:
    """Parameters one token uses: all but the n_experts − top_k experts it skips in each block
    (:meth:`fractus.model.FractusCTE.num_params` with ``active=True``, without building the model)."""
    d, Fd, r = cfg.d_model, cfg.expert_d_ff, cfg.expert_rank
    expert = ((2 * d * r + 2 * Fd * r + 2) if r > 0 else 2 * d * Fd) + Fd + d
    return num_params(cfg) - cfg.n_layers * (cfg.n_experts - cfg.top_k) * expert


def chinchilla_tokens(cfg: FractusConfig, per_param: float = 20.0, active: bool = False) -> float:
    """``per_param`` tokens per parameter (all parameters, or those one token uses)."""
    return per_param * (active_params(cfg) if active else num_params(cfg))


# ----------------------------------------------------------------------------- a GPU's step
OPT_STATE = {"adamw": 2, "sgd": 1, "rmsprop": 1}  # fp32 values of optimizer state per parameter


def training_memory(cfg: FractusConfig, batch_tokens: int, optimizer: str, dtype_bytes: int = 2, *,
                    chunk_len: int) -> float:
    """Bytes a micro-step of ``batch_tokens`` tokens in forwards of ``chunk_len`` positions holds
    at its peak, estimated: the fp32 parameters, their gradients and the optimizer's state, and per
    token the forward's activation traffic (:func:`bytes_per_token`'s, without the weights) as what
    the backward keeps."""
    acts = _activation_elems(cfg, chunk_len, "all", None, cfg.fused_ce)
    per_token = sum((elems - state) * dtype_bytes + state * 4 for elems, state in acts.values())
    return num_params(cfg) * 4 * (2 + OPT_STATE[optimizer]) + batch_tokens * per_token


def gpu_step(cfg: FractusConfig, *, batch_size: int, chunk_len: int, launches: int, host_op_s: float,
             accum: int = 1, optimizer: str = "sgd", head_positions: str = "all",
             peak_flops: float = H200_DATASHEET["bf16_tflops"] * 1e12, peak_bw: float = H200_DATASHEET["hbm_gbs"] * 1e9,
             dtype_bytes: int = 2) -> dict:
    """A micro-step on a GPU (by default at an H200's bf16 and HBM peaks; the optimizer's traffic
    shared by the ``accum`` micro-steps of a step): the device's work (:func:`roofline`, no per-op
    term), the host's (``launches`` × ``host_op_s``), the micro-step as the longer of the two (the
    host queues kernels ahead of the device), tok/s, MFU and the memory estimate
    (:func:`training_memory`)."""
    tokens = batch_size * chunk_len
    rf = roofline(cfg, peak_flops=peak_flops, peak_bw=peak_bw, batch_size=batch_size, chunk_len=chunk_len,
                  accum=accum, optimizer=optimizer, dtype_bytes=dtype_bytes, head_positions=head_positions)
    device_s, host_s = tokens / rf["tok_s"], launches * host_op_s
    step_s = max(device_s, host_s)
    return {"device_s": device_s, "host_s": host_s, "step_s": step_s, "bound": "host" if host_s > device_s else "device",
            "tok_s": tokens / step_s, "mfu": tokens / step_s * rf["flops_per_token"] / peak_flops,
            "memory_gb": training_memory(cfg, tokens, optimizer, dtype_bytes, chunk_len=chunk_len) / 1e9}


def h200_rows(sweep, setup, host_op_s: float, target: tuple[str, float] = ("1b", 150_000.0),
              largest: int = 1024) -> list[dict]:
    """The model's H200 column: :func:`gpu_step` for each (preset, batch sizes, chunk) of ``sweep``,
    ``setup(preset, chunk, batch)`` its training configuration (an
    :class:`fractus.bench.setup.Setup`), the launches of its micro-step counted on its GPU
    path (:func:`fractus.bench.profile.gpu_launch_count`) at ``host_op_s`` each; then, for
    ``target``'s preset, the smallest power-of-two batch up to ``largest`` whose tok/s reaches the
    target within the H200's memory (``smallest_for_target`` True; none if no batch does)."""
    launches = {preset: gpu_launch_count(setup(preset, chunk, 8)) for preset, _, chunk in sweep}
    rows = []

    def row(preset, batch, chunk, **extra):
        rec = setup(preset, chunk, batch)
        pred = gpu_step(rec.config(), batch_size=batch, chunk_len=chunk, launches=launches[preset],
                        host_op_s=host_op_s, accum=rec.accum, optimizer=rec.optimizer,
                        head_positions=rec.head_positions)
        return {"preset": preset, "batch_size": batch, "chunk_len": chunk, "launches": launches[preset],
                "host_op_us": 1e6 * host_op_s, **pred, **extra}
    for preset, batches, chunk in sweep:
        rows += [row(preset, b, chunk) for b in batches]
    preset, goal = target
    chunk = next(c for p, _, c in sweep if p == preset)
    for b in (2 ** i for i in range(int(math.log2(largest)) + 1)):
        r = row(preset, b, chunk, target_tok_s=goal)
        if r["tok_s"] >= goal and r["memory_gb"] <= H200_DATASHEET["memory_gb"]:
            rows.append({**r, "smallest_for_target": True})
            break
    else:
        rows.append({**row(preset, largest, chunk, target_tok_s=goal), "smallest_for_target": False})
    return rows

