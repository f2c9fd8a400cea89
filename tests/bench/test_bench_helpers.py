"""The notebooks' pure helpers: the cost model, repetition metrics, merge mean, optimization set-ups,
the profiler attribution, the decode-vs-forward probe, the allocator setting and runs in a
fresh process."""
import math
from dataclasses import replace

import pytest
import torch

from fractus.bench import costmodel as cm
from fractus.experiments import optimizations as O
from fractus.experiments import probes as PR
from fractus.bench import profile as P
from fractus.model import FractusConfig, FractusCTE

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ cost model
def test_optimization_verdicts():
    assert O.verdict(0.95, 1.37) == "no gain measured (a gain was claimed)"
    assert O.verdict(3.6, 4.0) == O.verdict(4.9, 4.0) == O.AS_CLAIMED
    assert O.verdict(2.0, 4.0) == "smaller than claimed" and O.verdict(6.0, 4.0) == "larger than claimed"


def test_quality_effects():
    assert O.quality_effect([0.03]) == O.LEARNS_LESS and O.quality_effect([-0.03]) == O.LEARNS_MORE
    assert O.quality_effect([0.004]) == O.quality_effect([-0.004]) == O.NO_EFFECT
    assert O.quality_effect([0.01]) == O.quality_effect([-0.01]) == O.SMALL_EFFECT
    assert O.quality_effect([0.02]) == O.quality_effect([-0.02]) == O.quality_effect([0.005]) == O.SMALL_EFFECT
    assert O.quality_effect([0.05, 0.02, 0.03]) == O.LEARNS_LESS  # every seed agrees
    assert O.quality_effect([0.08, -0.01, 0.03]) == O.quality_effect([-0.05, 0.01]) == O.SEED_NOISE
    assert O.quality_effect([0.012, -0.004, 0.001]) == O.NO_EFFECT  # the mean decides first
    for bad in ([float("nan"), 0.1], []):
        with pytest.raises(ValueError, match="no quality cost"):
            O.quality_effect(bad)


def test_quality_cost_pairs_the_seeds():
    run = lambda ce, bpb: {"val_ce": ce, "val_bpb": bpb}  # noqa: E731
    with_opt = [run(5.0, 3.10), run(5.2, 3.20), run(5.1, 3.00)]
    without = [run(4.9, 3.00), run(5.0, 3.15), run(5.0, 2.98)]
    q = O.quality_cost(with_opt, without)
    assert q["quality cost (Δbpb)"] == pytest.approx((0.10 + 0.05 + 0.02) / 3)
    assert q["Δbpb low"] == pytest.approx(0.02) and q["Δbpb high"] == pytest.approx(0.10)
    assert q["val_ce with"] == pytest.approx(5.1) and q["val_bpb without"] == pytest.approx(9.13 / 3)
    assert q["quality effect"] == O.LEARNS_LESS
    with pytest.raises(ValueError, match="3 runs with the optimization against 2 without"):
        O.quality_cost(with_opt, without[:2])


def test_the_originals_profile_tables_add_up_and_map_every_component():
    assert set(P.ORIGINAL_ROWS) == set(P.COMPONENTS)
    assert set(P.ORIGINAL_ROWS.values()) == set(P.ORIGINAL_FORWARD_MS)
    assert sum(P.ORIGINAL_FORWARD_MS.values()) == P.ORIGINAL_PHASES_MS["forward"]
    assert sum(v for k, v in P.ORIGINAL_PHASES_MS.items() if k != "total") == P.ORIGINAL_PHASES_MS["total"]


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


