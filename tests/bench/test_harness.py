"""The benchmark harness (:mod:`fractus.bench.harness`): declarations → rows of its one schema. A toy
declaration (calls logged, so that the timing plan is checked call by call) and the ops' own
declarations, pinned at their sizes and run at FRACTUS_SMOKE's."""
import pytest
import torch

from fractus.bench import cross_entropy, harness, linear_attention, moe
from fractus.bench.harness import COLUMNS, Bench, Target, Timing
from fractus.verify import cases

pytestmark = pytest.mark.usefixtures("one_thread")


def toy(log, **over) -> Bench:
    """Providers "fast" and "slow" (twice the work) at n = 64 and 256, every call logged; "broken" and
    "missing" fail (an error, an absent package)."""
    def call(provider, mode, n):
        if provider == "broken":
            raise RuntimeError("boom")
        if provider == "missing":
            raise ImportError("no module named missing")

        def run():
            if log is not None:
                log.append((provider, n))
            return torch.randn(n * (2 if provider == "slow" else 1), 64).sum()
        return run
    kw = dict(op="toy", case="c", x_name="n", x_values=(64, 256), providers=("fast", "slow"), setup=lambda n: n,
              call=call, baseline="slow", shape=dict(d=64), timing=Timing(warmup=1, reps=3),
              flops=lambda n, mode: 1e6 * n)
    return Bench(**{**kw, **over})


def by(rows, metric="time"):
    return {(r["provider"], r["x_value"]): r for r in rows if r["metric"] == metric}


def test_rows_hold_the_one_schema_and_their_ratios():
    log = []
    rows = list(harness.run([toy(log)]))
    assert all(list(r) == list(COLUMNS) for r in rows)
    assert {r["metric"] for r in rows} == {"time", "tflops"} and {r["unit"] for r in rows} == {"s", "TFLOP/s"}
    # each point alone, in turn: one warm-up call and three timed calls
    assert log == [(p, n) for n in (64, 256) for p in ("fast", "slow") for _ in range(4)]
    time, rate = by(rows), by(rows, "tflops")
    assert len(time) == 4 and all(r["rounds"] == 3 and r["low"] <= r["median"] <= r["high"] for r in time.values())
    for n in (64, 256):
        fast, slow = time[("fast", n)], time[("slow", n)]
        assert fast["baseline"] == slow["baseline"] == "slow" and slow["ratio_vs_baseline"] == 1.0
        assert fast["ratio_vs_baseline"] == fast["median"] / slow["median"]
        assert rate[("fast", n)]["median"] == 1e6 * n / fast["median"] / 1e12 and rate[("fast", n)]["ratio_vs_baseline"] is None
        assert fast["shape"] == "d=64" and fast["x_name"] == "n" and fast["op"] == "toy" and fast["dtype"] == "float32"


def test_interleaved_points_are_timed_in_alternating_rounds_after_the_others():
    log = []
    rows = list(harness.run([toy(log, providers=("fast", "slow", "other"),
                                 timing=Timing(warmup=1, reps=2, rounds=4, interleave=("fast", "slow")))]))
    alone = [("other", 64)] * 3 + [("other", 256)] * 3  # timed alone first, in the point order
    warm = [("fast", 64), ("slow", 64), ("fast", 256), ("slow", 256)]  # the interleaved: every x together
    assert log == alone + warm + warm * 4
    time = by(rows)
    assert time[("fast", 256)]["rounds"] == 4 and time[("other", 64)]["rounds"] == 2


def test_an_unmeasured_baseline_makes_a_scaling_check_and_low_compares_best_rounds():
    rows = list(harness.run([toy(None, only=lambda p, n, m: p == "fast" or n == 64, compared="low")]))
    time = by(rows)
    assert ("slow", 256) not in time
    fast, fast4 = time[("fast", 64)], time[("fast", 256)]
    assert fast4["baseline"] == "fast@n=64" and fast4["ratio_vs_baseline"] == fast4["low"] / fast["low"]
    assert fast["ratio_vs_baseline"] == fast["low"] / time[("slow", 64)]["low"] and fast["compared"] == "low"


def test_failures_and_absent_providers_are_rows_with_their_reason():
    rows = list(harness.run([toy(None, providers=("fast", "broken", "missing", "gone"), baseline="broken",
                                 absent={"gone": "not here"})]))
    time = by(rows)
    assert time[("broken", 64)]["note"] == "error: RuntimeError: boom" and time[("broken", 64)]["median"] is None
    assert time[("missing", 64)]["note"] == "not installed (no module named missing)"
    assert time[("gone", 256)]["note"] == "not here"
    fast = time[("fast", 64)]  # measured, against a baseline that failed: no ratio
    assert fast["median"] > 0 and fast["baseline"] == "broken" and fast["ratio_vs_baseline"] is None
    assert [r["metric"] for r in rows if r["provider"] != "fast"] == ["time"] * 6  # nothing derived from a failure


def test_a_peer_absent_or_failing_at_import_is_a_reason_not_an_error():
    def missing():
        raise ImportError("No module named 'fla'")

    def broken():
        raise RuntimeError("no CUDA device")
    assert harness.peer(missing) == (None, "not installed (No module named 'fla')")
    assert harness.peer(broken) == (None, "failed at import: RuntimeError: no CUDA device")
    assert harness.peer(lambda: ("wrapper", "fla 0.3")) == ("wrapper", "fla 0.3")


