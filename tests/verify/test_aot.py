"""Every Triton kernel compiles for sm_90 (H100/H200) with Triton's own compiler and ptxas, without
a GPU. The other kernel tests run Triton's interpreter, which accepts programs a GPU compiler
rejects; this runs ``python -m fractus.bench aot --quick --workers 2`` (real JIT kernels: no TRITON_INTERPRET),
with palier0's bf16 training step and decode step."""
import os
import subprocess
import sys
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pandas as pd

from fractus.verify import aot

OPS = ("linear_attention", "delta_rule", "moe", "cross_entropy", "kuramoto")


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "fractus.bench", "aot", "--quick", "--presets", "palier0",
                        "--workers", "2", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = pd.read_csv(tmp_path / "aot_sm90.csv")
    assert rows["compiled"].all() and rows["fits_shared"].all()
    assert (rows["target"] == "sm_90").all() and rows["registers"].between(1, 255).all()
    for op in OPS:
        got = rows[rows["op"] == op]
        assert set(got["kernel"]) == aot.kernel_names(op), op  # no kernel escaped the capture
        # the clock runs in fp32; the delta rule computes in fp32 inside: its fp16 inputs compile as
        # fp32's, and its decode kernel (no dots) as one
        dtypes = ({"float32"} if op == "kuramoto" else {"float32", "bfloat16"} if op == "delta_rule"
                  else {"float32", "bfloat16", "float16"})
        for name, g in got.groupby("kernel"):
            assert set(g["dtype"]) == ({"float32"} if name == "_dr_decode_kernel" else dtypes), (op, name)
    timed = rows[rows["op"] == "extra[timings]"]  # the GPU suite's timed launches, in bf16
    assert set(timed["kernel"]) <= set().union(*map(aot.kernel_names, OPS))
    assert {"_la_out_kernel", "_la_decode_kernel", "_dr_bwd_solve_kernel", "_dr_decode_kernel", "_lr_fwd_kernel",
            "_lce_fwd_kernel"} <= set(timed["kernel"])
    model = rows[rows["op"] == "model[palier0]"]  # a bf16 training step and a decode step
    clock = model["kernel"].str.startswith("_kuramoto")  # the clock runs in fp32 under autocast
    assert (model.loc[clock, "dtype"] == "float32").all() and (model.loc[~clock, "dtype"] == "bfloat16").all()
    assert {"_la_out_kernel", "_la_bwd_grads_kernel", "_la_decode_kernel",
                                                     "_lr_fwd_kernel", "_lr_bwd_rows_kernel", "_lce_fwd_kernel",
                                                     "_lce_bwd_dw_kernel", "_kuramoto_fwd_kernel",
                                                     "_kuramoto_bwd_kernel"} <= set(model["kernel"])


def test_aot_refuses_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "fractus.bench", "aot", "--quick", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "unset TRITON_INTERPRET" in r.stderr
    assert not (tmp_path / "aot_sm90.csv").exists()


def test_precompile_fills_the_cache_later_compiles_hit(tmp_path):
    """The GPU suite's precompile stage: parallel workers compile the captured launches into Triton's
    cache; compiling the same launches afterwards adds nothing to it (every one a cache hit)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = ("from pathlib import Path; from fractus.verify import aot\n"
            "rows = aot.precompile(2, ops=('kuramoto',), presets=(), arch=90)\n"
            "n = len(list(Path(r'%s').rglob('*.cubin')))\n"
            "aot.compile_rows(90, ops=('kuramoto',), extras=())\n"
            "print(sum(r['compiled'] for r in rows), n, len(list(Path(r'%s').rglob('*.cubin'))))" % (tmp_path, tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    compiled, before, after = map(int, r.stdout.split()[-3:])
    assert compiled == 3 and before == 3 and after == before


def test_specialisations_follow_heuristics_and_pruned_autotune_configs():
    """What precompile compiles for a launch of a kernel wrapped as fla wraps its kernels
    (heuristics around an autotuner with an early prune): the JIT function with the heuristic's
    value and each config the autotuner keeps."""
    import torch
    import triton
    import triton.language as tl
    from fractus.verify import aot

    @triton.heuristics({"HAS_B": lambda a: a["b_ptr"] is not None})
    @triton.autotune([triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32, 64) for w in (2, 4)], key=["n"],
                     prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw:
                                       [c for c in cfgs if c.kwargs["BLOCK"] <= nargs["n"]]})
    @triton.jit
    def toy_kernel(x_ptr, b_ptr, n, BLOCK: tl.constexpr, HAS_B: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))

    args = (torch.zeros(64), None, 40)
    got = list(aot._specialisations(toy_kernel, args, {}, all_configs=True))
    assert all(fn is toy_kernel.fn.fn for fn, _ in got)
    assert sorted((kw["BLOCK"], kw["num_warps"], kw["HAS_B"]) for _, kw in got) == \
        [(16, 2, False), (16, 4, False), (32, 2, False), (32, 4, False)]
    first = list(aot._specialisations(toy_kernel, args, {}, all_configs=False))
    assert [(kw["BLOCK"], kw["num_warps"]) for _, kw in first] == [(16, 2)]


def test_fla_launches_are_captured_and_compile_for_sm90():
    """The GPU suite precompiles fla's kernels with ours: the launches of its chunk_simple_gla, as
    the suite times it (each recurrence, forward and backward), are captured through fla's
    wrappers, and each compiles for sm_90 (first autotune config)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from fractus.verify import aot\n"
            "from triton.runtime.driver import driver\n"
            "L = aot.launches(ops=(), presets=(), extras=('fla',))\n"
            "driver.set_active(aot._offline_driver(90))\n"
            "n = sum(bool(fn.warmup(*l.args, grid=(1,), **kw)) for l, fn, kw in aot._compiles(L, all_configs=False))\n"
            "print(len(L), n, ' '.join(sorted({l.name for l in L})))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    captured, compiled, *names = r.stdout.split()
    assert int(captured) == int(compiled) > 0
    assert any("fwd" in n for n in names) and any("bwd" in n for n in names), names


