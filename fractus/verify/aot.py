"""Every Triton kernel compiled ahead of time for an NVIDIA GPU, on a machine without one.

``python -m fractus.bench aot --out results`` runs the Triton path of each op, and each preset's
bf16 training and decode steps, on CPU tensors with the kernel launches captured instead of
executed, then compiles every captured launch, for every
autotune config, for the target (sm_90: H100/H200) with Triton's own compiler and bundled
``ptxas``: the same source, specialisation and options a GPU run would compile. Each row says
whether it compiled and what the compiled kernel needs: registers per thread, spill bytes,
shared memory (against the target's per-block limit). The interpreter accepts programs a GPU
compiler rejects; this catches those before any GPU time is spent. It does not run anything:
correctness and speed still need the device (``python -m fractus.bench gpu``).

Run it with ``TRITON_INTERPRET`` unset (the CLI checks): the kernels must be real JIT functions.
The table also compiles the GPU suite's timed launches (the extra ``timings``: each kernel at the
shapes and in the variants its timings run, :mod:`fractus.verify.cases`). :func:`precompile`
compiles the same captured launches in parallel processes into Triton's on-disk cache, for the GPU
at hand: a stage of the GPU suite before its checks, with what its stages launch beyond the ops'
own (:data:`EXTRAS`: the timings, the checks at offsets past 2³¹ elements, and fla's kernels when it
is installed, so that its autotuning loads binaries too).
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

SHARED_LIMIT = {90: 232448}  # bytes of shared memory one block may use (sm_90: 227 KiB)
# the ops' input dtypes the GPU suite runs (and so precompiles), and those the table compiles: fp16
# too, which the kernels accept (their state dots then run in tf32) but no GPU run checks
SUITE_DTYPES = (torch.float32, torch.bfloat16)
TABLE_DTYPES = SUITE_DTYPES + (torch.float16,)


@dataclass
class Launch:
    """One captured kernel launch: its positional arguments, each tensor as a :func:`stand_in`, and
    ``specs[all_configs]``: the (JIT function, keyword arguments, its own among them) it compiles,
    resolved through the kernel's wrappers with the real arguments when captured
    (:func:`_specialisations`); ``name`` is the kernel's, ``dtype`` the op's input dtype."""
    op: str
    dtype: str
    name: str
    args: tuple
    specs: dict = field(default_factory=dict)


def stand_in(x):
    """``x`` (an argument, or a tuple or dict of them) with each tensor replaced by a two-element
    tensor of its dtype, device and 16-byte alignment: all that a compile sees of it. Captured launches
    keep these, not the tensors (a worker's capture would otherwise hold every step's
    activations: 10 GB of them at once)."""
    if isinstance(x, tuple):
        return tuple(stand_in(a) for a in x)
    if isinstance(x, dict):
        return {k: stand_in(v) for k, v in x.items()}
    if not isinstance(x, torch.Tensor):
        return x
    s = torch.empty(2, dtype=x.dtype, device=x.device)[(0 if x.data_ptr() % 16 == 0 else 1):]
    assert (s.data_ptr() % 16 == 0) == (x.data_ptr() % 16 == 0), x.dtype
    return s


def _offline_driver(arch: int):
    """A Triton driver that reports ``arch`` as the current target and cannot launch."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class OfflineDriver(DriverBase):
        def __init__(self):
            pass

        def is_active(self):
            return True

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_benchmarker(self):
            raise RuntimeError("compiling ahead of time: nothing can be launched")

    return OfflineDriver()


def kernels_of(module) -> dict:
    """The Triton kernels ``module`` defines, by name (JIT, autotuned and interpreted alike)."""
    from triton.runtime.jit import KernelInterface
    return {n: k for n, k in vars(module).items() if isinstance(k, KernelInterface) and "kernel" in n}


def with_submodules(module) -> list:
    """``module`` and, for a package, every submodule of it loaded so far (an op's kernels live in
    ``fractus.ops.<op>.kernels``, which the op's package imports)."""
    prefix = module.__name__ + "."
    return [module] + [m for n, m in list(sys.modules.items()) if n.startswith(prefix) and m is not None]


def kernel_names(op: str) -> set[str]:
    """The names of ``fractus.ops.<op>``'s Triton kernels: what a complete capture of the op compiles."""
    return {n for m in with_submodules(importlib.import_module(f"fractus.ops.{op}")) for n in kernels_of(m)}


