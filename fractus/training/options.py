"""The trainer's command line: its options (:func:`build_parser`, described to the user by
:data:`DESCRIPTION`), ``--set``'s overrides (:func:`parse_overrides`) and the model config they make
with the data's vocabulary (:func:`make_config`). :mod:`fractus.training.loop` trains one run with
the parsed options, :mod:`fractus.training.schedule` a schedule of runs, and
:mod:`fractus.training.command` runs either.
"""
from __future__ import annotations

import argparse

import torch

from fractus.baseline import TransformerConfig
from fractus.cli import device_name, natural, non_negative, number, positive_int, seed_number
from fractus.model import PRESETS, FractusConfig
from fractus.ops.common import BACKENDS
from fractus.grow import DEPTHS
from fractus.training.optim import ADAMW_LR, DECAY_FRACTION, DEFAULT_LR, LR_SHAPES, WARMUP_FRACTION
from fractus.training.resume import SAMPLING

DESCRIPTION = """Train a Fractus CTE or the Transformer++ on prepared tokens: ``python -m fractus.train --preset palier0 --data DIR --tokens N --out DIR``.

Each micro-step reads B windows of C tokens of the training split, shuffled, each from an empty
state (``--sampling windows``, the default), or the next C-token chunk of B contiguous streams,
the attention state carried, detached, across chunks (``--sampling streams``). An optimizer step accumulates ``--accum`` micro-steps. Validation reports cross-entropy in
nats/token, bits per byte and perplexity on the held-out split. Checkpoints hold model,
optimizer, scheduler, data position, every process's carried state and RNG, and the provenance
of each training session (rank 0's process) from the step it started at (``sessions``:
:mod:`fractus.training.records` writes a finished run's metrics with it), and are written atomically;
``--resume`` continues exactly, after the checks of :mod:`fractus.training.resume`.
``--grow-from CKPT`` starts from a checkpoint grown to the preset (:mod:`fractus.grow`: same
logits) with a fresh optimizer. SIGINT/SIGTERM save, then exit with code 128 + the signal's number
(130, 143); ``--stop-after`` saves and exits with 0. A run holds a lock on its directory
(``OUT/.lock``, released by the OS when the process ends: :mod:`fractus.training.runs`): a second run on it
is refused. Several processes:
``torchrun --nproc_per_node=N -m fractus.train …`` (:mod:`fractus.training.ddp`; gloo on CPU, NCCL on CUDA;
gradients are all-reduced once per optimizer step, on its last micro-step).
"""

