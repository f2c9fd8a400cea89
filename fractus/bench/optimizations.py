"""TRAINING_OPTIMIZATION.md's training optimizations as set-ups, and their speed.

:data:`OPTIMIZATIONS` lists the optimizations in TRAINING_OPTIMIZATION.md's cumulative order with its
claims as data; :func:`stack` builds the cumulative setups, :func:`alone` each optimization by
itself, :func:`toggles` each one switched on and off in the combined configuration.
:func:`measure_speed` times a setup's optimizer steps (:func:`fractus.bench.throughput.measure_training`);
:func:`gpu_rows` is the GPU suite's optimizations stage (the cumulative stack in bf16 on the Triton
kernels), :func:`bf16_gain` reads its table. The CPU table, the quality runs and the verdicts are
notebook 02's (:mod:`fractus.experiments.optimizations`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import torch

from fractus.bench.common import dtype_name
from fractus.bench.setup import SMOKE_DIMS, Setup
from fractus.bench.throughput import measure_training

# (name, setup change, the document's claim as written, its claimed whole-step gain or None,
#  how many consecutive optimizations ending here that gain covers). The last three (EXPECTED) are
#  its "remaining optimizations", with expected gains; fused cross-entropy's ~1.2x names no part of
#  the step, and is read as the whole step's.
OPTIMIZATIONS = [
    ("tied head", dict(tie_head=True), "~1.1x (less optimizer state)", 1.1, 1),
    ("head-partial (1 of C positions)", dict(head_positions="last"),
     "~2x on head fwd+bwd; ~1.5x together with the tied head", 1.5, 2),
    ("gradient accumulation 8", dict(accum=8), "~1.4x", 1.4, 1),
    ("chunk_len 32", dict(chunk_len=32), "~1.1x", 1.1, 1),
    ("detached Kuramoto", dict(detach_kuramoto=True), "~1.06x (-8 ms fwd, -8 ms bwd)", 1.06, 1),
    ("sparse MoE (top-2 of all)", dict(sparse_moe=True), "~1.1x (8x less MoE work at 16 experts)", 1.1, 1),
    ("SGD instead of AdamW", dict(optimizer="sgd"), "~1.37x", 1.37, 1),
    ("batch size 8", dict(batch_size=8), "~4x (B=8 vs B=1)", 4.0, 1),
    ("reduced vocabulary", dict(vocab_size="reduced"), "3-6x on the head (proposed: 50k → 8k)", None, 1),
    ("fused cross-entropy", dict(fused_ce=True), "~1.2x (memory + launch; not implemented)", 1.2, 1),
    ("PGSU (half the blocks per step)", dict(active_blocks=-2),
     "~2x on backward (4 of 16 blocks; in its fractus1B code)", None, 1),
]
EXPECTED = tuple(name for name, *_ in OPTIMIZATIONS[-3:])  # gains the original expected, not measured
# Extra single-optimization variants shown next to the cumulative ones (speed alone from the baseline).
ALONE_EXTRA = [("chunk_len 64", dict(chunk_len=64)), ("chunk_len 128", dict(chunk_len=128)),
               ("RMSprop instead of AdamW", dict(optimizer="rmsprop"))]


def _resolve(setup: Setup, change: dict) -> Setup:
    change = dict(change)
    if change.get("active_blocks") == -2:  # half the blocks, at least one
        change["active_blocks"] = max(1, setup.config().n_layers // 2)
    if change.get("vocab_size") == "reduced":
        change["vocab_size"] = setup.reduced_vocab
    return replace(setup, **change)


def stack(base: Setup, optimizations=OPTIMIZATIONS) -> list[tuple[str, Setup]]:
    """[("baseline", base), (optimization 1, base + 1), (optimization 2, base + 1 + 2), …]."""
    out, r = [("baseline", base)], base
    for name, change, *_ in optimizations:
        r = _resolve(r, change)
        out.append((name, r))
    return out


def alone(base: Setup, optimizations=OPTIMIZATIONS, extra=ALONE_EXTRA) -> list[tuple[str, Setup]]:
    """[(optimization, base + that optimization only)] for every optimization and the extra variants."""
    return [(name, _resolve(base, change)) for name, change, *_ in list(optimizations) + list(extra)]


def toggles(base: Setup, optimizations=OPTIMIZATIONS) -> tuple[Setup, list[tuple[str, Setup, Setup]]]:
    """Each optimization switched on and off in the combined configuration (every optimization but
    the last, PGSU, stacked on ``base``): returns (combined, [(optimization, with it, without it)]).
    "Without" puts the optimization's fields back to the baseline's values; the last optimization is
    added instead."""
    combined = stack(base, optimizations[:-1])[-1][1]
    out = []
    for name, change, *_ in optimizations:
        on = _resolve(combined, change)
        off = replace(on, **{k: getattr(base, k) for k in change})
        out.append((name, on, off))
    return combined, out


def measure_speed(setup: Setup, min_tokens: int = 4096, min_steps: int = 3, warmup: int = 1,
                  device: str = "cpu", bf16: bool = False, backend: str = "auto") -> dict:
    """tok/s of ``setup``'s optimizer steps (median over ≥ ``min_steps`` and ≥ ``min_tokens``)."""
    steps = max(min_steps, math.ceil(min_tokens / setup.tokens_per_step()))
    r = measure_training(setup.preset, lr=setup.lr(), steps=steps, warmup=warmup, device=device, bf16=bf16,
                         backend=backend, **setup.trainer_kwargs())
    return {"tok_s": r["tok_s"], "step_s": r["step_s"], "steps_timed": steps, "params": r["params"]}