@contextmanager
def capture(module, op: str, dtype: torch.dtype, launches: list[Launch]):
    """Replace every Triton kernel of ``module`` (and of its submodules: :func:`with_submodules`) by a
    recorder of its launches (nothing runs: outputs stay as allocated)."""

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                specs = {flag: [(fn, stand_in(kw)) for fn, kw in _specialisations(self.kernel, args, kwargs, flag)]
                         for flag in (True, False)}
                launches.append(Launch(op, str(dtype).replace("torch.", ""), self.name, stand_in(args), specs))
            return record

    kernels = [(m, n, k) for m in with_submodules(module) for n, k in kernels_of(m).items()]
    try:
        for m, n, k in kernels:
            setattr(m, n, Recorder(n, k))
        yield
    finally:
        for m, n, k in kernels:
            setattr(m, n, k)


def _run_linear_attention(dtype):
    """The chunked path forward and backward (the loss on the final state too, or on the output
    alone as in training and the timings; at B=1, an integer Triton specialises; a decay per
    (level, head) with and without the denominator; a decay per position, its gradient too), its
    forward without gradients, and the decode kernel (with and without the denominator, and with a
    decay per position)."""
    from fractus.ops import linear_attention as la
    from fractus.model import level_omegas
    from fractus.verify.cases import attention_case
    H, D, Lv = 8, 64, 2
    # (B, T, decay and a carried state, the loss on the final state)
    for B, T, carried, on_state in ((2, 2048, False, True), (2, 2048, False, False), (1, 2048, False, False),
                                    (2, 100, True, True)):
        q, k, v, w, g, st = attention_case(B, T, H, D, Lv, decay=carried, state=carried, dtype=dtype)
        o, (S, z) = la.linear_attention_triton(q, k, v, w, level_omegas(Lv), g, st, 1e-6)
        (o.float().sum() + (S.sum() + z.sum() if on_state else 0)).backward()
    for normalize, on_state in ((True, True), (False, True), (False, False)):  # a decay per (level, head)
        q, k, v, w, g, st = attention_case(2, 300, 3, D, Lv, decay="level", state=True, dtype=dtype)
        o, (S, z) = la.linear_attention_triton(q, k, v, w, level_omegas(Lv), g, st, 1e-6, normalize)
        (o.float().sum() + (S.sum() + z.sum() if on_state else 0)).backward()
    for decay in (False, True):  # a carried state without decay and with one (the decay's strides specialise)
        q, k, v, w, g, st = attention_case(2, 200, 2, D, Lv, decay=decay, state=True, dtype=dtype)
        o, (S, z) = la.linear_attention_triton(q, k, v, w, level_omegas(Lv), g, st, 1e-6)
        (o.float().sum() + S.sum() + z.sum()).backward()
    for B, T in ((2, 300), (2, 40)):  # a decay per position, the gate's: its gradient too
        q, k, v, w, g, st = attention_case(B, T, 3, D, Lv, decay="position", dtype=dtype)
        o, _ = la.linear_attention_triton(q, k, v, w, level_omegas(Lv), g.requires_grad_(), st, 1e-6)
        o.float().sum().backward()
    for T in (512, 2048):  # the forward alone, with a chunk count divisible by 16 and one not
        q, k, v, w, g, st = attention_case(2, T, H, D, Lv, dtype=dtype, grad=False)
        la.linear_attention_triton(q, k, v, w, level_omegas(Lv), g, st, 1e-6)
    for T, normalize in ((1, True), (5, True), (1, False)):  # decode: one token and a short prefix
        q, k, v, w, g, st = attention_case(2, T, H, D, Lv, state=True, dtype=dtype, grad=False)
        la.linear_attention_triton(q, k, v, w, level_omegas(Lv), g, st, 1e-6, normalize)
    for T, decay, normalize in ((3, "position", True), (7, "position", True), (1, True, True), (7, True, True),
                                (1, "level", False)):  # decode with each kind of decay
        q, k, v, w, g, st = attention_case(2, T, 3, D, Lv, decay=decay, state=True, dtype=dtype, grad=False)
        la.linear_attention_triton(q, k, v, w, level_omegas(Lv), g, st, 1e-6, normalize)