def test_captured_launches_keep_stand_ins_that_compile_as_their_tensors():
    """A precompile worker holds every launch it captured while it compiles: a launch keeps, for
    each tensor, a two-element stand-in of its dtype, device and 16-byte alignment (an unaligned
    view's too), so the captured tensors are freed; what it compiles, and its compile keys, are those
    of the tensors themselves (a capture that keeps them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """
import gc, weakref
import torch
from fractus.verify import aot
from fractus.ops import common as backend, linear_attention as la
from fractus.model import level_omegas

def captured():
    x = torch.randn(3 * 17 * 2 * 48 + 1, requires_grad=True)
    q = x[1:].view(3, 17, 2, 48)  # one element past an aligned start
    out = []
    with aot.capture(la, "la", torch.float32, out), aot.triton_on_cpu(backend):
        o, _ = la.linear_attention(q, q * 0.5, q + 1, torch.ones(1), level_omegas(1), backend="triton")
        o.sum().backward()
    keys = {f: [aot.compile_key(L, fn, kw) for L, fn, kw in aot._compiles(out, f)] for f in (True, False)}
    tensors = [a for L in out for a in (*L.args, *(v for s in L.specs.values() for _, kw in s for v in kw.values()))
               if isinstance(a, torch.Tensor)]
    return weakref.ref(x), out, keys, tensors

ref, out, light, tensors = captured()
gc.collect()
assert ref() is None and tensors and max(t.numel() for t in tensors) <= 2
assert {t.data_ptr() % 16 == 0 for t in tensors} == {True, False}
aot.stand_in = lambda x: x
ref, out, full, tensors = captured()
assert ref() is not None and max(t.numel() for t in tensors) > 2
assert full == light and len(full[True]) > len(full[False]) > 3, (len(full[True]), len(full[False]))
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_distinct_compiles_drops_only_launches_that_compile_alike(tmp_path):
    """Precompile compiles each binary once: repeats of a launch (a preset's layers) are dropped;
    a constexpr, an argument's dtype, an integer's divisibility by 16 or a config keeps it apart.
    (Real JIT functions, as in precompile's workers: a subprocess without the interpreter.)"""
    script = tmp_path / "distinct.py"
    script.write_text("""
import torch
import triton
import triton.language as tl
from fractus.verify import aot

@triton.jit
def toy_kernel(x_ptr, n, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))

def launch(x, n, block, warps=4):
    return aot.Launch("toy", "float32", "toy_kernel", (x, n)), toy_kernel, \\
        {"BLOCK": block, "num_warps": warps}
x = torch.zeros(64)
compiles = [launch(x, 32, 16), launch(torch.zeros(128), 48, 16),  # alike: same dtype, n % 16 == 0
            launch(x, 33, 16), launch(x, 32, 32), launch(x.half(), 32, 16), launch(x, 32, 16, warps=8),
            launch(x, 1, 16)]
kept = list(aot.distinct_compiles(compiles))
print([i for i, c in enumerate(compiles) if not any(c[0] is k[0] for k in kept)])
""")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == "[1]", r.stdout


