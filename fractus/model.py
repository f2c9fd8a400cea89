"""The Fractus CTE language model (the math: ``docs/model.md``).

A stack of pre-norm blocks, each: multi-level causal linear attention with a carried state
per (level, head) → a Kuramoto phase clock integrated per token → phase-routed top-k sparse
low-rank experts (beside a dense shared expert when ``shared_expert`` > 0, off by default). Tied head behind a
final LayerNorm. The only state that crosses positions is each block's attention state
(:data:`State`): (S, z) per (level, head) and, when the config has them, the short convolution's
last inputs and the window level's last keys and values with their presence; so ``forward`` over a
chunk and ``step`` token by token compute the same logits. The blocks' layers: :mod:`fractus.layers`.

:class:`FractusConfig` holds the dimensions and the levers; :data:`RECIPE` is the default
architecture, :data:`ORIGINAL` the original one (presets ``original-<name>``).

Shapes: B rows (batch), T positions, d = d_model, H heads of D, Lv levels, E experts, K = top_k.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from fractus.layers import (BOOLEAN, NON_NEGATIVE, POSITIVE, Block, autocast_input, check_config_keys, check_fields,
                            check_token_ids, int_at_least, is_decay, load_balance, one_of, prompt_tensor, sample_loop)
# the model's constants that live beside the layers using them, importable from here too
from fractus.layers import PHI, farey_phases, level_omegas  # noqa: F401
from fractus.ops.common import BACKENDS
from fractus.ops.cross_entropy import linear_cross_entropy

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
        check_fields(self, FIELD_CHECKS)
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
        check_config_keys(cls, d)
        return cls(**{**ORIGINAL, **d})


# Keys a checkpoint's saved config may name that are training settings, not the model's (the
# trainer records its own in the checkpoint's ``args``): FractusConfig.from_saved ignores them.
TRAINING_KEYS = ("chunk_len",)


FIELD_CHECKS = {  # field → (what it must be, check)
    "vocab_size": int_at_least(1), "d_model": int_at_least(1), "n_heads": int_at_least(1),
    "n_layers": int_at_least(1), "n_levels": int_at_least(1),
    "attn_decay": ("a number in (0, 1], a list of one per head or per (level, head), or 'multiscale'",
                   lambda v: is_decay(v) or v == "multiscale" or isinstance(v, (list, tuple)) and all(map(is_decay, v))),
    "attn_norm": one_of("denominator", "rms"), "attn_update": one_of("add", "delta"), "decay_gate": BOOLEAN,
    "attn_gate": BOOLEAN, "short_conv": int_at_least(0), "qk_norm": BOOLEAN,
    "eot_reset": BOOLEAN, "attn_window": int_at_least(0),
    "shared_expert": int_at_least(0), "expert_init_std": POSITIVE,
    "n_experts": int_at_least(1), "top_k": int_at_least(1), "expert_d_ff": int_at_least(1),
    "expert_rank": int_at_least(0),
    "n_oscillators": int_at_least(1), "coupling_rank": int_at_least(1), "kuramoto_steps": int_at_least(1),
    "kuramoto_dt": POSITIVE, "kuramoto_damping": NON_NEGATIVE, "detach_kuramoto": BOOLEAN,
    "router": one_of("phase", "linear"), "gate_kappa": POSITIVE, "gate_tau": POSITIVE,
    "lb_coef": NON_NEGATIVE, "tie_head": BOOLEAN, "fused_ce": BOOLEAN,
    "eps": POSITIVE, "backend": one_of(*BACKENDS),
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
            for name, t, want in zip(names, s, self.state_shapes(batch_size)):
                if tuple(t.shape) != want:
                    raise ValueError(f"block {i}'s {name} has shape {tuple(t.shape)}, this model's is {want}: the "
                                     f"state of another model (or config) cannot be carried into this one")
                if not t.is_floating_point():
                    raise ValueError(f"block {i}'s {name} is {t.dtype}: a state holds floating-point tensors")
                if t.device != self.embed.weight.device:
                    raise ValueError(f"block {i}'s {name} is on {t.device}, the model on {self.embed.weight.device}: "
                                     f"move the state (detach_state(state, device)) or the model")

    def state_shapes(self, batch_size: int) -> list[tuple]:
        """The shapes of one block's state tensors for ``batch_size`` rows (:meth:`init_state`'s)."""
        c, B, P = self.cfg, batch_size, self.cfg.attn_window - 1
        return ([(B, c.n_levels, c.n_heads, c.d_head, c.d_head), (B, c.n_levels, c.n_heads, c.d_head)]
                + [(B, c.short_conv - 1, 3 * c.d_model)] * bool(c.short_conv)
                + [(B, P, c.n_heads, c.d_head)] * 2 * bool(c.attn_window) + [(B, P)] * bool(c.attn_window))

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
        idx = self._step_input(token, state)
        if idx.shape[0] == 0:  # no rows: forward's empty logits, the empty state carried on
            logits, _, state = self.forward(idx, state)
            return logits[:, 0], state
        return self._decode(idx, state)

    def compiled_step(self):
        """:meth:`step` with its blocks through ``torch.compile`` (one graph; compiled on the first
        call for each batch size and device: seconds on a CPU), the inputs checked as ``step``
        checks them, outside the graph."""
        core = torch.compile(self._decode, dynamic=False)

        @torch.no_grad()
        def step(token, state):
            idx = self._step_input(token, state)
            if idx.shape[0] == 0:
                return self.step(token, state)
            return core(idx, state)
        return step

    def _step_input(self, token, state) -> torch.Tensor:
        """token [B] → ids [B, 1], once token and state are checked."""
        if not torch.is_tensor(token) or token.dim() != 1:
            raise ValueError(f"step takes token ids as a [B] tensor (one per row), got "
                             f"{tuple(token.shape) if torch.is_tensor(token) else type(token).__name__}")
        idx = token.view(-1, 1)
        if idx.shape[0]:
            self.check_tokens(idx)
            if state is not None:
                self.check_state(state, idx.shape[0])
        return idx

    def _decode(self, idx, state):
        """The blocks as forward runs them on ids [B, 1], without what only training reads (routing,
        load balance) and without checks → (logits [B, V], new state)."""
        resets = idx == self.cfg.vocab_size - 1 if self.cfg.eot_reset else None
        h, new_state = self.embed(idx), []
        for i, block in enumerate(self.blocks):
            h, s, _, _ = block(h, None if state is None else state[i], resets)
            new_state.append(s)
        return self.logits(self.ln_f(h))[:, 0], new_state

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
                 repetition_penalty: float = 1.0, seed: int | None = None, compile: bool = False) -> list:
        """Prefill the prompts with the chunked forward, then sample tick by tick, the state carried.

        prompt_ids: one sequence of token ids (a list or a [T] tensor), or a batch of B of one
        length (a list of lists or a [B, T] tensor). temperature ≥ 0, 0 is greedy.
        repetition_penalty > 1 divides positive (multiplies negative) logits of tokens already in
        the context. Row i samples with seed ``seed + i`` (:func:`fractus.layers.sample_loop`).
        ``compile``: each tick through ``torch.compile`` (compiled once per batch size and device:
        seconds on a CPU, then fewer, fused kernels a token; ``python -m fractus.bench decode``
        measures both). Returns the max_new_tokens new ids: a list[int] for one sequence, a list
        of B lists for a batch.
        """
        ids, batched = prompt_tensor(prompt_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                                     self.cfg.vocab_size, self.embed.weight.device, seed)
        was_training = self.training
        self.eval()
        logits, _, state = self.forward(ids)
        tick = self.compiled_step() if compile else self.step

        def step(tokens):
            nonlocal state
            logits, state = tick(tokens, state)
            return logits
        out = sample_loop(logits[:, -1], step, ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                          seed)
        self.train(was_training)
        return out if batched else out[0]

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