def _run_delta_rule(dtype):
    """The gated delta rule's chunked kernels forward and backward (a state and resets, a decay
    per position; without them; the loss on the output alone, as in training), the forward without
    gradients, and the decode kernel (with resets and without)."""
    from fractus.ops.delta_rule import delta_rule_triton
    from fractus.model import level_omegas
    from fractus.verify.cases import delta_case
    H, D, Lv = 8, 64, 2
    for B, T, carried in ((2, 2048, True), (2, 300, False), (1, 2048, False)):
        q, k, v, w, beta, decay, st, r = delta_case(B, T, H, D, Lv, state=carried, resets=carried, dtype=dtype)
        o, S = delta_rule_triton(q, k, v, w, level_omegas(Lv), beta, decay, st, r)
        (o.float().sum() + (S.sum() if carried else 0)).backward()
    with torch.no_grad():
        for T, resets in ((2048, False), (1, False), (7, True)):
            q, k, v, w, beta, decay, st, r = delta_case(2, T, H, D, Lv, resets=resets, dtype=dtype, grad=False)
            delta_rule_triton(q, k, v, w, level_omegas(Lv), beta, decay, st, r)


def _run_moe(dtype):
    """Low-rank and dense experts forward and backward, in the tokens' dtype and (below fp32) as
    the fp32 masters the model passes under autocast; and the forward alone."""
    from fractus.ops import moe
    from fractus.verify.cases import moe_case
    for lowrank, d, E, F, r in ((True, 1280, 16, 2048, 64), (False, 512, 8, 512, 0)):
        x, idx, w, ex = moe_case(300, d, E, F, r, 2, lowrank=lowrank, dtype=dtype)
        masters = {k: v.detach().float().requires_grad_() for k, v in ex.items()}
        for experts in (ex, masters) if dtype != torch.float32 else (ex,):
            moe.moe_triton(x, idx, w, experts).float().sum().backward()
        with torch.no_grad():
            moe.moe_triton(x, idx, w, ex)


def _run_cross_entropy(dtype):
    from fractus.ops import cross_entropy as ce
    from fractus.verify.cases import cross_entropy_case
    h, W, t = cross_entropy_case(300, 1280, 50257, dtype=dtype)
    for positions, softcap in ((None, None), (torch.arange(0, 300, 7), 30.0)):
        ce.linear_cross_entropy(h, W, t, positions=positions, softcap=softcap, z_loss=1e-4,
                                backend="triton").backward()


def _run_kuramoto(dtype):
    if dtype != torch.float32:  # the clock always runs in fp32, whatever the model's dtype
        return
    from fractus.ops.kuramoto import kuramoto_phase
    from fractus.verify.cases import kuramoto_case
    for grad in (True, False):  # training (forward and backward) and a decode step (no graph)
        args, dy = kuramoto_case(torch.device("cpu"), small=not grad)
        with torch.set_grad_enabled(grad):
            psi = kuramoto_phase(*args, 0.1, 2, 0.1, backend="triton")
        if grad:
            psi.backward(dy)


OPS = {"linear_attention": _run_linear_attention, "delta_rule": _run_delta_rule, "moe": _run_moe,
       "cross_entropy": _run_cross_entropy, "kuramoto": _run_kuramoto}


def _run_fla():
    """fla's ``chunk_simple_gla`` as the GPU suite times it (:func:`fractus.verify.cases.fla_attention`:
    bf16, each recurrence at each length, whole and its numerator alone, the forward alone and
    forward+backward), on the GPU when there is one (its wrappers pick configs by the device they
    find)."""
    from fractus.verify import cases
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for recurrence in cases.RECURRENCES:
        for T in cases.ATTENTION_TS:
            inputs = cases.timed_attention(recurrence, T=T, device=device, **cases.ATTENTION_GPU)
            for impl in ("fla", "fla_numerator"):
                with torch.no_grad():
                    cases.attention(impl, *inputs)
                cases.attention_fwd_bwd(impl, *inputs)


