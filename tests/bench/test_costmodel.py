"""The cost model of a training step (fractus.bench.cpu_costmodel on this CPU, fractus.bench.costmodel
on a GPU): what it writes, what it traces and times, and that its counts agree with what runs. Its
accuracy is measured by ``python -m fractus.bench costmodel`` (results/costmodel_cpu_check.csv),
not asserted here."""
import math

import pandas as pd
import pytest
import torch

from fractus.bench import costmodel as cm
from fractus.bench import cpu_costmodel as C
from fractus.bench.gpu import DRY_SWEEP, train_setup
from fractus.bench.throughput import TrainingStep
from fractus.model import FractusConfig, FractusCTE


def test_smoke_run_writes_the_fit_and_the_check(tmp_path):
    fitted, checked = C.run(tmp_path, smoke=True)
    cases = C.cases(smoke=True)
    fit = pd.read_csv(tmp_path / "costmodel_cpu_fit.csv")
    check = pd.read_csv(tmp_path / "costmodel_cpu_check.csv")
    assert list(zip(fit["preset"], fit["batch_size"])) == cases == list(zip(check["preset"], check["batch_size"]))
    assert (fit["round"] == 0).all() and (fit["matmul_gflops"] > 0).all()  # one round when smoke
    assert (check["predicted_low_s"] <= check["predicted_step_s"]).all()
    assert (check["predicted_step_s"] <= check["predicted_high_s"]).all()
    assert {"git_sha", "device", "date"} <= set(fit.columns) & set(check.columns)
    terms = ["matmul_s", "other_s", "optimizer_s", "overhead_s"]
    assert (fit[terms] >= 0).all().all() and (fit[["matmul_s", "other_s", "optimizer_s"]] > 0).all().all()
    assert fit["predicted_step_s"].to_numpy() == pytest.approx(fit[terms].sum(axis=1).to_numpy())
    assert (fit["replay_failures"] == 0).all() and (fit["ops"] > fit["matmul_ops"]).all() and (fit["cold_ops"] > 0).all()
    assert (fit["host_op_us"] > fit["overhead_us"]).all() and (fit["threads"] == 1).all()
    numbers = check[["predicted_step_s", "measured_step_s", "measured_low_s", "measured_high_s", "error"]]
    assert numbers.map(math.isfinite).all().all() and (check["measured_step_s"] > 0).all()
    assert (check["measured_low_s"] <= check["measured_step_s"]).all()
    assert (check["measured_step_s"] <= check["measured_high_s"]).all()
    assert check["error"].to_numpy() == pytest.approx((check["predicted_step_s"] / check["measured_step_s"] - 1).to_numpy())
    assert set(check["architecture"]) == {"default", "original"}


def test_the_trace_reads_the_steps_inputs_cold_and_what_it_just_wrote_warm(one_thread):
    """With a cache of the whole step, only what the step did not write itself is cold: the weights,
    the optimizer's moments, the state carried from the step before; with none, every operand is."""
    step = TrainingStep("palier0", batch_size=1, **C.STEP, **C.TINY)
    step.forward_backward(0)
    step.update()
    ops = C.trace_step(step, 1 << 40)
    params = {tuple(p.shape) for p in step.model.parameters()}
    first = ops[[op.is_matmul() for op in ops].index(True)]  # the first matmul reads a weight and an activation
    cold = {a.shape: a.cold for a in first.args if isinstance(a, C._Operand)}
    assert any(c for s, c in cold.items() if s in params or s[::-1] in params) and not all(cold.values())
    assert {op.phase for op in ops} == {"step", "optimizer"}
    every = C.trace_step(step, 0)
    assert all(a.cold for op in every for a in op.args if isinstance(a, C._Operand))


def test_every_op_of_a_step_replays_alone(one_thread):
    """Each traced call runs by itself on random operands of its layout, cold ones from the pool."""
    step = TrainingStep("original-palier0", batch_size=2, **C.STEP, **C.TINY)
    step.forward_backward(0)
    step.update()
    ops = C.trace_step(step, 1 << 16)
    alone, failed = C.times_alone(ops, C._ColdPool(1 << 16), reps=1, cache={})
    assert failed == 0 and all(t > 0 for t in alone) and len(alone) == len(ops)
    terms = C.predict(ops, alone, overhead_s=1e-6)
    assert terms["overhead_s"] == pytest.approx(1e-6 * len(ops)) and terms["matmul_gflop"] > 0


@pytest.mark.parametrize("preset", ["palier0", "original-palier1"])
def test_the_gpu_counts_matmul_flops_as_the_cpu_path_runs_them(preset, one_thread):
    """The H200 column's matmul FLOPs (counted from the config) are the traced step's within 5 %
    (the PyTorch path's attention carries a ones column beside v)."""
    step = TrainingStep(preset, batch_size=2, **C.STEP)
    step.forward_backward(0)
    ops = C.trace_step(step, 1 << 25)
    traced = sum(op.flops for op in ops if op.phase == "step" and op.is_matmul())
    counted = sum(3 * mm for mm, _ in cm._forward_flops(step.config, C.CHUNK, "all", None).values()) * 2 * C.CHUNK
    assert traced == pytest.approx(counted, rel=0.05)