# ------------------------------------------------------------------------------ repetition
def test_repetition_metrics_on_known_sequences():
    assert PR.distinct_n(list("abcd"), 1) == 1.0
    assert PR.distinct_n(list("aaaa"), 1) == 0.25
    assert PR.distinct_n(list("abab"), 2) == pytest.approx(2 / 3)
    assert PR.distinct_n(list("a"), 2) == 0.0
    assert PR.longest_repeat_run(list("ababab")) == (6, 2)
    assert PR.longest_repeat_run(list("xaaaay")) == (4, 1)
    assert PR.longest_repeat_run(list("abcabcab")) == (8, 3)
    assert PR.longest_repeat_run(list("abcdef")) == (0, 0)
    assert PR.longest_repeat_run(list("abcab")) == (0, 0)  # one and a half copies is not a repeat
    assert PR.longest_repeat_run([7, 7]) == (2, 1)
    assert PR.top_token_share(list("aabc")) == 0.5
    m = PR.repetition_metrics([1, 2, 1, 2, 1, 2, 3])
    assert m == {"distinct_1": 3 / 7, "distinct_2": 3 / 6, "longest_repeat_run": 6, "repeat_period": 2,
                 "top_token_share": 3 / 7}
    ref = PR.reference_metrics(list(range(100)), n_windows=4, length=10)
    assert len(ref) == 4 and all(r["distinct_1"] == 1.0 and r["longest_repeat_run"] == 0 for r in ref)


def test_mean_merge():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor([3])}
    m = PR.mean_merge([a, b])
    assert torch.equal(m["w"], torch.tensor([2.0, 4.0])) and torch.equal(m["n"], torch.tensor([3]))


def test_decode_vs_forward_and_generation_table():
    torch.manual_seed(0)
    model = FractusCTE(FractusConfig.preset("tiny"))
    r = PR.decode_vs_forward(model, list(range(1, 40)))
    assert r["positions"] == 39 and r["max_rel_err"] < 1e-5 and r["argmax_agreement"] == 1.0

    class Enc:  # a stand-in tokenizer over the tiny vocabulary
        def encode_ordinary(self, s):
            return [ord(c) % 500 for c in s]

        def decode(self, ids):
            return " ".join(map(str, ids))

    rows = PR.generation_table(model, Enc(), prompts=("ab", "cd"), max_new_tokens=6)
    assert len(rows) == 2 * len(PR.STRATEGIES)
    assert all(len(r["ids"]) == 6 and 0 <= r["distinct_2"] <= 1 for r in rows)


# ------------------------------------------------------------------------------ optimizations
def test_optimization_stack_and_alone():
    base = O.Setup(dims=tuple(O.SMOKE_DIMS.items()))
    assert base.config().top_k == base.config().n_experts  # the baseline runs every expert
    stack = O.stack(base)
    assert len(stack) == len(O.OPTIMIZATIONS) + 1 and stack[0] == ("baseline", base)
    last = stack[-1][1]
    assert (last.tie_head, last.head_positions, last.accum, last.chunk_len, last.detach_kuramoto,
            last.optimizer, last.batch_size, last.vocab_size, last.fused_ce) == \
        (True, "last", 8, 32, True, "sgd", 8, 8192, True)
    assert last.config().top_k == 2 and last.active_blocks == 1 and last.tokens_per_step() == 2048
    alone = dict(O.alone(base))
    assert alone["reduced vocabulary"].vocab_size == base.reduced_vocab
    assert alone["tied head"].head_positions == "all" and alone["tied head"].tie_head
    assert len(alone) == len(O.OPTIMIZATIONS) + len(O.ALONE_EXTRA)
    assert last.lr() == 0.1 and O.Setup(batch_size=8, chunk_len=32, accum=8).lr() == 2e-3
    assert O.Setup().lr() == pytest.approx(2e-3 * (16 / 2048) ** 0.5)


def test_toggles_switch_one_optimization_in_the_combined_configuration():
    base = O.Setup()
    combined, toggles = O.toggles(base)
    assert combined == O.stack(base, O.OPTIMIZATIONS[:-1])[-1][1] and combined.active_blocks == 0
    assert [n for n, *_ in toggles] == [n for n, *_ in O.OPTIMIZATIONS]
    for name, on, off in toggles:
        differ = {k for k in on.__dataclass_fields__ if getattr(on, k) != getattr(off, k)}
        assert len(differ) == 1, (name, differ)
        assert (on == combined) != (name.startswith("PGSU")) and (off == combined) == name.startswith("PGSU")


