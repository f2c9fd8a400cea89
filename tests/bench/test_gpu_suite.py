"""The GPU suite's dry run: the same code paths on CPU at tiny sizes (kernels interpreted)."""
import json
import re
import tomllib

import pandas as pd
import pytest
import torch

from fractus.bench.gpu import KERNELS, run_suite
from fractus.bench.harness import COLUMNS
from util import ROOT


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """A dry run's folder and tables (shared by the tests that read them)."""
    out = tmp_path_factory.mktemp("gpu")
    return out, run_suite(out, dry_run=True)


def test_gpu_suite_dry_run(dry_run):
    tmp_path, tables = dry_run
    assert tables["failures"].empty, tables["failures"].to_dict("records")
    for name in ["ceilings", "precompile", "trainer_resume", "train_throughput", "generation", "decode", "optimizations",
                 "profile", "correctness_offsets"] + [
            f"{s}_{k}" for k in (*KERNELS, "kuramoto") for s in ("correctness", "timing")]:
        df = pd.read_csv(tmp_path / f"{name}.csv")
        assert len(df) and {"git_sha", "device", "torch", "triton", "date"} <= set(df.columns), name
        if "dtype" in df:  # torch's names, as every CSV writes them (common.dtype_name)
            assert set(df["dtype"].dropna()) <= {"float32", "float16", "bfloat16"}, (name, set(df["dtype"]))
    for k in KERNELS:
        checks = pd.read_csv(tmp_path / f"correctness_{k}.csv")
        assert checks["passed"].all(), checks[~checks["passed"]].to_dict("records")
        assert "float32" in set(checks["dtype"]) and checks["dtype"].nunique() >= 2, k
    clock = pd.read_csv(tmp_path / "correctness_kuramoto.csv")
    assert clock["passed"].all() and len(clock) == 10, clock.to_dict("records")  # 5 checks × triton, torch
    assert set(clock["kernel"]) == {"kuramoto_phase[triton]", "kuramoto_phase[torch]"}
    pre = pd.read_csv(tmp_path / "precompile.csv")  # two workers compiled the clock's kernels for sm_90
    assert len(pre) == 2 and pre["compiled"].sum() == 3 and (pre["failed"] == 0).all()
    resumed = pd.read_csv(tmp_path / "trainer_resume.csv").iloc[0]  # on CPU: exactly the same run
    assert resumed["passed"] and resumed["max_rel_diff"] == 0 and resumed["rows"] == 6, resumed.to_dict()  # a row per step
    train = pd.read_csv(tmp_path / "train_throughput.csv")
    assert (train["tok_s"] > 0).all() and (train["mfu"] > 0).all()
    # each step predicted by the cost model (a CPU's measured ceilings stand for the datasheet)
    assert (train["peaks"] == "measured").all() and (train["launches"] > 0).all() and (train["host_op_us"] > 0).all()
    assert (train["predicted_step_s"] > 0).all()
    assert (train["prediction_error"] - (train["predicted_step_s"] / train["step_s"] - 1)).abs().max() < 1e-12
    # the baselines: every implementation's output compared with the same truth; Liger runs in the
    # interpreter and agrees; fla's kernels do not run there (its error recorded, the target not measured).
    # The timings run in bf16, as on the GPU: agreement within bf16's rounding (measured: 2e-3 to 4e-3)
    for k in (*KERNELS, "kuramoto"):  # every timing in the harness's one schema, with its derived rates
        t = pd.read_csv(tmp_path / f"timing_{k}.csv")
        assert list(t.columns[:len(COLUMNS)]) == list(COLUMNS) and (t["op"] == k).all(), k
        timed = t[t["metric"] == "time"].dropna(subset=["median"])
        rates = t[t["metric"].isin(["tflops", "gbps"])]
        assert len(timed) and len(rates) == 2 * len(timed) and (timed["median"] > 0).all() and (rates["median"] > 0).all(), k
    ce = pd.read_csv(tmp_path / "timing_cross_entropy.csv")
    errs = ce[ce["provider"].isin(["triton", "liger"]) & ce["metric"].str.startswith("rel_err_")]
    assert set(errs["metric"]) == {"rel_err_loss", "rel_err_dh", "rel_err_dw"} and len(errs) == 6
    assert (errs["median"] < 1e-2).all() and (errs["baseline"] == "naive (fp32)").all()
    la = pd.read_csv(tmp_path / "timing_linear_attention.csv")  # the default's recurrence and the original's
    assert (la["dtype"] == "bfloat16").all() and list(la["case"].unique()) == ["default", "original"]
    for kind, t in la.groupby("case"):
        fwd = t[t["mode"] == "fwd"]
        errs = fwd[fwd["metric"] == "rel_err"].set_index("provider")
        assert (errs.loc[["triton", "torch"], "median"] < 1e-2).all(), kind
        times = fwd[fwd["metric"] == "time"].set_index("provider")
        assert times.loc[["fla", "fla_numerator"], "note"].str.startswith("error:").all()  # fla's kernels: not on CPU
        assert set(t.loc[t["mode"] == "fwd+bwd", "provider"]) == {"triton", "triton_bwd64", "torch", "fla", "fla_numerator"}
        assert set(t.loc[t["mode"] == "decode", "provider"]) == {"triton", "torch"}
    target = la[la["target"].notna()]  # the default's forward+backward, and its decode step
    assert list(target["mode"]) == ["fwd+bwd", "decode"] and (target["case"] == "default").all()
    assert target.iloc[0]["target"].startswith("fwd+bwd <= 1.25x fla")
    assert target.iloc[0]["note"] == "target not measured: fla failed"
    offsets = pd.read_csv(tmp_path / "correctness_offsets.csv")  # the same code paths, at small sizes
    assert offsets["passed"].all() and len(offsets) == 22, offsets.to_dict("records")
    assert offsets["kernel"].str.split("[").str[0].nunique() == 4
    targets = pd.read_csv(tmp_path / "targets.csv").set_index("target")  # one table of the project's targets
    assert targets.loc["every kernel correct (fp32 and bf16 vs the fp32 truth)", "met"]
    assert targets.loc["every kernel correct at offsets past 2^31 elements (the last rows vs the reference)", "met"]
    assert targets.loc["the trainer on the device: stopped + --resume equals one run", "met"]
    assert targets.loc["moe: >=5x vs per-expert loop", "met"].notna().all()  # measured (tiny sizes: any verdict)
    assert pd.notna(targets.loc["linear_attention: decode >= 10x the PyTorch path", "met"])
    assert targets.loc[["train 1b in bf16: >= 150,000 tok/s", "train 1b in bf16: >= 20% MFU"], "met"].isna().all()
    model = targets.loc["cost model within ±30% of the measured training step times"]
    assert pd.notna(model["met"]) and model["value"] == train["prediction_error"].abs().max()
    assert "time and memory <= Liger" in targets.index.str.removeprefix("cross_entropy: ")
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["baselines"] == {"fla-core": "0.6.0", "liger-kernel": "0.8.5"}


