"""What a token costs to decode: the CTE's carried state against the Transformer++'s KV cache, by
context position, and what reading a prompt costs (prefill).

Models at one preset's size (palier0 by default, weights freshly initialised: the cost does not
depend on them): the default CTE, decoding with :meth:`fractus.model.FractusCTE.step` (PyTorch
on CPU, the Triton decode kernel on CUDA); the Transformer++ at the same width and depth with a
full KV cache, with a sliding cache of its context (256), and with no cache (each token reads the
last ``context`` tokens again: :meth:`fractus.baseline.Transformer.generate`'s ``cache="none"``).

- Decode: for each batch size B and context position P, the state a model holds after P tokens,
  then the time of one more token; the CTE's step eager and through ``torch.compile`` (its
  compile time, once per batch size, is a row of kind ``compile``). The CTE's state has the
  same size at every position, so it is made once from a real 256-token prefill; the
  Transformer's cache holds P keys and values (the sliding one min(P, context)), filled with
  random numbers of the right shape — reading P real tokens first would cost minutes at P = 32,768 and change nothing in the time of the next token.
- Prefill: one prompt of T tokens read in one call: the CTE's chunked forward, the Transformer's
  causal SDPA (its cost beyond its context is what a long-context transformer pays).

Every configuration runs in one process on the same threads, in interleaved rounds (each round
times every configuration once); a row reports the median over rounds and the spread (min, max).
``python -m fractus.bench decode`` writes ``results/decode_cpu.csv`` (with provenance) and
``results/decode.png``.
"""
from __future__ import annotations

import statistics
import time

import torch

from fractus.baseline import KVCache, Transformer, TransformerConfig
from fractus.model import PRESETS, FractusConfig, FractusCTE

POSITIONS = (1, 16, 256, 1024, 4096, 16384, 32768)
PREFILL = (256, 1024, 4096, 16384, 32768)
BATCHES = (1, 16)
MODELS = ("cte", "cte, compiled", "transformer, full cache", "transformer, sliding cache", "transformer, no cache")
CONTEXT = 256  # the Transformer++'s trained context (make baseline's --chunk-len)


def build(preset: str = "palier0", vocab: int = 8192, seed: int = 0) -> tuple[FractusCTE, Transformer]:
    """The default CTE of ``preset`` and the Transformer++ of its width and depth, in eval mode."""
    torch.manual_seed(seed)
    cte = FractusCTE(FractusConfig.preset(preset, vocab_size=vocab)).eval()
    dims = {k: PRESETS[preset][k] for k in ("d_model", "n_layers")}
    tf = Transformer(TransformerConfig(vocab_size=vocab, context=CONTEXT, **dims)).eval()
    return cte, tf


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for block in state for t in block)


def synthetic_cache(tf: Transformer, batch: int, position: int, window: int | None, spare: int) -> KVCache:
    """A cache as after ``position`` tokens: min(position, window) random keys and values per
    layer (room for ``spare`` more, so the timed tokens never grow the buffers)."""
    cfg = tf.cfg
    kv = tf.new_cache("sliding" if window else "full")
    held = min(position, window) if window else position
    cap = max(held + spare, 2 * window if window else 0)
    dev = tf.embed.weight.device
    for layer in kv.layers:
        layer.keys = torch.randn(batch, cfg.n_heads, cap, cfg.head_dim, device=dev)
        layer.values = torch.randn(batch, cfg.n_heads, cap, cfg.head_dim, device=dev)
        layer.length, layer.start = held, position - held
    kv.position = position
    return kv


