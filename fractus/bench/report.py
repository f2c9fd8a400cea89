"""What the notebooks share besides measurements: where results go, GPU results when present,
and figures saved with their provenance."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pandas as pd
import torch

from fractus.bench.common import SMOKE
from fractus.training.records import REPO, provenance

# The GPU suite's CSVs (``python -m fractus.bench gpu --out results/gpu``); FRACTUS_GPU_RESULTS reads another folder.
GPU_DIR = Path(os.environ.get("FRACTUS_GPU_RESULTS", REPO / "results" / "gpu"))


def results_dir() -> Path:
    """``results/`` for a real run; a temporary folder under FRACTUS_SMOKE=1, so that smoke runs
    (CI) never overwrite measured results."""
    out = Path(tempfile.gettempdir()) / "fractus-smoke-results" if SMOKE else REPO / "results"
    out.mkdir(parents=True, exist_ok=True)
    return out


def gpu_csv(name: str) -> pd.DataFrame | None:
    """``results/gpu/<name>.csv`` written by the GPU suite, or None when it was not measured."""
    path = GPU_DIR / f"{name}.csv"
    return pd.read_csv(path) if path.exists() else None


def aot_summary(path: str | Path = REPO / "results" / "aot_sm90.csv"):
    """``python -m fractus.bench aot``'s rows; per (op, kernel, dtype) of the ops' own rows: the
    configs compiled, the matrix instructions (each one its configs use, "/"-joined), max
    registers, min/max spill bytes and max shared memory (KiB); per preset (rows
    ``model[preset]``): the launches of its bf16 training and decode steps, their distinct
    kernels, the compile seconds they added after the ops' (a specialisation compiled before is a
    cache hit), the most spill bytes of its bf16 kernels and of its fp32 ones (the Kuramoto clock
    runs in fp32 under autocast), the most shared memory."""
    rows = pd.read_csv(path)
    is_model = rows["op"].str.startswith("model[")
    kernels = (rows[~is_model].groupby(["op", "kernel", "dtype"])
               .agg(configs=("num_warps", "size"), mma=("mma", lambda m: "/".join(sorted(set(m.dropna().astype(str))))),
                    registers=("registers", "max"),
                    spill_min_B=("spill_store_bytes", "min"), spill_max_B=("spill_store_bytes", "max"),
                    smem_KiB=("shared_bytes", lambda s: s.max() / 1024))
               .reset_index())
    spills = rows["spill_store_bytes"]
    models = (rows[is_model].assign(bf16_spill=spills.where(rows["dtype"] == "bfloat16", 0),
                                    fp32_spill=spills.where(rows["dtype"] == "float32", 0))
              .groupby("op", sort=False)
              .agg(launches=("kernel", "size"), kernels=("kernel", "nunique"), compile_s=("compile_s", "sum"),
                   bf16_spill_max_B=("bf16_spill", "max"), fp32_spill_max_B=("fp32_spill", "max"),
                   smem_KiB=("shared_bytes", lambda s: s.max() / 1024))
              .reset_index())
    return rows, kernels, models


def footnote(device: torch.device | str = "cpu") -> str:
    """A figure's provenance line: when and where it was made (a figure may hold predictions, not
    measurements: its title and note say which)."""
    p = provenance(device)
    return (f"{'SMOKE sizes — ' if SMOKE else ''}made {p['date']} on {p['device']}; "
            f"torch {p['torch']}, git {p['git_sha']}")


def save_figure(fig, path: str | Path, device: torch.device | str = "cpu", note: str | None = None) -> Path:
    """Write ``fig`` as PNG with a provenance footnote and a ``<name>.png.json`` sidecar, show
    it once in the notebook, and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.text(0.01, 0.005, footnote(device) + (f" · {note}" if note else ""), fontsize=6, color="0.4",
             ha="left", va="bottom")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    path.with_suffix(".png.json").write_text(json.dumps({**provenance(device), "smoke": SMOKE,
                                                         "note": note or ""}, indent=1))
    try:
        from IPython.display import display
        display(fig)
    except ImportError:
        pass
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
