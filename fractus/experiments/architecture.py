"""The architecture ablation: which of the CTE's parts and levers make it learn.

Every :class:`Variant` is trained by the trainer itself (:func:`fractus.training.command.train`, the CLI's
code) on the same prepared tokens, the same number of them, from the same seeds, and evaluated
on the whole held-out split: the original architecture, each lever of the default recipe added to
it alone, the recipe, the recipe with each lever taken out or one more added, the recipe without
the CTE's distinctive parts (its levels, its Kuramoto clock), and the softmax transformer of the
same width and depth (the Transformer++, ``--model transformer``). :func:`run` writes one row per (variant, seed) with the
final validation CE (nats/token), bits per byte, perplexity, training seconds and tokens/s;
:func:`summary` gives their mean and range over the seeds. The notebook ``06_architecture`` drives it.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from fractus.experiments import runner
from fractus.model import ORIGINAL, FractusConfig
from fractus.training.records import append_csv
from fractus.training.optim import default_lr

STEP_TOKENS = 2048  # tokens per optimizer step, every variant (make demo's: 8 windows × 256 positions)
LEVER_NAMES = {"attn_decay": "multi-scale decay", "attn_norm": "RMSNorm read-out (no denominator)",
               "attn_gate": "swish output gate", "short_conv": "short convolution", "qk_norm": "RMS-normalised q, k",
               "shared_expert": "shared expert", "expert_init_std": "expert output init",
               "eot_reset": "state reset at end of text", "attn_window": "softmax window level",
               "decay_gate": "decay gate"}
# Levers tried beside the recipe and not kept: the value each is tried with ("2d": twice d_model).
TRIED = {"attn_norm": "rms", "qk_norm": True, "eot_reset": True, "shared_expert": "2d"}


@dataclass(frozen=True)
class Variant:
    """One model to train: ``model`` "cte" (``preset`` with ``changes`` as --set overrides) or
    "transformer" (the Transformer++ of ``preset``'s width and depth, a context of ``chunk_len``)."""
    name: str
    group: str  # "original", "lever", "recipe", "recipe −", "recipe +", "parts", "baseline" or "sampling"
    model: str = "cte"
    preset: str = "palier0"
    changes: tuple = field(default=())  # ((config field, value), …)
    chunk_len: int = 256
    batch_size: int = 8  # windows or streams; accumulation: STEP_TOKENS / (batch_size · chunk_len)
    sampling: str | None = None  # the trainer's --sampling (None: its default, shuffled windows)
    warmup: int | None = None  # the trainer's --warmup, in optimizer steps (None: its default, 5 % of the run's)

    @property
    def lr(self) -> float:
        """Its peak learning rate: the trainer's default, AdamW's tuned rate for its model family."""
        return default_lr("adamw", self.model, self.preset)

    @property
    def changes_cli(self) -> str:
        """``changes`` as one string, field=value;… (the ablation CSV's ``changes`` column)."""
        return ";".join(f"{k}={_cli(v)}" for k, v in self.changes)

    def argv(self, data, out, tokens: int, seed: int, threads: int) -> list[str]:
        """The trainer's command line for this variant."""
        accum = max(1, STEP_TOKENS // (self.batch_size * self.chunk_len))
        sets = [f"{k}={_cli(v)}" for k, v in self.changes]
        return ["--model", self.model, "--preset", self.preset, "--data", str(data), "--out", str(out),
                "--tokens", str(tokens), "--batch-size", str(self.batch_size), "--chunk-len", str(self.chunk_len),
                "--accum", str(accum), "--seed", str(seed), "--threads", str(threads), "--eval-every", "0",
                "--ckpt-every", "0", "--sample-tokens", "0", "--no-progress", *(["--set", *sets] if sets else []),
                *(["--sampling", self.sampling] if self.sampling else []),
                *(["--warmup", str(self.warmup)] if self.warmup is not None else [])]


def _cli(v) -> str:
    """A config value as --set reads it."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def recipe_levers(preset: str) -> dict:
    """The levers where ``preset``'s default differs from the original architecture: field → value."""
    cfg, given = FractusConfig.preset(preset), FractusConfig.preset(preset).to_dict()
    named = {"attn_decay": "multiscale"} if cfg.decays != (1.0,) * cfg.n_heads else {}
    return {k: named.get(k, given[k]) for k in ORIGINAL if k in named or given[k] != ORIGINAL[k]}


def variants(preset: str = "palier0", tried: dict = TRIED, parts: bool = True) -> list[Variant]:
    """The ablation at ``preset``'s dimensions: the original; each lever of the recipe alone on
    it; the recipe; the recipe without each lever and with each of ``tried``; with ``parts``, the
    recipe with one level and with the linear router (no Kuramoto clock); the transformer
    (context 256; every variant reads 8 windows of 256, 2,048 tokens a step)."""
    levers = recipe_levers(preset)
    original = f"original-{preset}"
    out = [Variant("original", "original", preset=original)]
    out += [Variant(f"original + {LEVER_NAMES[k]}", "lever", preset=original, changes=((k, v),))
            for k, v in levers.items()]
    out.append(Variant("recipe (default)", "recipe", preset=preset))
    out += [Variant(f"recipe − {LEVER_NAMES[k]}", "recipe −", preset=preset, changes=((k, ORIGINAL[k]),))
            for k in levers]
    d = FractusConfig.preset(preset).d_model
    out += [Variant(f"recipe + {LEVER_NAMES[k]}", "recipe +", preset=preset, changes=((k, 2 * d if v == "2d" else v),))
            for k, v in tried.items() if k not in levers]
    if parts:
        out += [Variant("recipe, one level", "parts", preset=preset, changes=(("n_levels", 1),)),
                Variant("recipe, linear router (no clock)", "parts", preset=preset, changes=(("router", "linear"),))]
    out.append(Variant("transformer", "baseline", model="transformer", preset=preset))
    return out


def train_variant(v: Variant, data, tokens: int, seed: int, threads: int = 1) -> dict:
    """Train ``v`` for ``tokens`` tokens from ``seed`` in a temporary run directory on ``threads``
    CPU threads; its final validation (the whole held-out split) and training time."""
    from fractus.training.command import train  # in the worker process
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        last = train(v.argv(data, Path(out) / "run", tokens, seed, threads))
        wall = time.perf_counter() - t0
    return {"variant": v.name, "group": v.group, "model": v.model, "preset": v.preset,
            "changes": v.changes_cli, "lr": v.lr, "seed": seed, "tokens": last["tokens"],
            "chunk_len": v.chunk_len, "batch_size": v.batch_size, "val_ce": last["val_ce"], "val_bpb": last["val_bpb"],
            "val_ppl": last["val_ppl"], "train_s": last["elapsed_s"], "tok_s": last["tokens"] / last["elapsed_s"],
            "wall_s": wall, "threads": threads}


def trained_tokens(tokens: int) -> int:
    """The tokens a run asked for ``tokens`` trains on: whole optimizer steps of STEP_TOKENS."""
    return -(-tokens // STEP_TOKENS) * STEP_TOKENS


def run(vs: list[Variant], data, tokens: int, seeds=(0, 1, 2), csv: Path | None = None, workers: int = 2,
        threads: int = 1, log=print) -> pd.DataFrame:
    """Every variant from every seed, in ``workers`` fresh processes of ``threads`` threads each
    (each run beside as many others, so that their speeds compare), seed by seed; each row
    appended to ``csv`` with its provenance as it finishes. A (variant, seed) whose row for the
    same changes and tokens is already in ``csv`` is kept rather than trained again, so that an
    interrupted ablation resumes; delete ``csv`` to start afresh. Returns the rows in job order."""
    jobs = [(v, seed) for seed in seeds for v in vs]
    rows: dict[int, dict] = {}
    done = {}
    if csv is not None and Path(csv).exists():
        for r in pd.read_csv(csv, keep_default_na=False).to_dict("records"):
            if "lr" in r:  # a row from before the rates were recorded says nothing of its rate
                done[(r["variant"], r["model"], r["preset"], r["changes"], float(r["lr"]), int(r["batch_size"]),
                      int(r["chunk_len"]), int(r["seed"]), int(r["tokens"]))] = r
    for i, (v, seed) in enumerate(jobs):
        key = (v.name, v.model, v.preset, v.changes_cli, v.lr, v.batch_size, v.chunk_len, seed, trained_tokens(tokens))
        if key in done:
            rows[i] = done[key]
    if rows:
        log(f"{len(rows)} of {len(jobs)} runs kept from {csv}")
    with runner.held(csv) if csv is not None else contextlib.nullcontext(), runner.Workers(workers) as pool:
        for i, (v, seed) in enumerate(jobs):
            if i not in rows:
                pool.submit(i, train_variant, v, data, tokens, seed, threads)
        for i, r in pool.done():
            rows[i] = r
            if csv is not None:
                append_csv(csv, r)
            log(f"seed {r['seed']} {r['variant']:48s} val CE {r['val_ce']:.4f}  {r['val_bpb']:.4f} bits/byte  "
                f"{r['tok_s']:,.0f} tok/s  {r['train_s']:.0f} s")
    return pd.DataFrame([rows[i] for i in range(len(jobs))])


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per variant (in the order run): validation CE and bits per byte as mean, min and max over
    the seeds, mean tokens/s and training seconds, and the mean CE and time against the
    transformer's (when it ran)."""
    g = rows.groupby("variant", sort=False)
    out = pd.DataFrame({
        "group": g["group"].first(), "seeds": g["seed"].nunique(),
        "val_ce": g["val_ce"].mean(), "val_ce_min": g["val_ce"].min(), "val_ce_max": g["val_ce"].max(),
        "val_bpb": g["val_bpb"].mean(), "val_bpb_min": g["val_bpb"].min(), "val_bpb_max": g["val_bpb"].max(),
        "tok_s": g["tok_s"].mean(), "train_s": g["train_s"].mean()})
    base = out[out["group"] == "baseline"]
    if len(base):
        out["ce_vs_transformer"] = out["val_ce"] - base["val_ce"].iloc[0]
        out["time_vs_transformer"] = out["train_s"] / base["train_s"].iloc[0]
    return out


def paired(rows: pd.DataFrame, a: str, b: str) -> pd.Series:
    """Per seed, variant ``a``'s validation CE minus ``b``'s (both trained from that seed)."""
    ce = rows.pivot(index="seed", columns="variant", values="val_ce")
    return ce[a] - ce[b]