def test_targets_are_judged_on_the_measured_values_or_say_why_not():
    targets = (Target("fast", "fast beats slow", lambda r: r.value("fast") < r.value("slow"), x=64),
               Target("fast", "vs the missing one", lambda r: r.value("missing") or f"missing {r.note('missing')}", x=256),
               Target("missing", "never timed", lambda r: True))
    rows = list(harness.run([toy(None, providers=("fast", "slow", "missing"), targets=targets)]))
    time = by(rows)
    first = time[("fast", 64)]
    assert first["target"] == "fast beats slow" and first["target_met"] == (first["median"] < time[("slow", 64)]["median"])
    second = time[("fast", 256)]
    assert second["target"] == "vs the missing one" and second["target_met"] is None
    assert second["note"] == "target not measured: missing not installed (no module named missing)"
    assert time[("missing", 64)]["target"] == "never timed" and time[("missing", 64)]["target_met"] is None
    assert time[("slow", 64)]["target"] is None


def test_checks_are_rows_against_their_truth():
    rows = list(harness.run([toy(None, check=lambda p, m, n, out: {"rel_err": float(p == "slow")},
                                 check_modes=("fwd+bwd",), check_vs="the truth")]))
    errs = by(rows, "rel_err")
    assert len(errs) == 4 and errs[("slow", 64)]["median"] == 1.0 and errs[("fast", 256)]["median"] == 0.0
    assert {r["baseline"] for r in errs.values()} == {"the truth"} and errs[("fast", 64)]["ratio_vs_baseline"] is None


def test_the_ops_declarations_keep_their_shapes_providers_and_rounds():
    """What each op measures, as declared for a full run (nothing runs here)."""
    a, b = linear_attention.cpu_benches()
    assert (a.providers, a.baseline, a.x_values, a.shape) == (("torch", "reference"), "reference", (512,),
                                                              dict(B=1, H=4, D=64, levels=2, decay=True))
    assert (b.x_values, b.shape, b.memory_x, b.baseline) == ((1024, 4096), dict(B=1, H=16, D=64, levels=1, decay=False),
                                                             (1024,), "materialising")
    assert (b.timing, a.timing, a.threads) == (Timing(1, 3, 7, ("torch",)), Timing(1, 3), 1)
    assert not b.measured("materialising", 4096, "fwd+bwd") and [t.x for t in b.targets] == [1024, 4096]
    (m,) = moe.cpu_benches()
    assert (m.x_values, m.providers, m.baseline, m.compared, m.timing.rounds) == ((8192,), ("torch", "gather"),
                                                                                  "gather", "low", 5)
    assert m.shape == dict(moe.PALIER2, gather_chunk=1024)
    (c,) = cross_entropy.cpu_benches()
    assert (c.x_values, c.shape, c.providers, c.timing) == ((8192,), dict(d=512, V=50257), ("torch", "naive"), Timing(1, 3))
    gla = linear_attention.gpu_benches()
    assert [(g.case, g.modes) for g in gla] == [(r, ("fwd", "fwd+bwd")) for r in cases.RECURRENCES] + \
        [(r, ("decode",)) for r in cases.RECURRENCES]
    assert gla[0].x_values == cases.ATTENTION_TS and gla[0].device == "cuda" and gla[0].dtype == torch.bfloat16
    gm = moe.gpu_benches()
    assert [(g.case, g.x_values, g.providers) for g in gm] == [("lowrank", cases.MOE_TOKENS, ("triton", "torch", "loop")),
                                                               ("dense", cases.MOE_TOKENS[:1], ("triton", "torch"))]
    (gc,) = cross_entropy.gpu_benches()
    assert gc.providers == ("triton", "naive", "compiled", "liger") and gc.x_values == (cases.CROSS_ENTROPY_GPU["N"],)
    for bench in [a, b, m, c, *gla, *gm, gc]:
        assert bench.baseline in bench.providers and set(bench.timing.interleave) <= set(bench.providers)
        assert all(t.provider in bench.providers and t.mode in (None, *bench.modes) for t in bench.targets)


def test_a_cpu_declaration_runs_at_smoke_sizes_into_the_schema():
    """The cross-entropy's CPU declaration at FRACTUS_SMOKE's sizes: time, memory (each provider's
    peak in a fresh process) and TFLOP/s per provider, against naive, its target judged."""
    rows = list(cross_entropy.cpu_rows(smoke=True))
    assert all(list(r) == list(COLUMNS) for r in rows)
    assert [(r["provider"], r["metric"]) for r in rows] == [(p, m) for p in ("torch", "naive")
                                                            for m in ("time", "memory", "tflops")]
    time, mem = by(rows), by(rows, "memory")
    torch_t, naive_t = time[("torch", 256)], time[("naive", 256)]
    assert naive_t["ratio_vs_baseline"] == 1.0 and torch_t["ratio_vs_baseline"] == torch_t["median"] / naive_t["median"]
    assert mem[("torch", 256)]["median"] > 0 and mem[("torch", 256)]["unit"] == "bytes"
    ratio = mem[("torch", 256)]["median"] / max(mem[("naive", 256)]["median"], 1)
    assert mem[("torch", 256)]["ratio_vs_baseline"] == ratio
    assert torch_t["target_met"] == (ratio <= 1 / 8 and torch_t["ratio_vs_baseline"] <= 1.3)
    assert torch_t["rounds"] == 2 and torch_t["threads"] == torch.get_num_threads()