def decoder(name: str, cte: FractusCTE, tf: Transformer, batch: int, position: int, steps: int):
    """(one decode step as a function of nothing, the bytes of the state it carries, a function that
    puts the state back at ``position``: the cache's room holds ``steps`` tokens between two)."""
    dev = cte.embed.weight.device
    tok = torch.randint(0, cte.cfg.vocab_size, (batch,), device=dev)
    if name.startswith("cte"):  # the state is read, not replaced: every step at the same position
        with torch.no_grad():
            state = cte(torch.randint(0, cte.cfg.vocab_size, (batch, 256), device=dev))[2]
        step = compiled(cte) if name == "cte, compiled" else cte.step
        return (lambda: step(tok, state)), state_bytes(state), lambda: None
    if name == "transformer, no cache":
        window = torch.randint(0, tf.cfg.vocab_size, (batch, min(position, tf.cfg.context)), device=dev)
        return (lambda: tf(window)[0][:, -1]), 0, lambda: None
    kv = synthetic_cache(tf, batch, position, tf.cfg.context if "sliding" in name else None, spare=steps + 8)
    nbytes = kv.nbytes()
    at = [(layer.length, layer.start) for layer in kv.layers]

    def rewind():
        for layer, (length, start) in zip(kv.layers, at):
            layer.length, layer.start = length, start
        kv.position = position
    return (lambda: tf.extend(tok[:, None], kv)), nbytes, rewind


_COMPILED: dict = {}


def compiled(cte: FractusCTE):
    """``cte.compiled_step()`` (as ``generate(compile=True)``), one per model: it compiles on its
    first call for each batch size (the time ``decode_rows`` reports)."""
    key = id(cte)
    if key not in _COMPILED:
        _COMPILED.clear()
        _COMPILED[key] = cte.compiled_step()
    return _COMPILED[key]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def decode_rows(cte, tf, positions=POSITIONS, batches=BATCHES, models=MODELS, rounds: int = 5,
                steps: int = 10, min_ms: float = 100.0, max_steps: int = 200) -> list[dict]:
    """Per-token decode time (ms) of each (model, B, P): ``rounds`` interleaved rounds, in each
    round every configuration decoding tokens in a row — at least ``steps``, and more until
    ``min_ms`` have passed (at most ``max_steps``), as generation does —, its state put back at P
    before each round; after one untimed token and one untimed round."""
    dev = cte.embed.weight.device
    configs, compiles = [], []
    for b in batches:
        for p in positions:
            for m in models:
                step, nbytes, rewind = decoder(m, cte, tf, b, p, max(steps, max_steps) + 1)
                sync(dev)
                t0 = time.perf_counter()
                step()  # untimed, but for a compiled step's first call: its compile time is a row
                sync(dev)
                if m == "cte, compiled" and p == positions[0]:
                    ms = 1e3 * (time.perf_counter() - t0)
                    compiles.append({"kind": "compile", "model": m, "batch": b, "tokens": p, "ms": ms, "ms_min": ms,
                                     "ms_max": ms, "tokens_s": float("nan"), "state_bytes": 0, "rounds": 1,
                                     "threads": torch.get_num_threads()})
                configs.append(((m, b, p, nbytes), step, rewind))
    times = {key: [] for key, _, _ in configs}
    for r in range(rounds + 1):  # round 0 untimed: every configuration's memory touched once
        for key, step, rewind in configs:
            rewind()
            sync(dev)
            t0, n = time.perf_counter(), 0
            while n < steps or (n < max_steps and time.perf_counter() - t0 < min_ms / 1e3):
                step()
                n += 1
                sync(dev)
            if r:
                times[key].append((time.perf_counter() - t0) / n)
    rows = []
    for (m, b, p, nbytes), ts in times.items():
        med = statistics.median(ts)
        rows.append({"kind": "decode", "model": m, "batch": b, "tokens": p, "ms": 1e3 * med, "ms_min": 1e3 * min(ts),
                     "ms_max": 1e3 * max(ts), "tokens_s": b / med, "state_bytes": nbytes, "rounds": rounds,
                     "threads": torch.get_num_threads()})
    return rows + compiles