def test_precompile_covers_what_the_suite_stages_launch():
    """The GPU suite precompiles the ops' launches and ``gpu.model_runs()``: every compile that its
    stages need is among them, so that none compiles one at a time on the device. The model
    stages: the training sweep at a batch divisible by 16 with the carried state, every optimization
    setup on the Triton kernels (bf16, and the fp32 variant), every profile setup, generation. The
    kernels' checks at their full sizes (fp32 and bf16, the MoE's fp32 master experts, B=1), and
    their timings' Triton launches (forward alone and forward+backward, the attention's chunk-64
    backward, each recurrence, the decode step). The stages run on CPU with launches captured (their
    losses are garbage: nothing is launched) and bf16 matmuls computed in fp32, as the precompile's captures run; CPU autocast
    stands for CUDA's, as the model casts the kernels' inputs to the autocast dtype itself."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """
import torch
from fractus.bench import cross_entropy as ce, linear_attention as la, moe, optimizations, profile, throughput
from fractus.verify import aot, cases
from fractus.verify.cases import GEN_PROMPT
from fractus.bench.gpu import kuramoto_rows, model_runs, train_setup
from fractus.model import FractusConfig, FractusCTE
steps = throughput.micro_steps
throughput.micro_steps = lambda *a, **k: (*steps(*a, **k)[:3], True)  # captured kernels leave garbage

def keys(launches):
    return {aot.compile_key(L, fn, kw): L.name for L, fn, kw in aot._compiles(launches)}

def stage(run):
    out = []
    with aot.capture_model("stage", out), aot.Fp32Matmuls():
        run()
    return keys(out)

def generate():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        FractusCTE(FractusConfig.preset("palier0", backend="triton")).eval().generate(GEN_PROMPT, 2, temperature=0)

def timings():  # the Triton launches of each kernel's gpu_rows (the baselines launch none of ours)
    bf16, shape = torch.bfloat16, cases.ATTENTION_GPU
    for recurrence in cases.RECURRENCES:
        for T in cases.ATTENTION_TS:
            inputs = cases.timed_attention(recurrence, T=T, **shape)
            with torch.no_grad():
                cases.attention("triton", *inputs)
            for impl in ("triton", "triton_bwd64"):
                cases.attention_fwd_bwd(impl, *inputs)
        with torch.no_grad():  # the decode step
            cases.attention("triton", *cases.timed_attention(recurrence, 1, 1, shape["H"], shape["D"], shape["levels"],
                                                             grad=False))
    for N, lowrank in [(N, True) for N in cases.MOE_TOKENS] + [(cases.MOE_TOKENS[0], False)]:
        x, idx, w, ex = cases.moe_case(N, **cases.MOE_GPU, lowrank=lowrank, dtype=bf16)
        with torch.no_grad():
            moe._impl("triton")(x, idx, w, ex)
        cases.moe_fwd_bwd(moe._impl("triton"), x, idx, w, ex)
    cases.cross_entropy_fwd_bwd(ce._impl("triton"), *cases.cross_entropy_case(**cases.CROSS_ENTROPY_GPU, dtype=bf16))

pre = keys(aot.launches(presets=model_runs(), extras=("timings",)))
plan = optimizations.gpu_plan(cuda=True)
kw = dict(min_tokens=0, min_steps=1, warmup=1, device="cpu", backend="triton")
needed = {**stage(lambda: throughput.measure_training("palier0", **train_setup("palier0", 128, 64).trainer_kwargs(),
                                                   steps=1, warmup=1, device="cpu", bf16=True, backend="triton")),
          **stage(generate), **stage(timings),
          **stage(lambda: kuramoto_rows(torch.device("cpu"), False, timing=False))}
setups = [(r, bf16) for _, _, r, bf16, backend in plan if backend != "torch"]
for r, bf16 in setups + [(r, True) for _, r in profile.gpu_setups(cuda=True)]:
    needed.update(stage(lambda: optimizations.measure_speed(r, bf16=bf16, **kw)))
for bench in (la, moe, ce):
    needed.update(stage(lambda: list(bench.correctness_rows("cpu"))))
missing = sorted({n for k, n in needed.items() if k not in pre})
print(len(needed), len(pre), "missing:", missing)
assert not missing and len(needed) > 100
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_fp32_matmuls_capture_the_same_launches():
    """Captures compute bf16 matmuls in fp32 (``aot.Fp32Matmuls``: bf16 GEMMs without bf16 units
    are ~130× slower): a bf16 training step (two micro-steps, the state carried) and a decode step
    launch the same kernels with the same compile keys either way; the values are fp32's rounded.
    What would not run in bf16 (fp64, ``out=``, a mix that raises) runs as without it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """
import contextlib

import torch
import torch.nn.functional as F
from fractus.verify import aot