def _run_timings():
    """The Triton launches of the GPU suite's timings (bf16), as its ``timing_*`` stages make them:
    the attention of each recurrence at each length (the forward alone, forward+backward, and the
    backward on chunks of 64: the chunk count is an argument Triton specialises on divisibility by
    16) and its decode step; the gated delta rule at the same shape, likewise; the 1b experts at each token count (low-rank) and at the first (dense),
    forward alone and forward+backward; the 1b head's loss, forward+backward."""
    from fractus.ops import cross_entropy as ce
    from fractus.ops import moe
    from fractus.verify import cases
    shape = cases.ATTENTION_GPU
    for recurrence in cases.RECURRENCES:
        for T in cases.ATTENTION_TS:
            inputs = cases.timed_attention(recurrence, T=T, **shape)
            with torch.no_grad():
                cases.attention("triton", *inputs)
            for impl in ("triton", "triton_bwd64"):
                cases.attention_fwd_bwd(impl, *inputs)
        with torch.no_grad():
            cases.attention("triton", *cases.timed_attention(recurrence, 1, 1, shape["H"], shape["D"],
                                                             shape["levels"], grad=False))
    # the gated delta rule at the same shape, at the first length only: the others specialise alike
    # (T and the chunk count all divisible by 16), and its fp32 intermediates at 8,192 take GBs
    for T in cases.ATTENTION_TS[:1]:
        inputs = cases.delta_case(T=T, dtype=torch.bfloat16, **shape)[:7]
        with torch.no_grad():
            cases.delta("triton", *inputs)
        cases.delta_fwd_bwd("triton", *inputs)
    with torch.no_grad():
        cases.delta("triton", *cases.delta_case(1, 1, shape["H"], shape["D"], shape["levels"], dtype=torch.bfloat16,
                                                grad=False)[:7])
    bf16 = torch.bfloat16
    for N, lowrank in [(N, True) for N in cases.MOE_TOKENS] + [(cases.MOE_TOKENS[0], False)]:
        x, idx, w, ex = cases.moe_case(N, **cases.MOE_GPU, lowrank=lowrank, dtype=bf16)
        with torch.no_grad():
            moe.moe(x, idx, w, ex, backend="triton")
        cases.moe_fwd_bwd(lambda *a: moe.moe(*a, backend="triton"), x, idx, w, ex)
    cases.cross_entropy_fwd_bwd(lambda *a: ce.linear_cross_entropy(*a, backend="triton"),
                                *cases.cross_entropy_case(**cases.CROSS_ENTROPY_GPU, dtype=bf16))


def _run_offsets():
    """The suite's checks at offsets past 2³¹ elements (:mod:`fractus.verify.offsets`) at sizes
    that Triton specialises as the full ones."""
    from fractus.verify import offsets
    offsets.run_cases("cpu", "capture")


# what the GPU suite launches beside the ops' and the presets' steps: (module, what to run); every
# module of the module's package is captured. The baseline it times side by side (when installed),
# its timings' own launches and the checks at offsets past 2³¹ elements.
EXTRAS = {"fla": ("fla.ops.simple_gla", _run_fla), "timings": ("fractus.ops.linear_attention", _run_timings),
          "offsets": ("fractus.verify.offsets", _run_offsets)}
PRESETS = ("palier0", "palier1", "palier2", "palier3", "1b")


def _run_model(preset: str, steps: int = 1, batch_size: int = 8, chunk_len: int = 128, bf16: bool = True,
               head_positions: str = "all", active_blocks: int = 0, **overrides) -> None:
    """``steps`` training micro-steps of ``preset`` on random tokens as the trainer runs them (each
    after the first with the state the one before carried; blocks outside ``active_blocks`` without
    weight gradients), under bf16 autocast (``bf16``), then a decode step: what training and
    generation launch (defaults: the GPU suite's setting, 8 streams × 128 tokens, every position
    scored). ``steps=0``: generation as the GPU suite times it instead. ``overrides`` go to the config."""
    from fractus.model import FractusConfig, FractusCTE
    from fractus.verify.cases import GEN_PROMPT
    from fractus.training.steps import autocast, micro_steps, set_active_blocks
    cfg = FractusConfig.preset(preset, backend="triton", **overrides)
    torch.manual_seed(0)
    model = FractusCTE(cfg)
    cpu = torch.device("cpu")
    if not steps:
        with autocast(cpu, bf16):
            model.eval().generate(GEN_PROMPT, 2, temperature=0)
        return
    state = None
    for i in range(steps):
        if active_blocks:
            set_active_blocks(model, active_blocks, 0, i)
        x = torch.randint(0, cfg.vocab_size, (batch_size, chunk_len + 1))
        _, _, state, _ = micro_steps(model, [(x[:, :-1], x[:, 1:], False)], state, 1, head_positions, cpu, bf16)
    with torch.no_grad(), autocast(cpu, bf16):
        model.step(x[:, 0], state)