def test_the_summary_prints_a_pass_fail_table_per_kernel_and_dtype(dry_run, capsys):
    from fractus.bench.gpu import pass_fail_table, print_summary
    _, tables = dry_run
    checks = pd.concat([t for n, t in tables.items() if n.startswith("correctness_")], ignore_index=True)
    dense = checks["kernel"] == "moe_dense"
    checks["passed"] &= ~dense  # as if the dense experts had failed
    table = pass_fail_table(checks)
    assert len(table) == checks.groupby(["kernel", "dtype"]).ngroups and table["checks"].sum() == len(checks)
    assert (table.loc["moe_dense", "passed"] == 0).all()
    assert (table.drop(index="moe_dense", level=0).eval("passed == checks")).all()
    assert (table["worst_err_over_tol"] < 1).all()
    others = {n: t for n, t in tables.items() if not n.startswith("correctness_")}
    print_summary({**others, "correctness_all": checks}, 1.0)
    out = capsys.readouterr().out
    assert f"kernel checks: {len(checks) - dense.sum()}/{len(checks)} passed" in out
    assert table.to_string(float_format=lambda x: f"{x:.2g}") in out


def test_notebooks_read_a_gpu_runs_tables(dry_run, tmp_path, monkeypatch):
    """Notebooks 01-04 say "not measured" until results/gpu/ exists; here their GPU sections run on
    a dry run's tables (FRACTUS_GPU_RESULTS), with training rows relabelled as the sweep's (one
    measured, one preset whose every configuration failed) and the optimizations' as bf16 autocast's, so
    that a GPU run's tables never meet code that has not run."""
    import shutil

    import nbformat
    from nbclient import NotebookClient
    gpu_dir = tmp_path / "gpu"
    shutil.copytree(dry_run[0], gpu_dir)
    train = pd.read_csv(gpu_dir / "train_throughput.csv")  # the tiny preset's, and as if the sweep's:
    measured = train.iloc[:1].assign(preset="palier0", batch_size=8, chunk_len=128)  # a measured row,
    failed = [{"preset": "1b", "batch_size": b, "chunk_len": 128, "tok_s": None, "mfu": None,  # a preset
               "error": "out of memory"} for b in (8, 32)]  # whose every configuration failed
    pd.concat([train, measured, pd.DataFrame(failed)]).to_csv(gpu_dir / "train_throughput.csv", index=False)
    opts = pd.read_csv(gpu_dir / "optimizations.csv")  # and as if in bf16 autocast but the fp32 variant
    opts.loc[opts["optimization"] != "fp32 (no autocast)", "dtype"] = "bfloat16"
    opts.to_csv(gpu_dir / "optimizations.csv", index=False)
    monkeypatch.setenv("FRACTUS_SMOKE", "1")
    monkeypatch.setenv("FRACTUS_GPU_RESULTS", str(gpu_dir))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # their smoke results apart from nbval's runs of them (pytest -n)
    notebooks = ROOT / "notebooks"
    for path in sorted(notebooks.glob("0[1-4]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(notebooks)}}).execute()
        text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                         for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
        assert not re.search(r"not measured on a GPU yet|No GPU run yet", text), path.name
        assert ("bf16 autocast: " in text) == path.name.startswith("02_"), path.name


def test_gpu_suite_time_limit_skips_parts(tmp_path):
    (tmp_path / "ceilings.csv").write_text("copy_gbs\n1.0\n")  # an earlier run's: gone, not read beside this one's
    tables = run_suite(tmp_path, dry_run=True, time_limit_s=-1.0)  # spent before the first part
    f = pd.read_csv(tmp_path / "failures.csv")
    assert len(f) == len(tables["failures"]) >= 12 and f["error"].str.startswith("skipped: the time limit").all()
    assert {"ceilings", "correctness_linear_attention", "train_throughput", "profile"} <= set(f["part"])
    assert (tmp_path / "provenance.json").exists() and not (tmp_path / "ceilings.csv").exists()
    assert not (pd.read_csv(tmp_path / "targets.csv")["met"] == True).any()  # noqa: E712  nothing measured, nothing met


def test_gpu_suite_runs_the_rest_in_a_fresh_process_after_cuda_context_loss(tmp_path, monkeypatch):
    """An illegal address fails every later CUDA call of the process: the parts after it run in a
    fresh one (where the part that failed here runs fine), and their tables come back."""
    import time

    from fractus.bench import gpu

    def illegal_address(device, dry_run):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(gpu, "generation_rows", illegal_address)
    monkeypatch.setattr(gpu, "cuda_context_lost", lambda device: True)
    names = ["correctness_kuramoto", "generation", "timing_kuramoto", "generation"]
    tables, failures = gpu.run_parts(tmp_path, names, dry_run=True, t_start=time.time())
    assert [f["part"] for f in failures] == ["generation"] and "illegal memory access" in failures[0]["error"]
    assert set(tables) == {"correctness_kuramoto", "timing_kuramoto", "generation"}
    clock = tables["timing_kuramoto"]
    assert (tables["generation"]["tok_s"] > 0).all() and clock.loc[clock["metric"] == "time", "median"].notna().all()
    assert not (tmp_path / gpu.RESULT_FILE).exists()


def test_gpu_suite_records_parts_whose_fresh_process_died(tmp_path, monkeypatch):
    import shutil
    import time

    from fractus.bench import gpu
    monkeypatch.setattr(gpu, "generation_rows", lambda device, dry_run: 1 / 0)
    monkeypatch.setattr(gpu, "cuda_context_lost", lambda device: True)
    monkeypatch.setattr(gpu.sys, "executable", shutil.which("false"))  # the fresh process exits at once
    tables, failures = gpu.run_parts(tmp_path, ["generation", "optimizations", "profile"], True, time.time())
    assert tables == {} and [f["part"] for f in failures] == ["generation", "optimizations", "profile"]
    assert all(f["error"].endswith("from optimizations exited with code 1") for f in failures[1:])


def test_gpu_suite_stops_a_fresh_process_that_outlives_the_time_limit(tmp_path, monkeypatch):
    import time

    from fractus.bench import gpu
    monkeypatch.setattr(gpu, "generation_rows", lambda device, dry_run: 1 / 0)
    monkeypatch.setattr(gpu, "cuda_context_lost", lambda device: True)
    monkeypatch.setattr(gpu, "LAST_PART_S", -999.0)  # time limit 1000 s: the fresh process gets 1 s
    t0 = time.time()
    tables, failures = gpu.run_parts(tmp_path, ["generation", "optimizations"], True, t0, time_limit_s=1000.0)
    # SIGTERM while it starts (killed: "was stopped after 1 s") or inside its part (it hands back "stopped")
    assert tables == {} and [f["part"] for f in failures] == ["generation", "optimizations"]
    assert failures[1]["error"].endswith("was stopped after 1 s (the time limit)") or \
        failures[1]["error"] == "stopped: signal SIGTERM", failures[1]
    assert time.time() - t0 < 40


def test_sigterm_stops_the_running_part_and_keeps_what_was_measured(tmp_path, monkeypatch):
    """`timeout` sends SIGTERM: the part running stops (keeping the rows it measured), the later
    ones are listed, nothing measured is lost."""
    import os
    import signal
    import time

    from fractus.bench import gpu

    def killed(device, dry_run):  # a row measured, then the signal
        yield {"preset": "tiny", "tok_s": 1.0}
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    monkeypatch.setattr(gpu, "generation_rows", killed)
    before, t0 = signal.getsignal(signal.SIGTERM), time.time()
    with gpu.stop_on_sigterm():
        tables, failures = gpu.run_parts(tmp_path, ["correctness_kuramoto", "generation", "optimizations"], True,
                                          t0)
        os.kill(os.getpid(), signal.SIGTERM)  # `timeout` signals the process, then its group: the second is ignored
        time.sleep(0.2)
    assert time.time() - t0 < 20 and set(tables) == {"correctness_kuramoto", "generation"}
    assert (tmp_path / "correctness_kuramoto.csv").exists()
    assert pd.read_csv(tmp_path / "generation.csv")["tok_s"].tolist() == [1.0]  # the stopped part's row
    assert failures == [{"part": n, "error": "stopped: signal SIGTERM", "trace": ""}
                        for n in ("generation", "optimizations")]
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_after_a_part_ended_lists_only_the_later_ones(tmp_path):
    """A SIGTERM while the outcome of a finished part is written: that part is not listed as stopped."""
    import os
    import signal
    import time

    from fractus.bench import gpu

    def after(tables, failures):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    with gpu.stop_on_sigterm():
        tables, failures = gpu.run_parts(tmp_path, ["correctness_kuramoto", "generation"], True, time.time(),
                                          after_part=after)
    assert set(tables) == {"correctness_kuramoto"}
    assert failures == [{"part": "generation", "error": "stopped: signal SIGTERM", "trace": ""}]


def test_a_part_failing_midway_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    import time

    from fractus.bench import gpu

    def half(device, dry_run):
        yield {"preset": "tiny", "tok_s": 1.0}
        raise RuntimeError("the second preset failed")
    monkeypatch.setattr(gpu, "generation_rows", half)
    tables, failures = gpu.run_parts(tmp_path, ["generation", "correctness_kuramoto"], True, time.time())
    assert [f["part"] for f in failures] == ["generation"] and "second preset" in failures[0]["error"]
    assert pd.read_csv(tmp_path / "generation.csv")["tok_s"].tolist() == [1.0]
    assert len(tables["generation"]) == 1 and tables["correctness_kuramoto"]["passed"].all()


def test_a_failing_training_configuration_does_not_lose_the_sweep(monkeypatch):
    from fractus.bench import gpu
    real = gpu.measure_training

    def flaky(preset, **kw):
        if kw["batch_size"] == 1:
            raise RuntimeError("Triton Error [CUDA]: misaligned address")
        return real(preset, **kw)
    monkeypatch.setattr(gpu, "measure_training", flaky)
    rows = list(gpu.train_rows(torch.device("cpu"), dry_run=True, peaks={"bf16_tflops": 1.0, "hbm_gbs": 1.0, "peaks": "measured"}))
    assert [r["batch_size"] for r in rows] == [b for _, bs, _ in gpu.DRY_SWEEP for b in bs]
    assert rows[0]["error"].startswith("RuntimeError: Triton Error") and rows[1]["tok_s"] > 0


def test_the_training_sweep_measures_each_presets_own_model(monkeypatch):
    """train_rows builds its models from train_setup, which the precompile and the cost model's
    launch counts (notebook 04) also take: all must be the preset's model at the sweep's chunk."""
    from fractus.bench import gpu
    from fractus.model import FractusConfig
    seen, sweep = [], gpu.TRAIN_SWEEP
    monkeypatch.setattr(gpu, "measure_training", lambda preset, **kw: seen.append((preset, kw)) or {"tok_s": 1.0})
    monkeypatch.setattr(gpu, "TRAIN_SWEEP", sweep[:1])
    list(gpu.train_rows(torch.device("cpu"), dry_run=False, peaks={"bf16_tflops": 1.0, "hbm_gbs": 1.0, "peaks": "measured"}))
    (preset, batches, chunk), = sweep[:1]
    assert [kw["batch_size"] for _, kw in seen] == list(batches)
    for p, kw in seen:
        over = {k: v for k, v in kw.items() if k in FractusConfig.__dataclass_fields__}
        assert FractusConfig.preset(p, **over) == FractusConfig.preset(preset) and kw["chunk_len"] == chunk
        assert (kw["head_positions"], kw["accum"], kw["optimizer"]) == ("all", 1, "sgd")
    for p, _, c in sweep + gpu.DRY_SWEEP:
        rec = gpu.train_setup(p, c)
        assert rec.config() == FractusConfig.preset(p) and rec.chunk_len == c
    compiled = [(p, kw["batch_size"], kw["chunk_len"],
                 FractusConfig.preset(p, **{k: v for k, v in kw.items() if k in fields}))
                for p, kw in gpu.model_runs() if kw["steps"] and kw["head_positions"] == "all"
                for fields in [FractusConfig.__dataclass_fields__]]
    for p in ("palier0", "palier2"):
        for b in (8, 16):
            assert (p, b, chunk, FractusConfig.preset(p)) in compiled


def test_nvidia_driver_version_from_nvidia_smi(tmp_path, monkeypatch):
    from fractus.bench.gpu import nvidia_driver
    monkeypatch.setenv("PATH", str(tmp_path))
    assert nvidia_driver() == "unknown (FileNotFoundError)"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 580.159.03\n")
    smi.chmod(0o755)
    assert nvidia_driver() == "580.159.03"


def test_gpu_wheels_carry_the_bench_baselines_and_the_pinned_runtime_dependencies():
    """For a GPU machine without network: every pinned pure-Python dependency and every baseline
    must be among the wheels `make gpu-wheels` downloads."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {d for d in project["dependencies"] if re.fullmatch(r"[\w.-]+==[\w.]+", d)}
    pinned |= set(project["optional-dependencies"]["bench"])
    wheels = set(re.search(r"^GPU_WHEELS \?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split())
    assert pinned <= wheels, pinned - wheels


def test_a_failing_moe_implementation_keeps_the_others_rows(monkeypatch):
    from fractus.bench import moe
    real = moe._impl

    def impl(name):
        if name == "loop":
            def fail(*args):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            return fail
        return real(name)
    monkeypatch.setattr(moe, "_impl", impl)
    rows = list(moe.gpu_rows(smoke=True))
    loop = [r for r in rows if r["provider"] == "loop"]
    assert loop and all(r["metric"] == "time" and r["note"].startswith("error: OutOfMemoryError")
                        and r["median"] is None for r in loop)
    tri = [r for r in rows if r["provider"] == "triton" and r["case"] == "lowrank" and r["metric"] == "time"]
    assert tri and all(r["median"] > 0 and r["ratio_vs_baseline"] > 0 and r["baseline"] == "torch"
                       and r["target_met"] is None for r in tri)
    assert all(r["target"] == ">=5x vs per-expert loop" for r in tri)


def test_an_offsets_case_that_fails_keeps_the_others_rows(monkeypatch):
    from fractus.verify import offsets

    def fail(device, scale, gen):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setitem(offsets.CASES, "moe", fail)
    rows = list(offsets.correctness_rows("cpu", smoke=True))
    bad = [r for r in rows if not r["passed"]]
    assert [r["kernel"] for r in bad] == ["moe[offsets (smoke: small)]"] and "OutOfMemoryError" in bad[0]["check"]
    assert len(rows) == 20 and {r["kernel"].split("[")[0] for r in rows} == {
        "linear_attention", "cross_entropy", "moe", "kuramoto_phase"}


def test_the_outcome_is_written_after_every_part(tmp_path, monkeypatch):
    """targets.csv and failures.csv stand after each part: a suite killed later still leaves them."""
    import time

    from fractus.bench import gpu
    monkeypatch.setattr(gpu, "generation_rows", lambda device, dry_run: 1 / 0)
    seen = []
    gpu.run_parts(tmp_path, ["correctness_kuramoto", "generation"], True, time.time(),
                   after_part=lambda tables, failures: seen.append((sorted(tables), [f["part"] for f in failures])))
    assert seen == [(["correctness_kuramoto"], []), (["correctness_kuramoto"], ["generation"])]
    targets = pd.DataFrame(gpu.target_rows({}))
    assert targets["met"].isna().all()  # nothing measured, nothing met or missed


def test_the_correctness_parts_run_with_poisoned_outputs(tmp_path, monkeypatch):
    """Their checks see NaN wherever a kernel left an output unwritten (also outside pytest's poisoning)."""
    import time

    from fractus.bench import cross_entropy, gpu
    from fractus.ops import common as backend
    seen = []

    def rows(device, smoke):
        seen.append(backend._POISON)
        return [{"kernel": "x", "dtype": "float32", "check": "y", "rel_err": 0.0, "tol": 1.0, "passed": True}]
    monkeypatch.setattr(cross_entropy, "correctness_rows", rows)
    monkeypatch.setattr(cross_entropy, "gpu_rows", lambda smoke: rows(None, smoke))
    monkeypatch.setattr(backend, "_POISON", False)  # as outside pytest
    gpu.run_parts(tmp_path, ["correctness_cross_entropy", "timing_cross_entropy"], True, time.time())
    assert seen == [True, False] and not backend._POISON  # the timings are not poisoned