def test_bf16_gain_of_an_optimizations_table():
    import pandas as pd
    plan = O.gpu_plan(cuda=True)
    table = pd.DataFrame([{"table": t, "optimization": n, "dtype": "bfloat16" if bf16 else "float32", "tok_s": 100.0}
                          for t, n, _, bf16, _ in plan])
    table.loc[table["table"] != "cumulative", "speedup_vs_last_row"] = [0.5, 0.25]  # fp32, then PyTorch
    assert O.bf16_gain(table) == 2.0
    assert O.bf16_gain(table[table["table"] == "cumulative"]) is None  # stopped before its variants
    assert O.bf16_gain(table.assign(dtype="float32")) is None  # a dry run: fp32 throughout
    assert O.bf16_gain(table.iloc[:0]) is None


def test_spread_windows():
    import numpy as np
    t = np.arange(1000)
    w = O.spread_windows(t, 80, 8)
    assert len(w) == 81 and w[0] == 0 and w[-1] == 999 - 0 and w[-2] == 998
    pieces = w[:80].reshape(8, 10)
    assert (np.diff(pieces, axis=1) == 1).all() and (np.diff(pieces[:, 0]) > 10).all()  # contiguous, spread out
    assert len(O.spread_windows(t, 2000, 8)) == 1000  # too short: everything