def launches(ops=tuple(OPS), dtypes=SUITE_DTYPES, presets=(), extras=()) -> list[Launch]:
    """Run each op's Triton path forward and backward, and each of ``presets`` (a preset's name,
    or (name, :func:`_run_model`'s keywords)), on CPU with launches captured; then each of
    ``extras`` whose module is installed (op ``extra[name]``)."""
    from fractus.ops import common as backend
    out: list[Launch] = []
    for op in ops:
        module = importlib.import_module(f"fractus.ops.{op}")
        for dtype in dtypes:
            with capture(module, op, dtype, out), triton_on_cpu(backend):
                OPS[op](dtype)
    for entry in presets:
        preset, kw = (entry, {}) if isinstance(entry, str) else entry
        with capture_model(f"model[{preset}]", out), Fp32Matmuls():
            _run_model(preset, **kw)
    for name in extras:
        entry, run = EXTRAS[name]
        try:
            importlib.import_module(entry)
        except ImportError:
            continue
        package, first = sys.modules[entry.split(".")[0]], len(out)
        try:
            with capture(package, f"extra[{name}]", torch.bfloat16, out), triton_on_cpu(backend):
                run()
        except Exception as e:  # compiled when it is timed instead (an error recorded there)
            del out[first:]
            print(f"extra {name}: launches not captured ({type(e).__name__}: {e})", flush=True)
    return out


@contextmanager
def capture_model(op: str, launches: list[Launch]):
    """Every op's kernels captured (the clock's as fp32: it runs in fp32 under autocast; the
    others bf16) and the Triton path forced on CPU: what a bf16 model step launches."""
    from fractus.ops import common as backend
    with ExitStack() as stack:
        for name in OPS:
            module = importlib.import_module(f"fractus.ops.{name}")
            stack.enter_context(capture(module, op, torch.float32 if name == "kuramoto" else torch.bfloat16,
                                        launches))
        stack.enter_context(triton_on_cpu(backend))
        yield


class Fp32Matmuls(TorchFunctionMode):
    """Inside, a matmul that would run in bf16 (a bf16 operand, or CPU autocast to bf16) takes its
    operands rounded to bf16, multiplies them in fp32 and rounds the result to bf16, as a GPU's
    bf16 GEMM accumulates: the same dtype and layout, and so the same kernel launches after it
    (not the same ATen ops: it adds casts). For captures: a CPU without bf16 units (AVX2)
    multiplies bf16 about 130× slower than fp32 (without it a palier2 training capture spends 40 s of 41
    in ``mm``)."""

    FUNCS = {torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.Tensor.__matmul__,
             torch.Tensor.matmul}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        # only what would run in bf16: bf16 operands, or fp32/bf16 ones under autocast (not fp64,
        # not a mix that raises without it), and no ``out=`` to fill in place
        if func in self.FUNCS and "out" not in kwargs and dtypes and (
                dtypes == {torch.bfloat16} or autocast and dtypes <= {torch.float32, torch.bfloat16}):
            with torch.autocast("cpu", enabled=False):
                out = func(*(a.to(torch.bfloat16).float() if isinstance(a, torch.Tensor) else a for a in args),
                           **kwargs)
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)


@contextmanager
def triton_on_cpu(backend):
    """Let the public functions pick their Triton path for CPU tensors (nothing is launched)."""
    pick = backend.pick
    backend.pick = lambda name, x: pick(name, x) if name != "triton" else "triton"
    try:
        yield
    finally:
        backend.pick = pick


def _resources(kernel, arch: int) -> dict:
    """Registers, spill bytes and stack from ``ptxas -v`` on the compiled PTX (the ptxas and
    flags Triton itself used to build the cubin)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(kernel.asm["ptx"])
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(Path(tmp) / "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if log.returncode:
        raise RuntimeError(f"ptxas failed: {log.stderr[-500:]}")
    text = log.stderr + log.stdout
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else 0  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "spill_store_bytes": num(r"(\d+) bytes spill stores"),
            "spill_load_bytes": num(r"(\d+) bytes spill loads"), "stack_bytes": num(r"(\d+) bytes stack frame")}


def _mma(ptx: str) -> str:
    """Which matrix instructions the dots became: Hopper's wgmma, mma.sync, or none (FMA)."""
    return "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"