# -------------------------------------------------------------------------------- GPU rows
def gpu_plan(cuda: bool) -> list[tuple[str, str, Setup, bool, str]]:
    """(table, optimization, setup, bf16, backend) of each row of :func:`gpu_rows`: the cumulative
    stack (smoke dims off CUDA), then the last row in fp32 and with the PyTorch kernels."""
    opts = stack(Setup(dims=tuple(SMOKE_DIMS.items()) if not cuda else ()))
    last = opts[-1][1]
    return [("cumulative", name, r, cuda, "auto") for name, r in opts] + [
        ("variant of the last row", "fp32 (no autocast)", last, False, "auto"),
        ("variant of the last row", "PyTorch kernels instead of Triton", last, cuda, "torch")]


def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """The cumulative stack's speed on the GPU (bf16 autocast, Triton kernels), plus the fp32
    and PyTorch-kernel variants of the last row (:func:`gpu_plan`), a row at a time; for the GPU
    suite → results/gpu/optimizations.csv. With ``smoke`` (or without CUDA) it runs on CPU at smoke
    sizes in fp32 with the torch path."""
    cuda = torch.cuda.is_available() and not smoke
    device = "cuda" if cuda else "cpu"
    min_tok = 2048 if cuda else 256  # 128 steps of the B=1 baseline: the stack has 12 rows to time
    ref = last = None
    for table, name, r, bf16, backend in gpu_plan(cuda):
        m = measure_speed(r, min_tokens=min_tok, device=device, bf16=bf16, backend=backend)
        row = {"table": table, "optimization": name,
               "dtype": dtype_name(torch.bfloat16 if bf16 else torch.float32), "backend": backend, **m}
        if table == "cumulative":
            ref, last = ref or m["tok_s"], m["tok_s"]
            row["cumulative_speedup"] = m["tok_s"] / ref
        else:
            row["speedup_vs_last_row"] = m["tok_s"] / last
        yield row


def bf16_gain(table) -> float | None:
    """tok/s of :func:`gpu_rows`' last cumulative row (bf16 autocast) over its fp32 variant, from
    an optimizations table (a DataFrame); None when not measured: a dry run's table (fp32
    throughout) or a stage stopped before its fp32 row."""
    cumulative = table[table["table"] == "cumulative"]
    fp32 = table[table["optimization"] == "fp32 (no autocast)"]
    if not len(cumulative) or cumulative["dtype"].iloc[-1] != dtype_name(torch.bfloat16) or not len(fp32):
        return None
    return 1 / float(fp32["speedup_vs_last_row"].iloc[0])