def test_short_train_learns_on_its_slice(tmp_path):
    from fractus.data import prepare
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question.\n" * 400)
    prepare(str(text), tmp_path / "data", 512)
    r = O.Setup(preset="tiny", vocab_size=512, tie_head=True, sparse_moe=True, fused_ce=True, batch_size=2,
                chunk_len=16, accum=1)
    torch.manual_seed(0)
    model = FractusCTE(r.config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = O.short_train(r, 512, 256, data_dir=tmp_path / "data", train_slice=(0.0, 0.5), model=model)
    assert out["steps"] == 16 and out["tokens"] == 512
    assert math.isfinite(out["val_ce"]) and out["val_ce"] < math.log(512)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------ profiler
def test_forward_components_cover_the_profiled_forward():
    r = O.Setup(preset="tiny", vocab_size=512, tie_head=True, sparse_moe=True, fused_ce=True, batch_size=2,
                chunk_len=16)
    fc = P.forward_components(r, iters=1, warmup=1)
    total = sum(fc[c] for c in P.COMPONENTS)
    assert total == pytest.approx(fc["forward"], rel=0.02)
    for label in ("attention", "kuramoto", "moe", "head_loss", "norms"):
        assert fc[label] > 0, label
    assert fc["backward"] > 0 and fc["optimizer"] > 0 and fc["ops"] > 50
    ph = P.phase_times(r, iters=1, warmup=1)
    assert ph["total"] == pytest.approx(ph["forward"] + ph["backward"] + ph["optimizer"])


def test_attribute_counts_cuda_backward_on_autograd_thread():
    """On CUDA the backward's kernels run on autograd's device thread, outside the backward range;
    the kernels' events and the GPU's copies of the ranges are not counted again."""
    from types import SimpleNamespace as Ev

    from torch.autograd import DeviceType

    def ev(name, thread, dev_self, dev_total=None, parent=None, device_type=DeviceType.CPU):
        return Ev(name=name, thread=thread, cpu_parent=parent, self_device_time_total=dev_self * 1e3,
                  device_time_total=(dev_total if dev_total is not None else dev_self) * 1e3,
                  self_cpu_time_total=0.0, cpu_time_total=0.0, device_type=device_type)
    fwd = ev(P._MARK + "forward", 1, 0.0, 5.0)
    events = [fwd, ev("attention", 1, 5.0, parent=fwd), ev(P._MARK + "backward", 1, 0.0, 0.5),
              ev("autograd::engine::evaluate_function: MmBackward0", 2, 7.0),
              ev(P._MARK + "optimizer", 1, 0.0, 1.0),
              # the kernels' own events (a stream for a thread): their time is in their ops' already
              ev("_la_out_kernel", 7, 5.0, device_type=DeviceType.CUDA),
              ev("sm90_xmma_gemm_bf16", 7, 7.0, device_type=DeviceType.CUDA),
              # the GPU's copies of the ranges (user annotations, named alike): not counted twice
              ev(P._MARK + "forward", 7, 5.0, device_type=DeviceType.CUDA),
              ev(P._MARK + "backward", 7, 7.0, device_type=DeviceType.CUDA)]
    out = P.attribute(events, device_time=True)
    assert out["forward"] == 5.0 and out["attention"] == 5.0
    assert out["backward"] == 7.5 and out["optimizer"] == 1.0


def test_keep_freed_memory_applies_on_linux_glibc():
    import platform

    from fractus.allocator import keep_freed_memory
    expected = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is expected
    assert keep_freed_memory() is expected  # idempotent


def test_in_fresh_process_returns_result_and_reraises():
    from fractus.bench.common import in_fresh_process
    r = in_fresh_process("fractus.bench.throughput:measure_training", preset="tiny", batch_size=2, chunk_len=8,
                         accum=1, steps=1)
    assert r["preset"] == "tiny" and r["tok_s"] > 0 and r["tok_s_best"] >= r["tok_s"]
    with pytest.raises(RuntimeError, match="unknown preset"):
        in_fresh_process("fractus.bench.throughput:measure_training", preset="nope")


def _launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return P.launched_ops(prof.events())


@pytest.fixture
def four_threads():
    """Four torch threads: CPU's kernels take their parallel paths (which call other ops inside)."""
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("n", [4, 1 << 18])  # small, and large enough for CPU's kernels to call helpers inside
def test_launched_ops_counts_an_op_once_whatever_it_calls_inside(n, four_threads):
    """One launch per op that does work, however CPU's ATen implements it at this size and thread
    count (a large cat narrows its inputs: views only; zeros fills; a large sum may fill and copy),
    none for views; an op built of two working ops counts two."""
    a, b, rows = torch.randn(8, n), torch.randn(8, n), torch.tensor([0, 1])
    assert _launches(lambda: torch.stack([a, b])) == 1
    assert _launches(lambda: torch.zeros(8, n)) == 1
    assert _launches(lambda: a.sum(0)) == 1
    assert _launches(lambda: a.bfloat16().sum(0)) == 2  # the cast, then the sum
    assert _launches(lambda: (a.t(), a.view(-1), a[1:])) == 0
    assert _launches(lambda: a.index_add(0, rows, b[:2])) == 2  # clone, then index_add_


def test_gpu_launch_count_does_not_vary_with_the_batch(four_threads):
    """The GPU path's launches are a property of the structure: the same at B=8 and B=64 (B=1 skips
    copies of tensors that are contiguous only then; few tokens split the head's vocabulary)."""
    r = O.Setup(preset="palier0", vocab_size=512, tie_head=True, sparse_moe=True, fused_ce=True, chunk_len=128)
    assert P.gpu_launch_count(replace(r, batch_size=8)) == P.gpu_launch_count(replace(r, batch_size=64))


def test_gpu_launch_count_grows_with_layers_not_experts():
    """Launches of the GPU's path (Triton launches captured): per layer a fixed number, whatever the
    expert count; the CPU path's sorted MoE instead runs ops per expert."""
    def setup(**dims):
        return O.Setup(preset="tiny", vocab_size=256, tie_head=True, sparse_moe=True, fused_ce=True,
                       chunk_len=16, batch_size=2, dims=tuple(dims.items()))
    one, two = (P.gpu_launch_count(setup(n_layers=n, n_experts=4)) for n in (1, 2))
    assert 20 < two - one < 400  # a block: attention, clock, MoE and norms, forward and backward
    assert P.gpu_launch_count(setup(n_layers=1, n_experts=16)) == one
    cpu = [P.op_count(setup(n_layers=1, n_experts=e))["ops"] for e in (4, 16)]
    assert cpu[1] > cpu[0]


def test_speeds_are_interleaved_and_ratios_taken_round_by_round(monkeypatch):
    a, b, c = O.Setup(batch_size=1), O.Setup(batch_size=2), O.Setup(batch_size=4)
    calls = []

    def fake(setup, **kw):  # the machine halves its speed every round; b is 0.5 × a, c 2 × a
        calls.append(setup.batch_size)
        rnd = (len(calls) - 1) // 3
        return {"tok_s": 100.0 * setup.batch_size / 2 ** rnd * (0.25 if setup.batch_size == 2 else 1)}

    monkeypatch.setattr(O, "measure_speed", fake)
    speeds = O.measure_speeds([a, b, a, c], rounds=4)
    rounds = [calls[i:i + 3] for i in range(0, 12, 3)]
    assert all(sorted(r) == [1, 2, 4] for r in rounds) and len({tuple(r) for r in rounds}) > 1  # shuffled
    assert speeds[a] == [100.0, 50.0, 25.0, 12.5] and speeds[b] == [50.0, 25.0, 12.5, 6.25]
    assert O.speedup(speeds, b, a) == pytest.approx({"median": 0.5, "low": 0.5, "high": 0.5})
    assert O.speedup(speeds, c, a)["median"] == pytest.approx(4.0)
    rows = O.rounds_rows(speeds, {a: "a", b: "b", c: "c"})
    assert len(rows) == 12 and rows[1] == {"setup": "a", "round": 1, "tok_s": 50.0}


def test_clock_launch_counts_per_path():
    cfg = FractusConfig.preset("palier0")
    n = P.clock_ops(cfg)
    more = P.clock_ops(FractusConfig.preset("palier0", kuramoto_steps=2 * cfg.kuramoto_steps))
    assert 2 <= n["triton"] < n["torch"] < n["reference"], n
    assert more["triton"] == n["triton"] and more["reference"] > n["reference"] and more["torch"] > n["torch"]


# ------------------------------------------------------------------------------ architecture ablation
def test_ablation_keeps_the_rows_already_measured(tmp_path):
    """A rerun keeps each (variant, seed) already in the CSV for the same changes, rate, batch and
    tokens and trains only what is missing (here nothing: no worker is needed, and no data); a row
    at another rate, or one without its rate, is not kept."""
    from fractus.experiments import architecture as A
    from fractus.training.records import append_csv
    vs = A.variants("tiny")[:2]
    csv = tmp_path / "ablation.csv"
    for v in vs:
        append_csv(csv, {"variant": v.name, "group": v.group, "model": v.model, "preset": v.preset,
                         "changes": v.changes_cli, "lr": v.lr, "batch_size": v.batch_size, "chunk_len": v.chunk_len,
                         "seed": 0, "tokens": A.trained_tokens(5000), "val_ce": 5.0 + len(v.changes), "train_s": 1.0})
    rows = A.run(vs, tmp_path / "no-data", 5000, seeds=(0,), csv=csv, workers=1, log=lambda s: None)
    assert rows["variant"].tolist() == [v.name for v in vs] and rows["val_ce"].tolist() == [5.0, 6.0]
    from fractus.training.resume import ADAMW_LR
    assert vs[0].lr == ADAMW_LR["original"] and vs[0].preset == "original-tiny"  # the original's tuned rate
    for lr in (2 * vs[0].lr, None):
        stale = tmp_path / f"stale-{lr}.csv"
        append_csv(stale, {"variant": vs[0].name, "group": vs[0].group, "model": vs[0].model, "preset": vs[0].preset,
                           "changes": "", **({"lr": lr} if lr else {}), "batch_size": vs[0].batch_size,
                           "chunk_len": vs[0].chunk_len, "seed": 0, "tokens": A.trained_tokens(5000), "val_ce": 5.0})
        with pytest.raises(FileNotFoundError, match="meta.json"):  # not kept: it trains, and finds no data
            A.run(vs[:1], tmp_path / "no-data", 5000, seeds=(0,), csv=stale, workers=1, log=lambda s: None)
    with pytest.raises(FileNotFoundError, match="meta.json"):  # another token count: it trains, and finds no data
        A.run(vs[:1], tmp_path / "no-data", 9000, seeds=(0,), csv=csv, workers=1, log=lambda s: None)
