"""The gated delta rule's benchmarks: CPU training against the default, and the GPU suite's stages.

CPU (fp32, one thread): the trainer's optimizer step (AdamW, the state carried, every position
supervised) of palier0 and of palier0 with the gated delta rule in place of the linear attention's
additive update (``attn_update="delta"``, ``attn_norm="rms"``), timed in alternating rounds (the
shared machine's drift reaches both); target: the delta rule's step time ≤ the default's / 0.95
(training throughput ≥ 0.95× the default's). On the CPU the model runs the chunked PyTorch path.

GPU (bf16): at the linear attention's timed shape (:data:`fractus.verify.cases.ATTENTION_GPU`: B=8,
2 levels × 20 heads, D=64, T ∈ {512, 2048, 8192}), with β and a decay per position (the decay
gate's) and a carried state, the forward (its output compared with the PyTorch path's) and the
forward+backward: Triton vs the chunked PyTorch path (fp32 inside) and flash-linear-attention's
``chunk_gated_delta_rule`` on the same unit features (:func:`fractus.verify.cases.fla_delta_rule`);
target: Triton's forward+backward within 1.25× of fla's at T=2048. Then the decode step (B=1, T=1,
no autograd): Triton vs the PyTorch path.

Correctness: Triton (chunked with every gradient, and the decode kernel) against the reference run
in fp64 on the same rounded inputs, with a state and resets: fp32 within 1e-4, bf16 no worse than
the PyTorch path in bf16 plus 1e-2 (:func:`fractus.verify.checks.check_rows`).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from fractus.bench import common, harness
from fractus.bench.throughput import TrainingStep
from fractus.model import level_omegas
from fractus.ops.delta_rule import delta_rule
from fractus.verify import cases
from fractus.verify.cases import delta_case

SMOKE_GPU = dict(B=1, H=2, D=32, levels=2)  # the dry run's shape (Triton's interpreter on CPU), at T=40
NAMES = ("o", "S", "dq", "dk", "dv", "dw", "dbeta", "ddecay", "dS0")


def _flops(B, T, H, D, levels, backward=False):
    """Model FLOPs: the recurrent form's 6·D² per token and level·head (k̂ᵀS, the rank-one update,
    q̂ᵀS), the backward 2× the forward; the chunked kernels do more (the intra-chunk products)."""
    return (3 if backward else 1) * 6 * D * D * B * T * H * levels


def _min_bytes(B, T, H, D, levels, elt, backward=False):
    """Compulsory traffic: q, k, v read and o written once, β and γ (fp32) read once per level·head
    (the backward also reads q, k, v, dO and writes dq, dk, dv, dβ, dγ), the fp32 state read and written."""
    per_lh = 4 * B * T * H * levels
    return ((11 if backward else 4) * B * T * H * D * elt + (4 if backward else 2) * per_lh
            + 8 * B * levels * H * D * D)


# ----------------------------------------------------------------------------- CPU
VARIANTS = {"default": {}, "delta rule": dict(attn_update="delta", attn_norm="rms")}  # the configs compared


def cpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """The training step of each of :data:`VARIANTS` (palier0, 8 streams × 256 tokens; smoke: the
    tiny preset, 4 × 32), interleaved in rounds, the default the baseline."""
    preset, B, C = ("tiny", 4, 32) if smoke else ("palier0", 8, 256)

    def setup(chunk_len):
        return {p: TrainingStep(preset, batch_size=B, chunk_len=chunk_len, accum=1, optimizer="adamw", **over)
                for p, over in VARIANTS.items()}

    def call(provider, mode, steps):
        def step():
            steps[provider].forward_backward(0)
            steps[provider].update()
        return step
    target = harness.Target("delta rule", "training step time <= the default's / 0.95 (throughput >= 0.95x)",
                            lambda r: r.value("delta rule") <= r.value("default") / 0.95)
    return [harness.Bench(
        op="delta_rule", case=f"{preset} training step", x_name="chunk_len", x_values=(C,),
        providers=tuple(VARIANTS), setup=setup, call=call, modes=("train",), baseline="default",
        shape=dict(preset=preset, B=B, accum=1, optimizer="adamw"), threads=1, targets=(target,),
        timing=harness.Timing(warmup=1, reps=1, rounds=3 if smoke else 9, interleave=tuple(VARIANTS)))]


def cpu_rows(smoke: bool = False) -> list[dict]:
    """:func:`cpu_benches`' rows (:mod:`fractus.bench.harness`)."""
    return list(harness.run(cpu_benches(smoke)))


# ----------------------------------------------------------------------------- GPU
def _timed_case(shape, device):
    def setup(T):
        inputs = delta_case(T=T, dtype=torch.bfloat16, device=device, **shape)[:7]
        with torch.no_grad():  # fp32 inside: the outputs' agreement is judged against it
            truth = cases.delta("torch", *inputs)
        return inputs, truth
    return setup


def _timed_call(provider, mode, case):
    inputs, _ = case
    if mode == "fwd+bwd":
        return lambda: cases.delta_fwd_bwd(provider, *inputs)

    def forward():
        with torch.no_grad():
            return cases.delta(provider, *inputs)
    return forward


def _decode_call(provider, mode, inputs):
    def step():
        with torch.no_grad():
            cases.delta(provider, *inputs)
    return step