def compile_rows(arch: int = 90, ops=tuple(OPS), dtypes=TABLE_DTYPES,
                 all_configs: bool = True, presets=(), extras=("timings",)) -> list[dict]:
    """One row per distinct compiled kernel (op, kernel, input dtype, constexprs, warps, stages):
    whether it compiled for sm_``arch``, the matrix instructions, registers, spill and stack bytes, shared memory and
    whether it fits, and the compile seconds (near 0 when Triton's cache already held it).
    A failure is a row with its error. ``all_configs=False``: the first autotune config only.
    ``presets``: also each preset's training step and decode step (op ``model[preset]``), and
    ``extras`` (op ``extra[name]``, :data:`EXTRAS`: by default the GPU suite's timed launches); a
    kernel an earlier op compiled is listed again with its compile seconds near 0."""
    check_environment()
    from triton.runtime.driver import driver
    captured = launches(ops, dtypes, presets, extras)
    previous = driver._active
    driver.set_active(_offline_driver(arch))
    rows, seen = [], set()
    try:
        for L, fn, kw in _compiles(captured, all_configs):
            const = {k: v for k, v in kw.items() if k not in _OPTIONS}
            row = {"op": L.op, "kernel": L.name, "dtype": L.dtype,
                   "constexprs": " ".join(f"{k}={v}" for k, v in sorted(const.items())),
                   "num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3),
                   "target": f"sm_{arch}"}
            t0 = time.perf_counter()
            try:
                k = fn.warmup(*L.args, grid=(1,), **kw)
                if (L.op, k.hash) in seen:  # the same specialisation launched again
                    continue
                seen.add((L.op, k.hash))
                row.update(compiled=True, shared_bytes=k.metadata.shared, mma=_mma(k.asm["ptx"]),
                           **_resources(k, arch))
                row["fits_shared"] = row["shared_bytes"] <= SHARED_LIMIT[arch]
            except Exception as e:  # a failure is a row; the others still compile
                row.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
            print(_line(row), flush=True)
    finally:
        driver._active = previous
    return rows


_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _compiles(captured: list[Launch], all_configs: bool = True):
    """(launch, JIT function, keyword arguments) of every captured launch × autotune config."""
    for L in captured:
        for fn, kw in L.specs[all_configs]:
            yield L, fn, kw


def _specialisations(kernel, args, kwargs, all_configs):
    """(JIT function, keyword arguments) through the wrappers of ``kernel`` as a launch would go:
    an Autotuner's configs (those it keeps after pruning; the first only unless ``all_configs``),
    a Heuristics' computed values."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    if isinstance(kernel, Autotuner):
        kernel.nargs = dict(zip(kernel.arg_names, args))
        configs = kernel.prune_configs(kwargs) if all_configs else kernel.configs[:1]
        kernel.nargs = None
        for cfg in configs:
            yield from _specialisations(kernel.fn, args, {**kwargs, **cfg.all_kwargs()}, all_configs)
    elif isinstance(kernel, Heuristics):
        nargs = {**dict(zip(kernel.arg_names, args)), **kwargs}
        yield from _specialisations(kernel.fn, args, {**kwargs, **{k: h(nargs) for k, h in kernel.values.items()}},
                                    all_configs)
    else:
        yield kernel, kwargs


def _arg_key(a):
    """What Triton specialises a non-constexpr argument on (as far as the cache is concerned): a
    tensor's dtype and 16-byte alignment, an integer's width, being 1 and divisibility by 16."""
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, int) and not isinstance(a, bool):
        return ("int", abs(a) >= 2**31, a == 1, a % 16 == 0)
    return ("value", type(a).__name__, a if isinstance(a, (bool, str, type(None))) else None)


def compile_key(L: Launch, fn, kw: dict) -> tuple:
    """What one compile of ``fn`` for launch ``L`` with keywords ``kw`` (an item of :func:`_compiles`)
    is told apart by: constexprs and compile options by value, the other arguments by
    :func:`_arg_key`; equal keys compile to the same binary."""
    params = {p.name: p for p in fn.params}
    exact = lambda name: name not in params or params[name].is_constexpr  # noqa: E731
    return (fn.__module__, fn.__name__,
            tuple(repr(a) if p.is_constexpr else _arg_key(a) for p, a in zip(fn.params, L.args)),
            tuple(sorted((k, repr(v) if exact(k) else _arg_key(v)) for k, v in kw.items())))


def distinct_compiles(compiles):
    """``compiles`` (launch, JIT function, keyword arguments) without the repeats that would
    compile to the same binary (e.g. a preset's layers launching one kernel at one shape)."""
    seen = set()
    for L, fn, kw in compiles:
        key = compile_key(L, fn, kw)
        if key not in seen:
            seen.add(key)
            yield L, fn, kw


def _precompile_shard(shard: int, workers: int, ops, presets, arch: int | None, extras=(),
                      all_configs: bool = True, dtypes=SUITE_DTYPES) -> dict:
    """Compile every ``workers``-th distinct (launch, config) pair from ``shard`` on, for this
    machine's GPU (or offline for sm_``arch``), into Triton's on-disk cache."""
    from triton.runtime.driver import driver
    if arch is not None:
        driver.set_active(_offline_driver(arch))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))  # the capture's CPU work, in every worker
    t0, done, failed = time.perf_counter(), 0, []
    pairs = list(distinct_compiles(_compiles(launches(ops, dtypes, presets, extras), all_configs)))
    for L, fn, kw in pairs[shard::workers]:
        try:
            fn.warmup(*L.args, grid=(1,), **kw)
            done += 1
        except Exception as e:  # reported; the launch compiles again (and fails visibly) when it runs
            failed.append(f"{L.name}: {type(e).__name__}: {str(e)[:200]}")
    return {"worker": shard, "compiled": done, "failed": len(failed), "errors": " | ".join(failed)[:1000],
            "seconds": round(time.perf_counter() - t0, 2)}


