"""End-to-end training throughput: tokens/s and peak memory of optimizer steps.

Steps are the trainer's own (:func:`fractus.training.steps.micro_steps`) on random tokens, so the
numbers measure the model, the kernels and the optimizer, not the data pipeline.
"""
from __future__ import annotations

import time

import torch

from fractus.bench.common import cpu_ceilings, in_fresh_process, sync
from fractus.model import FractusConfig, FractusCTE
from fractus.training.optim import make_optimizer
from fractus.training.steps import micro_steps, set_active_blocks


def random_batches(g: torch.Generator, vocab_size: int, batch_size: int, chunk_len: int, accum: int):
    """``accum`` micro-batches of uniform random tokens as :func:`fractus.training.steps.micro_steps` takes
    them: (x [B, C], next tokens y [B, C], False: no stream reset)."""
    for _ in range(accum):
        x = torch.randint(0, vocab_size, (batch_size, chunk_len + 1), generator=g)
        yield x[:, :-1], x[:, 1:], False


class TrainingStep:
    """The trainer's optimizer step on random tokens: ``forward_backward(i)`` runs step ``i``'s
    micro-steps (:func:`fractus.training.steps.micro_steps`, the state carried from the step before; with
    ``active_blocks``, PGSU's blocks for step ``i``) and says whether their loss was finite,
    ``update()`` the optimizer's step; ``config`` and ``model`` are the model's."""

    def __init__(self, preset: str, *, batch_size: int = 8, chunk_len: int = 32, accum: int = 8,
                 optimizer: str = "sgd", lr: float = 1e-3, head_positions: str = "all", active_blocks: int = 0,
                 bf16: bool = False, compile: bool = False, device: str = "cpu", seed: int = 0, **overrides):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.config = FractusConfig.preset(preset, **overrides)
        with self.device:  # initialised where it runs (a 1B model's CPU init takes seconds)
            self.model = FractusCTE(self.config)
        self.opt = make_optimizer(self.model, optimizer, lr, 0.0)
        self.fwd = torch.compile(self.model) if compile else self.model
        g = torch.Generator().manual_seed(seed)
        self.batches = lambda: random_batches(g, self.config.vocab_size, batch_size, chunk_len, accum)
        self.accum, self.head_positions, self.active_blocks, self.bf16, self.seed = (
            accum, head_positions, active_blocks, bf16, seed)
        self.state = None

    def forward_backward(self, i: int) -> bool:
        if self.active_blocks:
            set_active_blocks(self.model, self.active_blocks, self.seed, i)
        _, _, self.state, finite = micro_steps(self.fwd, self.batches(), self.state, self.accum,
                                               self.head_positions, self.device, self.bf16)
        return finite

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def measure_training(preset: str = "palier0", *, batch_size: int = 8, chunk_len: int = 32,
                     accum: int = 8, optimizer: str = "sgd", lr: float = 1e-3,
                     head_positions: str = "all", active_blocks: int = 0, bf16: bool = False,
                     compile: bool = False, steps: int = 3, warmup: int = 1, device: str = "cpu",
                     seed: int = 0, **overrides) -> dict:
    """Median seconds per optimizer step (:class:`TrainingStep`; also the fastest and slowest timed
    step) and tokens/s; ``overrides`` go to the config. On CUDA also the peak memory allocated during
    the timed steps (``peak_mem_bytes``: the statistics are reset after the warm-up, whose
    autotuning allocates scratch buffers the model never holds)."""
    device = torch.device(device)
    step = TrainingStep(preset, batch_size=batch_size, chunk_len=chunk_len, accum=accum, optimizer=optimizer,
                        lr=lr, head_positions=head_positions, active_blocks=active_blocks, bf16=bf16,
                        compile=compile, device=device, seed=seed, **overrides)
    times = []
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        finite = step.forward_backward(i)
        step.update()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if not finite:
            raise RuntimeError(f"non-finite loss while benchmarking {preset} {overrides}")
    times.sort()
    step_s = times[len(times) // 2]
    tokens = batch_size * chunk_len * accum
    return {"preset": preset, "vocab_size": step.config.vocab_size, "batch_size": batch_size,
            "chunk_len": chunk_len, "accum": accum, "optimizer": optimizer,
            "head_positions": head_positions, "active_blocks": active_blocks or step.config.n_layers,
            "bf16": bf16, "compile": compile, "params": step.model.num_params(),
            "step_s": step_s, "step_s_min": times[0], "step_s_max": times[-1], "tok_s": tokens / step_s,
            "tok_s_best": tokens / times[0], "steps_timed": steps,
            **({"peak_mem_bytes": torch.cuda.max_memory_allocated(device)} if device.type == "cuda" else {}),
            **{k: v for k, v in overrides.items()}}


CPU_TARGETS = [  # (preset, vocab, target tok/s) the CPU targets; B=8, C=32, SGD, accum 8
    ("palier0", 50257, 2000.0),
    ("palier2", 50257, 300.0),
    ("palier0", 8192, 8000.0),
]
# two of the training optimizations of the original's optimized configuration
ORIGINAL_OPTIMIZATIONS = dict(head_positions="last", detach_kuramoto=True)


def cpu_rows(smoke: bool = False, runs: int = 3) -> list[dict]:
    """Each target in the project's default setting (every position supervised, the clock
    trained); the same cases for the original architecture (presets ``original-<name>``, no
    target), so that ``vs_original``, a default row's tok/s over its original's from the same
    run, says what the default's levers cost in speed whatever this machine's speed today; then
    original-palier0 with the original's head-partial and detached clock, for comparison with
    its published figures. Every case is measured in ``runs`` separate processes, as training
    runs (the cases taken in turn, so a drift of the shared machine's speed reaches all of
    them); ``tok_s`` is the median over runs of each run's median step, the target is judged on
    it, ``tok_s_runs`` lists the runs. ``matmul_gflops_start`` / ``_end``: this CPU's fp32
    matmul speed before and after all runs."""
    cases = ([(p, v, t, {}) for p, v, t in CPU_TARGETS]
             + [(f"original-{p}", v, None, {}) for p, v, _ in CPU_TARGETS]
             + [("original-palier0", v, None, ORIGINAL_OPTIMIZATIONS) for v in (50257, 8192)])
    runs = 1 if smoke else runs
    n = 512 if smoke else 1024
    start = cpu_ceilings(n=n)["matmul_flops"] / 1e9
    measured = [[] for _ in cases]
    for _ in range(runs):
        for (preset, vocab, _, opts), out in zip(cases, measured):
            kw = dict(vocab_size=vocab)
            if smoke:
                kw.update(d_model=64, n_heads=1, n_layers=1, expert_d_ff=64, vocab_size=min(vocab, 1024))
            lv = dict(opts)
            hp = lv.pop("head_positions", "all")
            out.append(in_fresh_process("fractus.bench.throughput:measure_training", preset=preset,
                                        steps=1 if smoke else 7, accum=2 if smoke else 8, head_positions=hp,
                                        **kw, **lv))
    end = cpu_ceilings(n=n)["matmul_flops"] / 1e9
    rows = []
    for (_, _, target, opts), out in zip(cases, measured):
        out.sort(key=lambda r: r["tok_s"])
        r = dict(out[len(out) // 2])
        r.update(runs=len(out), tok_s_runs=";".join(f"{x['tok_s']:.0f}" for x in out),
                 tok_s_best=max(x["tok_s_best"] for x in out),
                 detach_kuramoto=bool(opts.get("detach_kuramoto")), target_tok_s=target,
                 meets_target=None if target is None else r["tok_s"] >= target,
                 matmul_gflops_start=start, matmul_gflops_end=end)
        rows.append(r)
    key = lambda r: (r["preset"].removeprefix("original-"), r["vocab_size"], r["head_positions"], r["detach_kuramoto"])
    originals = {key(r): r["tok_s"] for r in rows if r["preset"].startswith("original-")}
    for r in rows:
        if not r["preset"].startswith("original-"):
            r["vs_original"] = r["tok_s"] / originals[key(r)]
    return rows