# The largest --lr and --weight-decay: far above any useful value, and small enough that every
# factor the optimizers derive from them (lr · weight decay, AdamW's lr / (1 − β1)) fits in float32,
# which torch converts them to (beyond it: an overflow error inside the optimizer's step).
MAX_RATE = 1e6
STAGE_LR = ("restart", "continue")  # --stage-lr
rate = number(float, lambda x: 0 <= x <= MAX_RATE, f"≥ 0 and ≤ {MAX_RATE:g}")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m fractus.train``'s arguments (a schedule's too: ``--schedule``)."""
    ap = argparse.ArgumentParser(prog="python -m fractus.train", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--model", default="cte", choices=("cte", "transformer"),
      help="the Fractus CTE, or the Transformer++ it is measured against (fractus.baseline: the preset's "
           "width and depth, heads of 32, a context of --chunk-len, no carried state)")
    a("--preset", default="palier0", choices=sorted(PRESETS),
      help="the model's dimensions (docs/model.md, section 6); its vocabulary is the data's")
    a("--data", required=True, help="directory written by `python -m fractus.data prepare`")
    a("--out", required=True, help="run directory: checkpoints, metrics.csv")
    a("--tokens", type=positive_int, default=3_000_000, help="training tokens (all processes together)")
    a("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides, e.g. n_layers=4")
    a("--batch-size", type=positive_int, default=8, help="windows (or streams) per process (B)")
    a("--chunk-len", type=positive_int, default=256, help="positions per window or chunk (C)")
    a("--sampling", choices=SAMPLING, default="windows",
      help="windows: B non-overlapping windows of C tokens each micro-step, each from a fresh state, every "
           "window once an epoch in a random order; streams: B contiguous streams read chunk after chunk, "
           "the state carried from one to the next. Validation reads B contiguous streams, the state "
           "carried, either way (the transformer: sliding windows)")
    a("--accum", type=positive_int, default=1, help="micro-steps per optimizer step")
    a("--head-positions", default="all", choices=("all", "last"))
    a("--detach-kuramoto", action="store_true")
    a("--optimizer", default="adamw", choices=("sgd", "adamw", "rmsprop"))
    a("--lr", type=rate, default=None, help=f"peak learning rate (default: AdamW's tuned per model, {ADAMW_LR}; "
                                              f"SGD's {DEFAULT_LR['sgd']}, RMSprop's {DEFAULT_LR['rmsprop']})")
    a("--weight-decay", type=rate, default=0.1, help="weight decay of the matrices (the embedding included; not gains or biases)")
    a("--warmup", type=natural, default=None,
      help=f"linear warm-up, in optimizer steps (default: {WARMUP_FRACTION * 100:g} %% of the run's steps)")
    a("--min-lr-ratio", type=number(float, lambda x: 0 <= x <= 1, "≥ 0 and ≤ 1"), default=0.1,
      help="cosine decay floor, as a fraction of --lr")
    a("--lr-shape", choices=LR_SHAPES, default="cosine",
      help="the rate after the warm-up: cosine (down to --min-lr-ratio at the last step) or wsd "
           "(warmup-stable-decay: the peak, then linearly down to --min-lr-ratio over the last --decay-fraction)")
    a("--decay-fraction", type=number(float, lambda x: 0 < x <= 1, "> 0 and ≤ 1"), default=DECAY_FRACTION,
      help="wsd: the final fraction of the steps (after the warm-up) over which the rate decays")
    a("--grad-clip", type=non_negative, default=1.0, help="gradient norm clip (0 = none)")
    a("--lb-coef", type=float, default=None, help="load-balance coefficient (default: config's)")
    a("--active-blocks", type=natural, default=0, help="PGSU: blocks that get weight gradients per step (0 = all)")
    a("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast (default: on for CUDA)")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    a("--backend", default="auto", choices=BACKENDS)
    a("--eval-every", type=natural, default=200, help="optimizer steps between validations (0 = end only)")
    a("--eval-tokens", type=positive_int, default=65_536,
      help="validation tokens per periodic evaluation (whole chunks of every stream, at least one)")
    a("--ckpt-every", type=natural, default=200, help="optimizer steps between checkpoints (0 = end only)")
    a("--max-nan", type=positive_int, default=3,
      help="stop after this many consecutive non-finite steps (loss or gradient)")
    a("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    a("--stop-after", type=positive_int, default=None, metavar="STEPS",
      help="save and stop after STEPS optimizer steps of this invocation, as on SIGTERM (for jobs "
           "with a time limit; continue with --resume)")
    a("--grow-from", metavar="CKPT",
      help="start from CKPT's model grown to the preset (fresh optimizer; ignored with --resume)")
    a("--grow-depth", choices=DEPTHS, default="interleave",
      help="--grow-from's new blocks: interleave (blocks that add nothing, between the old ones: the same "
           "logits) or stack (the trained blocks repeated, G_stack; the logits change)")
    a("--schedule", metavar="PRESET:TOKENS,…",
      help="progressive growth in one run: train each stage's preset for its tokens, then grow into the next "
           "(e.g. palier0:3M,palier1:6M; a stage may add :lr=LR, :warmup=STEPS and :depth=stack); replaces "
           "--preset and --tokens; stages in OUT/<i>-<preset>, one record in OUT/metrics.csv "
           "(fractus.training.schedule)")
    a("--stage-lr", choices=STAGE_LR, default="restart",
      help="--schedule: each stage's rate on a curve of its own (restart) or every stage on one curve over the "
           "whole schedule (continue), each grown stage ramping up to it over its warm-up")
    a("--sample-tokens", type=natural, default=40, help="tokens generated per prompt at the end (0 = none)")
    a("--seed", type=seed_number, default=1337)
    a("--threads", type=natural, default=0, help="torch CPU threads (0 = torch's default)")
    a("--no-progress", action="store_true", help="no tqdm bar")
    # where a schedule's stage reads the schedule's one rate curve (--stage-lr continue): set by
    # fractus.training.schedule, not on the command line (lr_lambda's offset, span, decay_start)
    ap.set_defaults(lr_offset=0, lr_span=None, lr_decay_start=None)
    return ap


def parse_overrides(pairs: list[str]) -> dict:
    """``--set``'s ``KEY=VALUE`` pairs as a dict, each value an int, a float, a bool (true, false)
    or else the text; ValueError on a pair without "=" or a key given twice."""
    out = {}
    for kv in pairs:
        if "=" not in kv:
            raise ValueError(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        if k in out:
            raise ValueError(f"--set {k} given twice")
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


# Settings with their own flag (config fields, and the chunk length, a training setting the config
# does not hold): --set refuses them, so that one setting has one way in.
FLAG_FIELDS = {"chunk_len": "--chunk-len", "backend": "--backend", "detach_kuramoto": "--detach-kuramoto",
               "lb_coef": "--lb-coef"}


def make_config(args, vocab_size: int) -> FractusConfig | TransformerConfig:
    """The model's config: the preset with ``--set``'s overrides and the data's vocabulary (for
    ``--model transformer``: the preset's d_model and n_layers, a context of ``--chunk-len``)."""
    over = parse_overrides(args.set)
    if args.model == "transformer":
        cte_only = [flag for flag, on in (("--detach-kuramoto", args.detach_kuramoto), ("--lb-coef", args.lb_coef),
                                          ("--active-blocks", args.active_blocks), ("--grow-from", args.grow_from),
                                          ("--head-positions last", args.head_positions == "last")) if on]
        if cte_only:
            raise ValueError(f"--model transformer has no {', '.join(cte_only)}: they are the Fractus CTE's")
        if "context" in over or "backend" in over:
            raise ValueError("set the transformer's context with --chunk-len and its backend with --backend, not --set")
        dims = {k: PRESETS[args.preset][k] for k in ("d_model", "n_layers")}
        return TransformerConfig.from_saved({**dims, "vocab_size": vocab_size, **over, "context": args.chunk_len,
                                    "backend": args.backend})
    flagged = {k: FLAG_FIELDS[k] for k in over if k in FLAG_FIELDS}
    if flagged:
        raise ValueError("set these with their own flags, not --set: "
                         + ", ".join(f"{k} → {f}" for k, f in flagged.items()))
    over.setdefault("vocab_size", vocab_size)
    over["backend"] = args.backend
    if args.detach_kuramoto:
        over["detach_kuramoto"] = True
    if args.lb_coef is not None:
        over["lb_coef"] = args.lb_coef
    cfg = FractusConfig.preset(args.preset, **over)
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"the model's vocab_size {cfg.vocab_size} differs from the data's {vocab_size}")
    return cfg
