"""A softmax-attention transformer to measure the Fractus CTE against (nanoGPT-like).

Learned positions, pre-norm blocks of causal multi-head softmax attention and a GELU MLP (4·d),
a final LayerNorm and a head tied to the embedding. It carries no state: each chunk of
``context`` tokens is read on its own. Its interface is the CTE's (``forward(idx, state, targets,
head_positions)`` → (logits, parts, state), ``generate``, ``save``/``load``), so the trainer,
the evaluation and the sampler serve both (``python -m fractus.train --model gpt …``); its loss
is the same fused tied-head cross-entropy.

Shapes: B sequences, T ≤ context positions, d = d_model, H heads, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from fractus.kernels.backend import BACKENDS
from fractus.kernels.cross_entropy import linear_cross_entropy
from fractus.model import sample


@dataclass
class GPTConfig:
    vocab_size: int = 8192
    d_model: int = 128
    n_heads: int = 2
    n_layers: int = 2
    context: int = 128  # positions of the learned position table: the longest chunk it reads
    mlp_ratio: int = 4
    backend: str = "auto"  # the cross-entropy kernel's backend

    def __post_init__(self):
        bad = [f"{f.name} must be an integer ≥ 1, got {getattr(self, f.name)!r}" for f in fields(self)
               if f.name != "backend" and not (isinstance(getattr(self, f.name), int)
                                               and not isinstance(getattr(self, f.name), bool)
                                               and getattr(self, f.name) >= 1)]
        if self.backend not in BACKENDS:
            bad.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not bad and self.d_model % self.n_heads:
            bad.append(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if bad:
            raise ValueError("bad config: " + "; ".join(bad))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys {sorted(map(str, unknown))}; the fields are {sorted(known)}")
        return cls(**d)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] → [B, T, d]."""
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(), nn.Linear(cfg.mlp_ratio * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids [B, T] → logits [B, T, V]; GPT-2's initialisation (N(0, 0.02²), residual
    projections N(0, 0.02²/(2·n_layers)), zero biases)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                residual = name.endswith("attn.out.weight") or name.endswith("mlp.2.weight")
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
        """idx [B, T] (T ≤ context) → (logits [B, T, V] or None with targets, parts, None); parts as
        :meth:`fractus.model.FractusCTE.forward`'s (``lb`` 0, no routing). ``state`` is ignored."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be a [B, T] int64 (or int32) tensor of token ids, got {idx!r:.60}")
        B, T = idx.shape
        if not 1 <= T <= self.cfg.context:
            raise ValueError(f"the transformer reads 1 to {self.cfg.context} positions at a time, got {T}")
        if head_positions != "all":
            raise ValueError("the transformer supervises every position (head_positions='all')")
        h = self.embed(idx) + self.pos.weight[:T]
        for block in self.blocks:
            h = block(h)
        h = self.ln_f(h)
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
        """Write config + weights (+ ``extra`` entries) atomically; :func:`fractus.registry.load_model` reads it."""
        from fractus.checkpoint import save_checkpoint
        save_checkpoint(path, {"arch": "gpt", "config": self.cfg.to_dict(), "model": self.state_dict(), **extra})

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, repetition_penalty: float = 1.0, seed: int | None = None) -> list[int]:
        """As :meth:`fractus.model.FractusCTE.generate`, reading the last ``context`` tokens at each step."""
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=self.embed.weight.device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("generate takes one non-empty sequence of token ids")
        gen = torch.Generator(device=ids.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()
        was = self.training
        self.eval()
        seen = torch.zeros(self.cfg.vocab_size, dtype=torch.bool, device=ids.device)
        seen[ids] = True
        out = []
        for _ in range(max_new_tokens):
            logits = self(ids[-self.cfg.context:].view(1, -1))[0][0, -1]
            nxt = sample(logits.float(), temperature, top_k, top_p, repetition_penalty, seen, gen)
            out.append(nxt)
            seen[nxt] = True
            ids = torch.cat([ids, ids.new_tensor([nxt])])
        self.train(was)
        return out
