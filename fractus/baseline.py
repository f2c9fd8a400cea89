"""Transformer++: the softmax-attention transformer the Fractus CTE is measured against.

The baseline of the linear-attention literature (RetNet, GLA, DeltaNet, Mamba): pre-norm blocks of
causal multi-head softmax attention with rotary positions (RoPE) and a SwiGLU MLP, RMSNorm, no
biases, a final RMSNorm and a head tied to the embedding; Llama's / GPT-2's initialisation. It
carries no state: it reads at most ``context`` tokens at a time, and is scored on a split with
sliding windows (:func:`fractus.training.loop.evaluate_text`). Its interface is the CTE's (``forward(idx, state,
targets, head_positions)`` → (logits, parts, state), ``generate``, ``save``), so the trainer, the
evaluation and the sampler serve both (``python -m fractus.train --model transformer …``); its loss is
the same fused tied-head cross-entropy.

Shapes: B sequences, T ≤ context positions, d = d_model, H heads of D = head_dim, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from fractus.ops.common import BACKENDS
from fractus.ops.cross_entropy import linear_cross_entropy
from fractus.model import (ShortConv, _finite, _int_min, _one_of, check_fields, check_token_ids, next_token,
                           prompt_tensor, rope_tables, rotate)


@dataclass
class TransformerConfig:
    vocab_size: int = 8192
    d_model: int = 128
    head_dim: int = 32  # heads: d_model / head_dim
    n_layers: int = 2
    context: int = 256  # the longest sequence it reads (training chunk, evaluation window)
    d_ff: int = 0  # SwiGLU hidden width; 0: 8/3·d_model rounded up to a multiple of 8
    rope_base: float = 10000.0
    short_conv: int = 0  # width of a causal depthwise convolution on q, k, v, as the CTE's (0: none)
    backend: str = "auto"  # the cross-entropy kernel's backend

    def __post_init__(self):
        check_fields(self, _FIELD_CHECKS)
        if self.d_model % self.head_dim or self.head_dim % 2:
            raise ValueError(f"d_model {self.d_model} must be a multiple of head_dim {self.head_dim}, itself even (RoPE)")
        if self.short_conv == 1:
            raise ValueError("short_conv must be 0 (none) or a width ≥ 2, got 1")
        if self.d_ff == 0:  # ⌈(8/3·d) / 8⌉ · 8
            self.d_ff = -(-self.d_model // 3) * 8

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_saved(cls, d: dict) -> "TransformerConfig":
        """The config a checkpoint saved as ``d`` (missing fields: the defaults)."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys {sorted(map(str, unknown))}; the fields are {sorted(known)}")
        return cls(**d)


_FIELD_CHECKS = {  # field → (what it must be, check), as FractusConfig's
    "vocab_size": _int_min(1), "d_model": _int_min(1), "head_dim": _int_min(1), "n_layers": _int_min(1),
    "context": _int_min(1), "d_ff": _int_min(0), "short_conv": _int_min(0),
    "rope_base": ("a finite number > 1", lambda v: _finite(v) and v > 1), "backend": _one_of(*BACKENDS),
}


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.conv = ShortConv(3 * cfg.d_model, cfg.short_conv) if cfg.short_conv else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] → [B, T, d]: causal softmax attention, q and k rotated by position (q, k, v
        through a short causal convolution first when ``short_conv``)."""
        B, T, d = x.shape
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv = self.conv(qkv, None)[0]
        q, k, v = qkv.view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] → down(silu(x W_gate) ⊙ x W_up) [B, T, d]."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm_attn, self.norm_mlp = nn.RMSNorm(cfg.d_model, eps=1e-6), nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm_attn(x), cos, sin)
        return x + self.mlp(self.norm_mlp(x))


class Transformer(nn.Module):
    """Token ids [B, T] → logits [B, T, V]. Every matrix N(0, 0.02²), the residual projections
    (attention's out, the MLP's down) N(0, 0.02²/(2·n_layers)); RMSNorm scales 1."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = nn.RMSNorm(cfg.d_model, eps=1e-6)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("attn.out.weight", "mlp.down.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers) if residual else 0.02)

    def num_params(self, active: bool = False, embedding: bool = True) -> int:
        """All parameters (every one is active for every token)."""
        n = sum(p.numel() for p in self.parameters())
        return n if embedding else n - self.embed.weight.numel()

    def init_state(self, batch_size: int, device=None):
        return None

    @staticmethod
    def detach_state(state, device=None):
        return None

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, idx: torch.Tensor, state=None, targets: torch.Tensor | None = None,
                head_positions: str = "all"):
        """idx [B, T] (T ≤ context) → (logits [B, T, V], or None with targets; parts; None). parts as
        :meth:`fractus.model.FractusCTE.forward`'s (``lb`` 0, no routing); ``state`` must be None
        (this model carries none)."""
        check_token_ids(idx, self.cfg.vocab_size)
        B, T = idx.shape
        if not 1 <= T <= self.cfg.context:
            raise ValueError(f"the transformer reads 1 to {self.cfg.context} positions at a time, got {T}")
        if state is not None:
            raise ValueError("the transformer carries no state: pass state=None")
        if head_positions != "all":
            raise ValueError("the transformer supervises every position (head_positions='all')")
        cos, sin = rope_tables(T, self.cfg.head_dim, idx.device, self.cfg.rope_base)
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h, cos, sin)
        h = self.norm_f(h)
        parts = {"lb": h.new_zeros((), dtype=torch.float32), "routing": [], "loss": None, "ce": None, "n": 0}
        if targets is None:
            return F.linear(h, self.embed.weight), parts, None
        if targets.shape != (B, T):
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {(B, T)}")
        if torch.is_autocast_enabled(h.device.type):
            h = h.to(torch.get_autocast_dtype(h.device.type))
        ce = linear_cross_entropy(h.reshape(B * T, -1), self.embed.weight, targets.reshape(-1),
                                  backend=self.cfg.backend)
        parts.update(ce=ce, loss=ce, n=(targets != -100).sum())
        return None, parts, None

    def save(self, path, **extra) -> None:
        """Write config + weights (+ ``extra`` entries) atomically; :func:`fractus.training.registry.load_model` reads it."""
        from fractus.checkpoint import save_checkpoint
        save_checkpoint(path, {"arch": "transformer", "config": self.cfg.to_dict(), "model": self.state_dict(),
                               **extra})

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, repetition_penalty: float = 1.0, seed: int | None = None) -> list[int]:
        """As :meth:`fractus.model.FractusCTE.generate` (the same checks), reading the last
        ``context`` tokens at each step."""
        ids = prompt_tensor(prompt_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                            self.cfg.vocab_size, self.embed.weight.device)
        gen = torch.Generator(device=ids.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()
        was = self.training
        self.eval()
        seen = torch.zeros(self.cfg.vocab_size, dtype=torch.bool, device=ids.device)
        seen[ids] = True
        out = []
        for _ in range(max_new_tokens):
            logits = self(ids[-self.cfg.context:].view(1, -1))[0][0, -1]
            nxt = next_token(logits.float(), temperature, top_k, top_p, repetition_penalty, seen, gen)
            out.append(nxt)
            seen[nxt] = True
            ids = torch.cat([ids, ids.new_tensor([nxt])])
        self.train(was)
        return out