def captured(fast):
    out = []
    with aot.capture_model("m", out), (aot.Fp32Matmuls() if fast else contextlib.nullcontext()):
        aot._run_model("palier0", steps=2, batch_size=4, chunk_len=48)
    return [(L.name, aot.compile_key(L, fn, kw)) for L, fn, kw in aot._compiles(out)]
fast, slow = captured(True), captured(False)
assert fast == slow and len(fast) > 30, (len(fast), len(slow))
x, w = torch.randn(5, 48), torch.randn(24, 48)
with aot.Fp32Matmuls(), torch.autocast("cpu", dtype=torch.bfloat16):
    y = F.linear(x, w)
assert y.dtype == torch.bfloat16 and torch.equal(y, F.linear(x.bfloat16().float(), w.bfloat16().float()).bfloat16())
with aot.Fp32Matmuls():
    assert (x @ w.T).dtype == torch.float32 and (x.bfloat16() @ w.bfloat16().T).dtype == torch.bfloat16
    try:  # a mix that raises without autocast still raises
        x.bfloat16() @ w.T
        raise AssertionError("bf16 @ fp32 ran")
    except RuntimeError:
        pass
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x.double() @ w.double().T).dtype == torch.float64  # not what autocast lowers
        buf = torch.empty(5, 24)
        assert torch.mm(x, w.T, out=buf) is buf  # filled in place, as without the mode
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_the_offsets_checks_precompile_at_sizes_specialised_alike():
    """The GPU suite's checks past 2³¹ elements are precompiled at small sizes (:func:`offsets._long`):
    captured there, they launch every kernel of the four ops, and the attention's case compiles
    the same 5 kernels at its full size (inputs from ``torch.empty``, never touched: nothing runs) as
    at that small one (the states kernel twice: the forward's chunks and the backward's), and other
    kernels at a size of another class (16: divisible by 16)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """
import torch
from fractus.verify import aot, offsets
from fractus.ops import common as backend, linear_attention as la
from fractus.model import level_omegas
names = {L.name for L in aot.launches(ops=(), extras=("offsets",))}
# the delta rule's fp32 intermediates past 2³¹ need ~120 GB: its offsets are checked in the interpreter only
assert names == set().union(*(aot.kernel_names(op) for op in aot.OPS if op != 'delta_rule')), names

def keys(B, make):
    out = []
    with aot.capture(la, "la", torch.bfloat16, out), aot.triton_on_cpu(backend):
        q, k, v = (make(B, 128, 2, 32).requires_grad_() for _ in range(3))
        o, _ = la.linear_attention(q, k, v, torch.ones(1), level_omegas(1), decay=torch.full((2,), 0.9),
                                   backend="triton")
        o.backward(make(B, 128, 2, 32))
    return {aot.compile_key(L, fn, kw) for L, fn, kw in aot._compiles(out, all_configs=False)}
full = offsets._past(128 * 2 * 32)
small = keys(offsets._long(full, "capture", 0), lambda *s: torch.randn(*s).bfloat16())
assert len(small) == 5 and keys(full, lambda *s: torch.empty(*s, dtype=torch.bfloat16)) == small
assert keys(16, lambda *s: torch.randn(*s).bfloat16()) != small
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_precompile_stops_workers_that_outlive_its_timeout():
    """A stuck worker must not hold the GPU suite: after ``timeout_s`` the workers are stopped, a
    row says so, and the process goes on (and exits)."""
    code = ("import time; from fractus.verify import aot\n"
            "t = time.time(); rows = aot.precompile(2, ops=('kuramoto',), presets=(), arch=90, timeout_s=0.5)\n"
            "print(len(rows), sum(r['errors'] == 'stopped after 0 s' for r in rows), round(time.time() - t))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    n, stopped, seconds = map(int, r.stdout.split()[-3:])
    assert n == 2 and stopped == 2 and seconds < 10


def test_precompile_keeps_the_rows_of_workers_beside_one_that_died():
    """A worker that dies (killed, out of memory) breaks the pool: the rows of the workers that had
    finished stay, and the others say why they have none instead of failing the whole stage."""
    ok, broken, stuck = Future(), Future(), Future()
    ok.set_result({"worker": 0, "compiled": 12, "failed": 0, "errors": "", "seconds": 3.0})
    broken.set_exception(BrokenProcessPool("a process in the process pool was terminated abruptly"))
    rows = [aot._worker_row(0, ok, True, 200), aot._worker_row(1, broken, True, 200),
            aot._worker_row(2, stuck, False, 200)]
    assert rows[0]["compiled"] == 12
    assert rows[1]["compiled"] is None and rows[1]["errors"].startswith("BrokenProcessPool: a process")
    assert rows[2]["compiled"] is None and rows[2]["errors"] == "stopped after 200 s"