def gpu_benches(smoke: bool = False) -> list[harness.Bench]:
    """bf16 on CUDA (smoke: tiny, Triton's interpreter on CPU): at each length the forward and the
    forward+backward of Triton, the PyTorch path and fla, against the PyTorch path, Triton's
    forward+backward at the middle length carrying the target (within 1.25× of fla's time); then
    the decode step."""
    device, shape, Ts = ("cpu", SMOKE_GPU, (40,)) if smoke else ("cuda", cases.ATTENTION_GPU, cases.ATTENTION_TS)
    timing = harness.Timing(warmup=1, reps=2)  # CPU (smoke); CUDA: do_bench's own
    fla, fla_note = harness.peer(cases.fla_delta_rule)
    absent = {"fla": fla_note} if fla is None else {}
    B, H, D, Lv = (shape[k] for k in ("B", "H", "D", "levels"))
    elt = torch.finfo(torch.bfloat16).bits // 8
    T_target = Ts[len(Ts) // 2]

    def vs_fla(r):
        fla_s = r.value("fla")
        return f"fla {fla_note if fla is None else 'failed'}" if fla_s is None else r.value("triton") <= 1.25 * fla_s
    target = harness.Target("triton", f"fwd+bwd <= 1.25x fla's time at T={T_target}", vs_fla, mode="fwd+bwd",
                            x=T_target)
    return [
        harness.Bench(
            op="delta_rule", case="gated", x_name="T", x_values=Ts, providers=("triton", "torch", "fla"),
            modes=("fwd", "fwd+bwd"), setup=_timed_case(shape, device), call=_timed_call,
            check=lambda p, m, case, out: {"rel_err": common.rel_err(out, case[1])},
            check_modes=("fwd",), check_vs="torch", metrics=("time", "memory"), baseline="torch", shape=shape,
            dtype=torch.bfloat16, device=device, timing=timing, absent=absent, targets=(target,),
            flops=lambda T, m: _flops(B, T, H, D, Lv, m == "fwd+bwd"),
            min_bytes=lambda T, m: _min_bytes(B, T, H, D, Lv, elt, m == "fwd+bwd"),
            leaves=lambda case: case[0]),
        harness.Bench(
            op="delta_rule", case="gated", x_name="T", x_values=(1,), providers=("triton", "torch"),
            modes=("decode",), setup=lambda T: delta_case(1, T, H, D, Lv, dtype=torch.bfloat16, device=device,
                                                          grad=False)[:7],
            call=_decode_call, baseline="torch", shape=dict(B=1, H=H, D=D, levels=Lv), dtype=torch.bfloat16,
            device=device, timing=timing, flops=lambda T, m: _flops(1, T, H, D, Lv),
            min_bytes=lambda T, m: _min_bytes(1, T, H, D, Lv, elt))]


def gpu_rows(smoke: bool = False) -> Iterator[dict]:
    """:func:`gpu_benches`' rows (:mod:`fractus.bench.harness`)."""
    return harness.run(gpu_benches(smoke))


def _outputs(backend, inputs, dtype, grad):
    """o, S (+ the gradients of q, k, v, w, β, γ and S0 for a fixed random loss on o and S), on
    copies of ``inputs`` with q, k, v in dtype (the rest fp32; everything fp64 for the truth)."""
    q, k, v, w, beta, decay, st, resets = inputs
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dtype).requires_grad_(grad) for x in (q, k, v)]
    leaves += [x.detach().to(sdt).requires_grad_(grad) for x in (w, beta, decay, st)]
    with torch.set_grad_enabled(grad):
        o, S = delta_rule(*leaves[:4], level_omegas(w.numel()), *leaves[4:], resets, backend=backend)
    outs = [o, S]
    if grad:
        gen = torch.Generator().manual_seed(1)
        loss = sum((x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)).sum()
                   for x in outs)
        outs += list(torch.autograd.grad(loss, leaves))
    return outs


def correctness_rows(device, smoke: bool = False) -> Iterator[dict]:
    """Triton (chunked with every gradient, and the decode kernel) vs the fp64 reference on the
    same rounded inputs: fp32 rel_err < 1e-4; bf16 ≤ the PyTorch path's in bf16 + 1e-2. Recorded,
    never raised; yielded a case and dtype at a time."""
    device = torch.device(device)
    if smoke:
        checks = [("chunked", dict(B=2, T=40, H=2, D=48), True), ("decode", dict(B=2, T=3, H=2, D=32), False)]
    else:
        checks = [("chunked", dict(B=2, T=300, H=3, D=48), True), ("chunked", dict(B=2, T=1000, H=2, D=64), True),
                  ("decode", dict(B=2, T=1, H=3, D=64), False), ("decode", dict(B=2, T=7, H=3, D=64), False)]
    for kind, shape, grad in checks:
        for dtype in (torch.float32, torch.bfloat16):
            kernel = f"delta_rule[{kind} T={shape['T']} D={shape['D']} state, resets]"
            try:
                inputs = delta_case(**shape, resets=True, dtype=dtype, device=device, grad=False)
                got = _outputs("triton", inputs, dtype, grad)
                truth = _outputs("reference", inputs, torch.float64, grad)
                same = _outputs("torch", inputs, dtype, grad) if dtype != torch.float32 else None
                yield from common.check_rows(kernel, dtype, NAMES[:len(got)], got, truth, same, 1e-2,
                                             truth_name="fp64 reference")
            except Exception as exc:  # recorded, not raised
                yield common.error_row(kernel, dtype, exc)