def _worker_row(shard: int, future, finished: bool, timeout_s: float) -> dict:
    """A precompile worker's row: its own, or why it has none (stopped at the timeout, or died, which
    breaks the pool: every worker still running then fails too). How many such a worker compiled
    (they stay cached) is not known."""
    unknown = {"worker": shard, "compiled": None, "failed": None}
    if not finished:
        return {**unknown, "errors": f"stopped after {timeout_s:.0f} s", "seconds": timeout_s}
    if future.exception() is not None:
        return {**unknown, "errors": f"{type(future.exception()).__name__}: {future.exception()}"[:1000],
                "seconds": None}
    return future.result()


def precompile(workers: int, ops=tuple(OPS), presets=("palier0",), arch: int | None = None,
               extras=(), timeout_s: float = 200.0, all_configs: bool = True,
               dtypes=SUITE_DTYPES) -> list[dict]:
    """Fill Triton's on-disk cache with every captured launch (the ops' in ``dtypes``) × autotune
    config (the first only without ``all_configs``), compiled in
    ``workers`` processes at once, so that a run's launches and autotuning load binaries instead
    of compiling them one at a time (the cache key is the same: source, target, options,
    argument dtypes and alignment). For this machine's GPU, or offline for sm_``arch``. The
    workers compile real kernels even when this process runs the interpreter. One row per worker;
    workers still running after ``timeout_s`` are stopped (what they compiled stays cached)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # read by the spawned workers when they import triton
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    late = []  # until wait() returns (a SIGTERM may stop it), every submitted worker counts as late
    try:  # a worker that dies breaks the pool, and says so in its row (a Pool would replace it forever)
        futures = late = [pool.submit(_precompile_shard, i, workers, ops, presets, arch, extras, all_configs, dtypes)
                          for i in range(workers)]
        done, late = wait(futures, timeout=timeout_s)
        return [_worker_row(i, f, f in done, timeout_s) for i, f in enumerate(futures)]
    finally:
        if late:  # stuck (or slow) workers are stopped, so that the suite goes on
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
        pool.shutdown(wait=not late, cancel_futures=True)
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _line(row: dict) -> str:
    head = f"{row['op']:>16} {row['kernel']:<22} {row['dtype']:<8} w{row['num_warps']} s{row['num_stages']} "
    if not row["compiled"]:
        return head + "FAILED " + row["error"]
    return head + (f"{row['mma']:<8} regs {row['registers']:3d}  spill {row['spill_store_bytes']:5d} B  "
                   f"smem {row['shared_bytes']:6d} B  {row['compile_s']:.1f} s")


def check_environment() -> None:
    """Raise unless the kernels are real JIT functions (Triton's interpreter is off)."""
    from fractus.ops.common import interpreting
    if interpreting():
        raise RuntimeError("ahead-of-time compilation needs real JIT kernels: unset TRITON_INTERPRET")
