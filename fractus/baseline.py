"""Transformer++: the softmax-attention transformer the Fractus CTE is measured against.

The baseline of the linear-attention literature (RetNet, GLA, DeltaNet, Mamba): pre-norm blocks of
causal multi-head softmax attention with rotary positions (RoPE) and a SwiGLU MLP, RMSNorm, no
biases, a final RMSNorm and a head tied to the embedding; Llama's / GPT-2's initialisation. It
carries no state: it reads at most ``context`` tokens at a time, and is scored on a split with
sliding windows (:func:`fractus.training.evaluation.evaluate_text`). Its interface is the CTE's (``forward(idx, state,
targets, head_positions)`` → (logits, parts, state), ``generate``, ``save``), so the trainer, the
evaluation and the sampler serve both (``python -m fractus.train --model transformer …``); its loss is
the same fused tied-head cross-entropy.

Shapes: B sequences, T ≤ context positions, d = d_model, H heads of D = head_dim, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fractus.layers import (ShortConv, autocast_input, check_config_keys, check_fields, check_token_ids,
                            int_at_least, is_finite_number, one_of, prompt_tensor, sample_loop)
from fractus.ops.common import BACKENDS
from fractus.ops.cross_entropy import linear_cross_entropy
from fractus.ops.window_attention import rope_tables, rotate


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
        check_fields(self, FIELD_CHECKS)
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
        check_config_keys(cls, d)
        return cls(**d)


FIELD_CHECKS = {  # field → (what it must be, check), as FractusConfig's
    "vocab_size": int_at_least(1), "d_model": int_at_least(1), "head_dim": int_at_least(1),
    "n_layers": int_at_least(1), "context": int_at_least(1), "d_ff": int_at_least(0), "short_conv": int_at_least(0),
    "rope_base": ("a finite number > 1", lambda v: is_finite_number(v) and v > 1), "backend": one_of(*BACKENDS),
}


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.conv = ShortConv(3 * cfg.d_model, cfg.short_conv) if cfg.short_conv else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: "LayerCache | None" = None,
                window: int | None = None) -> torch.Tensor:
        """x [B, T, d] → [B, T, d]: causal softmax attention, q and k rotated by position (q, k, v
        through a short causal convolution first when ``short_conv``). With ``cache`` (decoding:
        cos, sin are the T new positions'), the new keys and values are appended to it and the
        queries attend to every cached position — the last ``window`` of them when given."""
        B, T, d = x.shape
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv, tail = self.conv(qkv, None if cache is None else cache.conv)
            if cache is not None:
                cache.conv = tail
        q, k, v = qkv.view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys, values, mask = cache.append(k, v, window)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class LayerCache:
    """One layer's keys and values [B, H, L, D] (rotated at their absolute positions), its short
    convolution's last inputs, and the absolute position of each held key. The buffers grow by
    doubling, so a token's append costs O(1) amortised; with a window W, keys older than the last
    W − 1 are dropped when the buffer fills (it holds at most 2W)."""

    def __init__(self):
        self.keys = self.values = self.conv = None
        self.length = 0  # keys held
        self.start = 0  # absolute position of the first held key

    def append(self, k: torch.Tensor, v: torch.Tensor, window: int | None):
        """Add T new keys and values [B, H, T, D]; (keys, values [B, H, L, D] held, boolean mask
        [T, L]: query i sees key j when j is at or before i's position and within ``window``, or
        None where that is plain causal attention over the T new keys alone)."""
        B, H, T, D = k.shape
        if self.keys is None:
            cap = max(T, 2 * window if window else 64)
            self.keys, self.values = k.new_empty(B, H, cap, D), v.new_empty(B, H, cap, D)
        if window and self.length + T > self.keys.shape[2] and self.length >= window:
            keep = window - 1  # the last W − 1 keys are all a later query can see besides its own
            self.keys[:, :, :keep] = self.keys[:, :, self.length - keep:self.length].clone()
            self.values[:, :, :keep] = self.values[:, :, self.length - keep:self.length].clone()
            self.start += self.length - keep
            self.length = keep
        if self.length + T > self.keys.shape[2]:
            cap = max(2 * self.keys.shape[2], self.length + T)
            grow = lambda t: torch.cat([t[:, :, :self.length], t.new_empty(B, H, cap - self.length, D)], 2)
            self.keys, self.values = grow(self.keys), grow(self.values)
        self.keys[:, :, self.length:self.length + T] = k
        self.values[:, :, self.length:self.length + T] = v
        self.length += T
        L = self.length
        q_pos = torch.arange(self.start + L - T, self.start + L, device=k.device)[:, None]
        k_pos = torch.arange(self.start, self.start + L, device=k.device)[None]
        mask = k_pos <= q_pos
        if window:
            mask &= q_pos - k_pos < window
        if self.start == 0 and L == T and (not window or T <= window):
            mask = None  # a first read within the window: plain causal attention, no [T, T] mask formed
        return self.keys[:, :, :L], self.values[:, :, :L], mask

    def nbytes(self) -> int:
        """The bytes of the keys and values held (not the buffers' spare room) and of the convolution's tail."""
        held = 0 if self.keys is None else 2 * self.keys[:, :, :self.length].numel() * self.keys.element_size()
        return held + (0 if self.conv is None else self.conv.numel() * self.conv.element_size())


class KVCache:
    """The Transformer++'s decoding state: a :class:`LayerCache` per block, the positions read so
    far, and the window (None: every position is kept — the full cache; W: the last W, a
    sliding cache)."""

    def __init__(self, n_layers: int, window: int | None = None):
        self.layers = [LayerCache() for _ in range(n_layers)]
        self.position = 0
        self.window = window

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


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

    def forward(self, x, cos, sin, cache: LayerCache | None = None, window: int | None = None):
        x = x + self.attn(self.norm_attn(x), cos, sin, cache, window)
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
        h = autocast_input(h)
        ce = linear_cross_entropy(h.reshape(B * T, -1), self.embed.weight, targets.reshape(-1),
                                  backend=self.cfg.backend)
        parts.update(ce=ce, loss=ce, n=(targets != -100).sum())
        return None, parts, None

    def save(self, path, **extra) -> None:
        """Write config + weights (+ ``extra`` entries) atomically; :func:`fractus.training.registry.load_model` reads it."""
        from fractus.checkpoint import save_checkpoint
        save_checkpoint(path, {"arch": "transformer", "config": self.cfg.to_dict(), "model": self.state_dict(),
                               **extra})

    # -- decoding ---------------------------------------------------------------------------
    CACHES = ("sliding", "full", "none")

    def new_cache(self, cache: str = "sliding") -> KVCache:
        """An empty decoding state: ``"full"`` keeps every position's keys and values, ``"sliding"``
        the last ``context`` (the longest span the model was trained to read)."""
        if cache not in ("sliding", "full"):
            raise ValueError(f"cache must be 'sliding' or 'full', got {cache!r}")
        return KVCache(self.cfg.n_layers, self.cfg.context if cache == "sliding" else None)

    @torch.no_grad()
    def extend(self, idx: torch.Tensor, cache: KVCache, block: int | None = None) -> torch.Tensor:
        """Read idx [B, T] after the positions ``cache`` holds (appending theirs to it): the logits
        [B, T, V], rotary positions continuing from the cache's. A prompt is read in one forward
        (a sliding cache's in blocks of its window, ``block`` to change that); decoding is T = 1."""
        check_token_ids(idx, self.cfg.vocab_size)
        B, T = idx.shape
        block = block or (cache.window if cache.window else T)
        if T > block:
            return torch.cat([self.extend(idx[:, i:i + block], cache) for i in range(0, T, block)], 1)
        cos, sin = rope_positions(cache.position, T, self.cfg.head_dim, idx.device, self.cfg.rope_base)
        h = self.embed(idx)
        for block_, layer in zip(self.blocks, cache.layers):
            h = block_(h, cos, sin, layer, cache.window)
        cache.position += T
        return F.linear(self.norm_f(h), self.embed.weight)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, repetition_penalty: float = 1.0, seed: int | None = None,
                 cache: str = "sliding") -> list:
        """As :meth:`fractus.model.FractusCTE.generate` (the same arguments, checks and batching).
        The prompt is read in one forward into a KV cache, then one token at a time: ``cache``
        "sliding" keeps the last ``context`` positions (the span the model was trained on; within it,
        the same as attending to everything), "full" every position, "none" keeps nothing and reads
        the last ``context`` tokens again for every token (what a model without a cache pays)."""
        if cache not in self.CACHES:
            raise ValueError(f"cache must be one of {self.CACHES}, got {cache!r}")
        ids, batched = prompt_tensor(prompt_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                                     self.cfg.vocab_size, self.embed.weight.device, seed)
        was = self.training
        self.eval()
        if cache == "none":
            seq = ids

            def step(tokens):
                nonlocal seq
                seq = torch.cat([seq, tokens[:, None]], 1)
                return self(seq[:, -self.cfg.context:])[0][:, -1]
            logits = self(ids[:, -self.cfg.context:])[0][:, -1]
        else:
            kv = self.new_cache(cache)
            logits = self.extend(ids, kv)[:, -1]

            def step(tokens):
                return self.extend(tokens[:, None], kv)[:, -1]
        out = sample_loop(logits, step, ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed)
        self.train(was)
        return out if batched else out[0]


def rope_positions(start: int, T: int, D: int, device, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] of positions start … start + T − 1: the rows of
    :func:`fractus.ops.window_attention.rope_tables`, without computing the ones before."""
    inv = base ** (-torch.arange(0, D, 2, device=device, dtype=torch.float64) / D)
    angle = torch.arange(start, start + T, device=device, dtype=torch.float64)[:, None] * inv
    return angle.cos().float(), angle.sin().float()