@torch.no_grad()
def prefill_rows(cte, tf, lengths=PREFILL, rounds: int = 3) -> list[dict]:
    """Tokens/s of reading one prompt of T tokens in one call: the CTE's chunked forward, the
    Transformer's causal SDPA (into a full cache)."""
    dev = cte.embed.weight.device
    calls = {}
    for t in lengths:
        ids = torch.randint(0, cte.cfg.vocab_size, (1, t), device=dev)
        calls[("cte", t)] = lambda ids=ids: cte(ids)
        calls[("transformer", t)] = lambda ids=ids: tf.extend(ids, tf.new_cache("full"))
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            sync(dev)
            t0 = time.perf_counter()
            call()
            sync(dev)
            times[key].append(time.perf_counter() - t0)
    return [{"kind": "prefill", "model": m, "batch": 1, "tokens": t, "ms": 1e3 * statistics.median(ts),
             "ms_min": 1e3 * min(ts), "ms_max": 1e3 * max(ts), "tokens_s": t / statistics.median(ts),
             "state_bytes": 0, "rounds": rounds, "threads": torch.get_num_threads()}
            for (m, t), ts in times.items()]


def plot(rows, path):
    """Per-token decode time and state bytes against the context position, one panel per batch
    size, and prefill tokens/s against the prompt's length; saved with provenance."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from fractus.bench.report import save_figure
    d = pd.DataFrame(rows)
    dec, pre = d[d.kind == "decode"], d[d.kind == "prefill"]
    batches = sorted(dec.batch.unique())
    fig, axes = plt.subplots(1, len(batches) + 2, figsize=(5 * (len(batches) + 2), 4))
    for ax, b in zip(axes, batches):
        for m, g in dec[dec.batch == b].groupby("model", sort=False):
            ax.loglog(g.tokens, g.ms, "o-", label=m)
            ax.fill_between(g.tokens, g.ms_min, g.ms_max, alpha=0.2)
        ax.set(title=f"decode, B = {b}", xlabel="context position", ylabel="ms per decode step")
    ax = axes[len(batches)]
    for m, g in dec[dec.batch == batches[-1]].groupby("model", sort=False):
        if g.state_bytes.max() > 0:
            ax.loglog(g.tokens, g.state_bytes / batches[-1], "o-", label=m)
    ax.set(title="state / KV cache per sequence", xlabel="context position", ylabel="bytes")
    ax = axes[-1]
    for m, g in pre.groupby("model", sort=False):
        ax.loglog(g.tokens, g.tokens_s, "o-", label=m)
    ax.set(title="prefill, one prompt", xlabel="prompt tokens", ylabel="tokens/s")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, note="results/decode_cpu.csv")


def run(out, smoke: bool = False) -> list[dict]:
    """Both measurements at palier0 (tiny sizes when ``smoke``), written to ``out/decode_cpu.csv``
    and ``out/decode.png``."""
    from pathlib import Path

    from fractus.training.records import write_csv
    if smoke:
        cte, tf = build("tiny", vocab=512)
        rows = (decode_rows(cte, tf, positions=(1, 64, 300), batches=(1, 2), rounds=2, steps=2, min_ms=10)
                + prefill_rows(cte, tf, lengths=(64, 300), rounds=1))
    else:
        cte, tf = build()
        rows = decode_rows(cte, tf) + prefill_rows(cte, tf)
    write_csv(Path(out) / "decode_cpu.csv", rows)
    plot(rows, Path(out) / "decode.png")
    return rows


def gpu_rows(device, smoke: bool = False) -> list[dict]:
    """The GPU suite's decode part: both measurements on ``device`` (the CTE's kernels by their
    default dispatch: Triton on CUDA), palier0's size and every position and batch; tiny sizes and
    two positions on a dry run."""
    eager = tuple(m for m in MODELS if m != "cte, compiled")  # on CUDA the CTE's step is the decode kernel's
    if smoke:
        cte, tf = build("tiny", vocab=512)
        cte, tf = cte.to(device), tf.to(device)
        return (decode_rows(cte, tf, positions=(1, 300), batches=(1,), models=eager, rounds=1, steps=1, min_ms=0)
                + prefill_rows(cte, tf, lengths=(64,), rounds=1))
    cte, tf = build()
    cte, tf = cte.to(device), tf.to(device)
    return decode_rows(cte, tf, models=eager, rounds=3) + prefill_rows(cte, tf, rounds=2)