def test_the_h200_column_and_its_smallest_batch(one_thread):
    """A row per configuration of the sweep, then the smallest batch reaching the target: batch 1
    for a target any batch reaches, none (the largest batch tried, marked) for one none does."""
    rows = cm.h200_rows(DRY_SWEEP, train_setup, host_op_s=5e-6, target=("tiny", 1.0), largest=64)
    assert [(r["preset"], r["batch_size"]) for r in rows[:-1]] == [(p, b) for p, bs, _ in DRY_SWEEP for b in bs]
    for r in rows:
        assert r["step_s"] == max(r["device_s"], r["host_s"]) > 0 and 0 < r["mfu"] < 1 and r["memory_gb"] > 0
        assert r["tok_s"] == pytest.approx(r["batch_size"] * r["chunk_len"] / r["step_s"])
    assert rows[-1]["smallest_for_target"] and rows[-1]["batch_size"] == 1
    unreachable = cm.h200_rows(DRY_SWEEP, train_setup, host_op_s=5e-6, target=("tiny", 1e15), largest=64)[-1]
    assert not unreachable["smallest_for_target"] and unreachable["batch_size"] == 64


def test_memory_grows_with_the_batch_and_the_optimizers_state():
    cfg = cm.FractusConfig.preset("palier2")
    small, large = (cm.training_memory(cfg, n, "sgd", chunk_len=128) for n in (1024, 8192))
    assert large > small > 12 * cm.num_params(cfg)
    assert cm.training_memory(cfg, 1024, "adamw", chunk_len=128) - small == pytest.approx(4 * cm.num_params(cfg))


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"),
                                       ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 NVL", "H100 NVL"),
                                       ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA A100-SXM4-80GB", None)])
def test_the_datasheet_of_a_device_by_its_name(name, key):
    assert cm.datasheet(name) is (cm.DATASHEETS[key] if key else None)


def test_the_host_cost_per_op_is_a_tiny_steps_time_over_its_ops(one_thread):
    """Microseconds per op: more than an empty Python call, less than the tiny step's whole time."""
    s = C.host_op_seconds("tiny", steps=2)
    assert 1e-7 < s < 1e-3


@pytest.mark.parametrize("preset", ["tiny", "palier0", "original-palier0"])
@pytest.mark.parametrize("over", [{}, {"tie_head": False}, {"expert_rank": 0}, {"router": "linear"},
                                  {"attn_norm": "rms", "short_conv": 3}])
def test_param_count_matches_the_model(preset, over):
    cfg = FractusConfig.preset(preset, **over)
    model = FractusCTE(cfg)
    assert cm.num_params(cfg) == model.num_params()
    assert cm.active_params(cfg) == model.num_params(active=True) == cm.chinchilla_tokens(cfg, 1.0, active=True)
    assert cm.chinchilla_tokens(cfg) == 20 * model.num_params()


def test_flops_rules():
    cfg, C = FractusConfig.preset("palier0"), 32
    fwd = cm.flops_per_token(cfg, training=False, chunk_len=C)
    train = cm.flops_per_token(cfg, training=True, chunk_len=C)
    assert set(fwd) == set(cm.COMPONENTS) and fwd["embedding"] == 0
    for k in ("attention", "moe", "head", "norms", "kuramoto"):
        assert train[k] == pytest.approx(3 * fwd[k]) and fwd[k] > 0
    det = cm.flops_per_token(FractusConfig.preset("palier0", detach_kuramoto=True), training=True, chunk_len=C)
    assert det["kuramoto"] == pytest.approx(fwd["kuramoto"])  # no backward through a detached clock
    last = cm.flops_per_token(cfg, chunk_len=C, head_positions="last")
    assert last["head"] * C == pytest.approx(train["head"])
    # the head is 2·d·V multiply-adds per token forward, plus the softmax
    assert fwd["head"] >= 2 * cfg.d_model * cfg.vocab_size
    # dense experts cost 4·d·F per expert, low-rank 4·(d + F)·r: palier0's low rank is cheaper
    dense = cm.flops_per_token(FractusConfig.preset("palier0", expert_rank=0), training=False, chunk_len=C)
    assert dense["moe"] > fwd["moe"]
    # every expert for every token (top_k = E) doubles palier0's expert work (E = 4, K = 2)
    allx = cm.flops_per_token(FractusConfig.preset("palier0", top_k=4), training=False, chunk_len=C)
    assert 1.5 < allx["moe"] / fwd["moe"] <= 2.0
    with pytest.raises(ValueError):
        cm.flops_per_token(cfg, chunk_len=C, head_positions="first")


def test_bytes_and_roofline():
    cfg = FractusConfig.preset("palier0")
    small, big = cm.bytes_per_token(cfg, 32, chunk_len=32), cm.bytes_per_token(cfg, 4096, chunk_len=32)
    assert all(big[k] <= small[k] for k in cm.COMPONENTS)  # weights amortised over more tokens
    at = cm.bytes_per_token(cfg, 256, chunk_len=32)
    assert cm.bytes_per_token(cfg, 256, chunk_len=32, fused_ce=False)["head"] > at["head"]
    assert cm.bytes_per_token(cfg, 256, chunk_len=32, dtype_bytes=2)["moe"] < at["moe"]
    kw = dict(peak_flops=1e11, peak_bw=1e10, batch_size=8, chunk_len=32)
    bound = cm.roofline(cfg, **kw)
    slow = cm.roofline(cfg, **kw, n_ops=1000, op_overhead_s=1e-5)
    assert bound["tok_s"] == pytest.approx(1 / sum(bound["components"].values()))
    assert slow["tok_s"] < bound["tok_s"]
    assert slow["components"]["dispatch"] == pytest.approx(1000 * 1e-5 / (8 * 32))
    compute_free = cm.roofline(cfg, peak_flops=1e30, peak_bw=1e10, chunk_len=32)
    assert all(compute_free["bound"][k] == "memory" for k in cm.COMPONENTS)
    assert cm.optimizer_cost(cfg, "adamw", 256)["bytes"] > cm.optimizer_cost(cfg, "sgd", 256)["bytes"]
    assert cm.time_to_train(1e6, 1e3) == 1e3
    with pytest.raises(ValueError):
        cm.time_to_train(1e6, 0)
