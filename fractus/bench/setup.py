"""A training configuration as the benchmarks time it: :class:`Setup` (the model's switches and the
trainer's), its learning rate, and the tiny widths that FRACTUS_SMOKE runs use instead of a preset's.

The training throughput (:mod:`fractus.bench.throughput`), the profiler breakdown
(:mod:`fractus.bench.profile`), the optimization stack (:mod:`fractus.bench.optimizations`), the cost
model and the GPU suite all build their models from a :class:`Setup`; the research experiments
(:mod:`fractus.experiments.optimizations`) train and evaluate the same set-ups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fractus.model import PRESETS, FractusConfig

TABLE_LR = {"sgd": 0.1, "adamw": 2e-3, "rmsprop": 2e-3}  # the rates the optimization table is measured at
REFERENCE_TOKENS_PER_STEP = 2048  # the trainer's default step: 8 windows × 256 positions
# Model dimensions that FRACTUS_SMOKE runs use instead of a preset's: the 'tiny' preset's widths.
SMOKE_DIMS = {k: PRESETS["tiny"][k] for k in ("d_model", "n_heads", "expert_d_ff", "expert_rank",
                                              "n_oscillators", "coupling_rank")}


@dataclass(frozen=True)
class Setup:
    """One training configuration. Defaults: our reading of TRAINING_OPTIMIZATION.md's unoptimised baseline, on
    the original architecture. TRAINING_OPTIMIZATION.md states chunk 16, accumulation 1, AdamW, B=1 (4 tok/s); the
    untied head supervised on every position, every expert computed, the trained clock, vocabulary
    50257 and the unfused cross-entropy are assumed."""
    preset: str = "original-palier0"
    vocab_size: int = 50257
    tie_head: bool = False
    head_positions: str = "all"
    sparse_moe: bool = False  # False: every expert runs for every token (top_k = n_experts)
    accum: int = 1
    chunk_len: int = 16
    detach_kuramoto: bool = False
    optimizer: str = "adamw"
    batch_size: int = 1
    fused_ce: bool = False
    active_blocks: int = 0  # PGSU: blocks that get weight gradients per step (0 = all)
    compile: bool = False
    reduced_vocab: int = 8192  # the vocabulary the "reduced vocabulary" optimization switches to
    dims: tuple = field(default=())  # (key, value) config overrides, e.g. smoke-size dims

    def config(self) -> FractusConfig:
        base = FractusConfig.preset(self.preset, **dict(self.dims))
        over = dict(vocab_size=self.vocab_size, tie_head=self.tie_head, fused_ce=self.fused_ce,
                    detach_kuramoto=self.detach_kuramoto, top_k=base.top_k if self.sparse_moe else base.n_experts)
        return FractusConfig.preset(self.preset, **{**dict(self.dims), **over})

    def tokens_per_step(self) -> int:
        return self.batch_size * self.chunk_len * self.accum

    def lr(self) -> float:
        """Peak learning rate: :data:`TABLE_LR` (AdamW/RMSprop 2e-3, SGD 0.1), set for 2048 tokens
        per step, scaled by √(tokens per step / 2048). Unscaled, at the original baseline's 16
        tokens per step (vocabulary 50257), validation CE rises above a uniform guess's (12.9 vs
        10.8 nats after 32k tokens)."""
        return TABLE_LR[self.optimizer] * math.sqrt(self.tokens_per_step() / REFERENCE_TOKENS_PER_STEP)

    def trainer_kwargs(self) -> dict:
        """:func:`fractus.bench.throughput.measure_training`'s keywords for this setup (the learning
        rate, the timing and the device aside)."""
        return dict(batch_size=self.batch_size, chunk_len=self.chunk_len, accum=self.accum,
                    optimizer=self.optimizer, head_positions=self.head_positions,
                    active_blocks=self.active_blocks, compile=self.compile, **self.model_overrides())

    def model_overrides(self) -> dict:
        """The config overrides :func:`fractus.bench.throughput.measure_training` takes."""
        cfg = self.config()
        return dict(dict(self.dims), vocab_size=cfg.vocab_size, tie_head=cfg.tie_head,
                    fused_ce=cfg.fused_ce, detach_kuramoto=cfg.detach_kuramoto, top_k=cfg.top_k)
