"""Vision: an image read as a sequence of patch ticks, answered in text through the tied head.

An image [C, H, W] is cut into non-overlapping p×p patches, read in raster order; a patch
embedding (a p-strided p×p convolution, i.e. one linear map per patch, plus a learned
position embedding per patch) maps each to a d-vector, which takes the place of a token
embedding: the patches run through :meth:`FractusCTE.forward_embeds` as one chunk
(training, prefill) or through :meth:`FractusCTE.tick_vec` one patch at a time (decode), with
the same carried state as text, and give the same logits. After the image's ticks the model
writes the label as text of the project's tokenizer (``"seven"``, then EOT), so the loss is
the language model's cross-entropy on those tokens and an answer is a greedy decode.

Task: the 1,797 8×8 handwritten digits that scikit-learn ships inside its wheel
(:func:`sklearn.datasets.load_digits`, no download; ``pip install -e .[vision]``), split by a
fixed seed into train and held-out (stratified, 20 % held out); the writers overlap between the
two splits. ``python -m fractus.vision train --out DIR`` trains (progress bar, per-epoch
``metrics.csv`` rows with held-out accuracy and provenance, an atomic checkpoint every epoch,
``--resume``, SIGINT/SIGTERM save then exit with 128 + the signal's number); ``python -m
fractus.vision evaluate CKPT`` reports a checkpoint's held-out accuracy. :func:`grow_vision`
grows a vision model like :func:`fractus.grow.grow` (same logits).

Shapes: B images, C channels, H = W = image_size, p = patch, N = (H/p)·(W/p) patches, d = d_model,
V = vocab_size, K classes, L = the longest label's tokens + EOT.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

from fractus.checkpoint import CheckpointError, load_checkpoint, load_model_state, save_checkpoint, weights_fingerprint
from fractus.cli import device_name, natural, non_negative, number, positive_int, run_command, seed_number
from fractus.grow import grow
from fractus.ops.common import BACKENDS, check_available
from fractus.layers import next_token
from fractus.model import PRESETS, FractusConfig, FractusCTE
from fractus.training.records import append_csv, csv_rows, provenance
from fractus.training.runs import RunInUse, check_metrics_record, remove_leftover_temps, run_lock, truncate_metrics
from fractus.tokenizer import get_tokenizer
from fractus.training.optim import lr_lambda, make_optimizer
from fractus.training.options import parse_overrides
from fractus.training.steps import rng_state, set_rng_state
from fractus.training.stopping import RESUME_HINT, Interrupted, NonFiniteLoss, Stop

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPLIT_SEED = 0  # the digits' train / held-out split: fixed, whatever the training seed
HELD_OUT = 0.2
VOCAB = 1024  # cl100k cut to 1,024 ranks: every digit word is 1–3 tokens ("s|ix", "se|v|en")
METRICS = ("step", "epoch", "images", "lr", "train_ce", "train_lb", "val_ce", "val_acc", "elapsed_s")
RESULT_COLUMNS = ("run", "seed", "preset", "patch", "vocab_size", "epochs", "steps", "batch_size", "lr", "params",
                  "n_train", "n_val", "val_acc", "val_ce", "train_s", "wall_s", "threads", "weights")
# Arguments that must match when resuming (--epochs may change: it lengthens or shortens the schedule)
RESUME_KEYS = ("preset", "set", "vocab", "patch", "batch_size", "lr", "weight_decay", "warmup", "min_lr_ratio",
               "grad_clip", "seed")


@dataclass
class VisionConfig:
    image_size: int = 8  # H = W
    channels: int = 1
    patch: int = 4  # p

    def __post_init__(self):
        bad = [f"{k} must be an integer ≥ 1, got {v!r}" for k, v in asdict(self).items()
               if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError("bad vision config: " + "; ".join(bad))
        if self.image_size % self.patch:
            raise ValueError(f"the patch size {self.patch} does not divide the image size {self.image_size}: "
                             f"patches must tile the image")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch) ** 2


class PatchEmbed(nn.Module):
    """images [B, C, H, W] → patch vectors [B, N, d]: a linear map of each p×p patch (a conv of
    stride p) plus a learned position embedding [N, d], patches in raster order."""

    def __init__(self, vcfg: VisionConfig, d_model: int):
        super().__init__()
        self.proj = nn.Conv2d(vcfg.channels, d_model, vcfg.patch, stride=vcfg.patch)
        self.pos = nn.Parameter(torch.randn(vcfg.n_patches, d_model) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2) + self.pos


class VisionCTE(nn.Module):
    """A :class:`FractusCTE` (``cte``) that reads images as patch ticks (``patch``)."""

    def __init__(self, cfg: FractusConfig, vcfg: VisionConfig, cte: FractusCTE | None = None):
        """``cte``: an existing model of ``cfg`` to read with (growth), else a new one."""
        super().__init__()
        self.vcfg = vcfg
        self.cte = FractusCTE(cfg) if cte is None else cte
        self.patch = PatchEmbed(vcfg, cfg.d_model)

    @property
    def cfg(self) -> FractusConfig:
        return self.cte.cfg

    def check_images(self, images) -> None:
        """ValueError unless ``images`` is a floating [B, C, H, W] tensor of this model's channels
        and size, every pixel finite."""
        v = self.vcfg
        want = f"a floating [B, {v.channels}, {v.image_size}, {v.image_size}] tensor"
        if not isinstance(images, torch.Tensor):
            raise ValueError(f"images must be {want}, got {type(images).__name__}")
        if images.dim() != 4 or not images.is_floating_point():
            raise ValueError(f"images must be {want}, got shape {tuple(images.shape)} {images.dtype}")
        C, H, W = images.shape[1:]
        if C != v.channels:
            raise ValueError(f"this model reads {v.channels}-channel images, got {C} channels")
        if (H, W) != (v.image_size, v.image_size):
            raise ValueError(f"this model reads {v.image_size}×{v.image_size} images, got {H}×{W}")
        bad = int((~torch.isfinite(images)).sum())
        if bad:
            raise ValueError(f"images hold {bad} non-finite pixel(s) (NaN or inf)")

    def ticks(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, C, H, W] → the patch ticks [B, N, d], in the embedding's dtype."""
        self.check_images(images)
        return self.patch(images.to(self.patch.pos.dtype)).to(self.cte.embed.weight.dtype)

    def forward(self, images: torch.Tensor, text: torch.Tensor | None = None, state=None,
                targets: torch.Tensor | None = None):
        """The image's N patch ticks, then the token ids ``text`` [B, L'] (if given), as one chunk
        through :meth:`FractusCTE.forward_embeds` from ``state``: (logits [B, N + L', V] or None
        with ``targets`` [B, N + L'], parts, new state) as :meth:`FractusCTE.forward`."""
        x = self.ticks(images)
        if text is not None:
            self.cte.check_tokens(text)
            x = torch.cat([x, self.cte.embed(text)], 1)
        return self.cte.forward_embeds(x, state, targets)

    @torch.no_grad()
    def read(self, images: torch.Tensor, state=None, tick_by_tick: bool = False):
        """Read images [B, C, H, W] from ``state``: (logits [B, N, V], new state). One chunked
        forward, or with ``tick_by_tick`` one :meth:`FractusCTE.tick_vec` per patch (the same
        logits)."""
        if not tick_by_tick:
            logits, _, state = self(images, state=state)
            return logits, state
        x, out = self.ticks(images), []
        for t in range(x.shape[1]):
            logits, state = self.cte.tick_vec(x[:, t], state)
            out.append(logits)
        return torch.stack(out, 1), state

    @torch.no_grad()
    def generate(self, images: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 state=None, stop_at_eot: bool = True) -> list[list[int]]:
        """Read each image (from ``state``: e.g. a text read before it), then write text tick by
        tick with :func:`fractus.layers.next_token` (temperature 0: greedy). Returns each image's new
        token ids, up to ``max_new_tokens``; with ``stop_at_eot`` a row ends at its first EOT
        (left out)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
        if not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be finite and ≥ 0 (0 = greedy), got {temperature}")
        if top_k is not None and top_k < 1 or top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"need top_k ≥ 1 or None and top_p in (0, 1] or None; got {top_k}, {top_p}")
        was_training = self.training
        self.eval()
        logits, state = self.read(images, state)
        logits = logits[:, -1]
        eot, device = self.cfg.vocab_size - 1, logits.device
        gen = torch.Generator(device=device)
        gen.manual_seed(seed) if seed is not None else gen.seed()  # seed None: fresh, global RNG untouched
        unused = torch.zeros(self.cfg.vocab_size, dtype=torch.bool, device=device)  # no repetition penalty
        out = [[] for _ in range(logits.shape[0])]
        done = [False] * len(out)
        for t in range(max_new_tokens):
            nxt = [next_token(row.float(), temperature, top_k, top_p, 1.0, unused, gen) for row in logits]
            for i, tok in enumerate(nxt):
                if done[i]:
                    continue
                if stop_at_eot and tok == eot:
                    done[i] = True
                else:
                    out[i].append(tok)
            if all(done) or t == max_new_tokens - 1:
                break
            logits, state = self.cte.step(torch.tensor(nxt, device=device), state)
        self.train(was_training)
        return out

    def answer(self, images: torch.Tensor, max_new_tokens: int = 8) -> list[str]:
        """Each image's greedy text answer (up to EOT)."""
        enc = get_tokenizer(self.cfg.vocab_size)
        return [enc.decode(ids) for ids in self.generate(images, max_new_tokens)]

    # -- checkpoints --------------------------------------------------------------------
    def save(self, path, **extra) -> None:
        """Write both configs and the weights (+ ``extra`` entries) atomically; see
        :mod:`fractus.checkpoint`."""
        save_checkpoint(path, {"config": self.cfg.to_dict(), "vision": asdict(self.vcfg),
                               "model": self.state_dict(), **extra})

    @classmethod
    def load(cls, path, backend: str | None = None) -> "VisionCTE":
        """The model of a vision checkpoint, on the CPU (``backend``: as :meth:`FractusCTE.load`)."""
        ckpt = load_checkpoint(path)
        if not isinstance(ckpt.get("vision"), dict):
            raise CheckpointError(f"{path} is not a vision checkpoint (no 'vision' entry): a text model is "
                                  f"loaded with FractusCTE.load")
        try:
            cfg = FractusConfig.from_saved({**ckpt["config"], **({"backend": backend} if backend else {})})
            vcfg = VisionConfig(**ckpt["vision"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: its config is not a valid one ({e})") from None
        model = cls(cfg, vcfg)
        load_model_state(model, ckpt["model"], path)
        return model


# -- growth -----------------------------------------------------------------------------
def _stream_columns(t: torch.Tensor, dim: int, d_new: int) -> torch.Tensor:
    """Vectors of the residual stream along ``dim`` as grown: c·[v ; μ(v)·1_Δ], c = √(d'/d)
    (the mapping :mod:`fractus.grow` gives token embeddings and ``tick_vec``'s vectors)."""
    d = t.shape[dim]
    shape = list(t.shape)
    shape[dim] = d_new - d
    t = t.double()
    return math.sqrt(d_new / d) * torch.cat([t, t.mean(dim, keepdim=True).expand(shape)], dim)


@torch.no_grad()
def grow_vision(model: VisionCTE, target_cfg: FractusConfig) -> VisionCTE:
    """A ``target_cfg`` vision model with the same logits as ``model``: the CTE grown by
    :func:`fractus.grow.grow`, the patch embedding's outputs (projection rows, bias, positions)
    mapped as the grown residual stream's vectors. Random parts come from torch's global RNG."""
    new = VisionCTE(target_cfg, model.vcfg, cte=grow(model.cte, target_cfg))
    d2, old = target_cfg.d_model, model.patch
    new.patch.proj.weight.copy_(_stream_columns(old.proj.weight, 0, d2))
    new.patch.proj.bias.copy_(_stream_columns(old.proj.bias, 0, d2))
    new.patch.pos.copy_(_stream_columns(old.pos, 1, d2))
    return new.to(model.patch.pos.device)


# -- the task: labels as text -----------------------------------------------------------
class LabelText:
    """Class labels as token ids of the tokenizer of ``vocab_size``: ``ids`` [K, L], each word's
    tokens then EOT, padded with EOT; ``targets`` [K, L], the same with −100 on the padding."""

    def __init__(self, words, vocab_size: int):
        self.words = tuple(words)
        self.enc = get_tokenizer(vocab_size)
        eot = vocab_size - 1
        toks = [self.enc.encode_ordinary(w) + [eot] for w in self.words]
        L = max(map(len, toks))
        self.ids = torch.full((len(toks), L), eot)
        self.targets = torch.full((len(toks), L), -100)
        for k, t in enumerate(toks):
            self.ids[k, :len(t)] = torch.tensor(t)
            self.targets[k, :len(t)] = torch.tensor(t)

    def batch(self, labels: torch.Tensor, n_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """labels [B] → (text fed after the image [B, L − 1], targets of the whole sequence
        [B, N + L − 1]): the last patch predicts the label's first token, each label token the
        next, the last one EOT; the other positions are not scored."""
        labels = labels.cpu()
        ids, tg = self.ids[labels], self.targets[labels]
        targets = torch.cat([torch.full((len(labels), n_patches - 1), -100), tg], 1)
        return ids[:, :-1], targets


def label_loss(model: VisionCTE, images: torch.Tensor, labels: torch.Tensor, text: LabelText) -> dict:
    """The language model's loss on the label text after each image: ``parts`` of
    :meth:`FractusCTE.forward` (``loss`` = ce + lb_coef·lb, ``ce`` over the label tokens and EOT)."""
    ids, targets = text.batch(labels, model.vcfg.n_patches)
    device = images.device
    _, parts, _ = model(images, ids.to(device), targets=targets.to(device))
    return parts


@torch.no_grad()
def evaluate_images(model: VisionCTE, images: torch.Tensor, labels: torch.Tensor, text: LabelText,
                    batch_size: int = 512) -> dict:
    """Held-out CE (nats per label token, teacher-forced) and accuracy: each image's greedy
    answer compared as text with its label's word. Returns {val_ce, val_acc, answers}."""
    was = model.training
    model.eval()
    ce_sum, n, answers = 0.0, 0, []
    device = model.patch.pos.device
    for i in range(0, len(labels), batch_size):
        x, y = images[i:i + batch_size].to(device), labels[i:i + batch_size]
        parts = label_loss(model, x, y, text)
        k = int(parts["n"])
        ce_sum, n = ce_sum + float(parts["ce"]) * k, n + k
        answers += model.answer(x, text.ids.shape[1])
    model.train(was)
    right = sum(a == text.words[int(y)] for a, y in zip(answers, labels))
    return {"val_ce": ce_sum / n, "val_acc": right / len(labels), "answers": answers}


# -- data ---------------------------------------------------------------------------------
def load_digits_split(held_out: float = HELD_OUT, seed: int = SPLIT_SEED) -> dict:
    """scikit-learn's 8×8 digits, pixels scaled from 0…16 to [0, 1], split stratified by ``seed``:
    {"train": (images [n, 1, 8, 8] fp32, labels [n] int64), "val": (…), "words": DIGIT_WORDS}.
    The writers overlap between the splits (the data records none)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError("the digits come from scikit-learn: pip install -e '.[vision]'") from None
    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16
    labels = torch.tensor(d.target, dtype=torch.int64)
    tr, va = train_test_split(np.arange(len(labels)), test_size=held_out, random_state=seed, stratify=d.target)
    tr, va = torch.from_numpy(np.sort(tr)), torch.from_numpy(np.sort(va))
    return {"train": (images[tr], labels[tr]), "val": (images[va], labels[va]), "words": DIGIT_WORDS}


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The training images' order in ``epoch`` [n]: a permutation drawn from (seed, epoch) alone,
    so that a resumed run reads the same batches."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


# -- training -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fractus.vision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train on the digits")
    a = t.add_argument
    a("--out", required=True, help="run directory: ckpt.pt, metrics.csv")
    a("--preset", default="palier0", choices=sorted(PRESETS), help="the blocks' dimensions")
    a("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides, e.g. n_layers=4")
    a("--vocab", type=number(int, lambda n: n >= 257, "≥ 257"), default=VOCAB,
      help="the tokenizer's vocabulary (cl100k cut to this many ranks)")
    a("--patch", type=positive_int, default=VisionConfig.patch, help="patch side p (must divide 8)")
    a("--epochs", type=positive_int, default=30)
    a("--batch-size", type=positive_int, default=32)
    a("--lr", type=non_negative, default=3e-3, help="peak learning rate (AdamW)")
    a("--weight-decay", type=non_negative, default=0.01)
    a("--warmup", type=natural, default=50, help="warm-up optimizer steps")
    a("--min-lr-ratio", type=number(float, lambda x: 0 <= x <= 1, "≥ 0 and ≤ 1"), default=0.1,
      help="cosine decay floor, as a fraction of --lr")
    a("--grad-clip", type=non_negative, default=1.0, help="gradient norm clip (0 = none)")
    a("--seed", type=seed_number, default=1337, help="initialisation and batch order (the split's seed is fixed)")
    a("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    a("--backend", default="auto", choices=BACKENDS)
    a("--threads", type=natural, default=0, help="torch CPU threads (0 = torch's default)")
    a("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    a("--stop-after", type=positive_int, default=None, metavar="STEPS",
      help="save and stop after STEPS optimizer steps of this invocation (continue with --resume)")
    a("--grow-from", metavar="CKPT", help="start from a vision checkpoint's model grown to the preset")
    a("--csv", help="append the finished run's result as a row of this CSV (with provenance)")
    a("--no-progress", action="store_true", help="no tqdm bar")
    e = sub.add_parser("evaluate", help="a checkpoint's held-out accuracy on the digits")
    e.add_argument("ckpt")
    e.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--backend", default="auto", choices=BACKENDS)
    return ap


def make_config(args) -> FractusConfig:
    over = parse_overrides(args.set)
    if {"vocab_size", "backend"} & set(over):
        raise ValueError("set vocab_size with --vocab and backend with --backend, not --set")
    return FractusConfig.preset(args.preset, **over, vocab_size=args.vocab, backend=args.backend)


def settings(args: dict) -> dict:
    return {k: args.get(k) for k in RESUME_KEYS}


def train(argv=None) -> dict:
    """``python -m fractus.vision train``: returns the final {val_ce, val_acc, …}. Raises
    :class:`fractus.training.stopping.Interrupted` after a SIGINT/SIGTERM stop (checkpoint saved)."""
    t_start = time.perf_counter()
    args = build_parser().parse_args(["train", *(argv or [])])
    return run(args, t_start)


def run(args: argparse.Namespace, t_start: float) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out = Path(args.out)
    ckpt_path, metrics_path = out / "ckpt.pt", out / "metrics.csv"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a run directory")
    if args.csv:  # a file that cannot take the row is refused before training
        if Path(args.csv).is_dir():
            raise ValueError(f"--csv {args.csv} is a directory; give a file")
        csv_rows(args.csv, [*RESULT_COLUMNS, *provenance(device)])
    with run_lock(out):  # one run at a time in a directory, as the text trainer's (fractus.training.runs)
        remove_leftover_temps([ckpt_path, metrics_path])
        return train_locked(args, t_start, device, out)


def train_locked(args: argparse.Namespace, t_start: float, device: torch.device, out: Path) -> dict:
    """:func:`run` once the run directory ``out`` is this process's."""
    ckpt_path = out / "ckpt.pt"
    cfg = make_config(args)
    check_available(cfg.backend, device)
    vcfg = VisionConfig(image_size=8, channels=1, patch=args.patch)
    data = load_digits_split()
    text = LabelText(data["words"], cfg.vocab_size)
    n_train, n_val = len(data["train"][1]), len(data["val"][1])
    identity = {"dataset": "sklearn digits", "n_train": n_train, "n_val": n_val, "split_seed": SPLIT_SEED}
    steps_per_epoch = math.ceil(n_train / args.batch_size)
    total = args.epochs * steps_per_epoch

    torch.manual_seed(args.seed)
    model = _initial_model(args, cfg, vcfg).to(device)
    opt = make_optimizer(model, "adamw", args.lr, args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, total, args.min_lr_ratio))
    progress = {"step": 0, "elapsed": 0.0, "sums": {"ce": 0.0, "lb": 0.0, "n": 0}}
    if args.resume:
        progress = _resume(args, out, model, opt, sched, identity, steps_per_epoch)
    elif ckpt_path.exists():
        raise FileExistsError(f"{ckpt_path} exists: pass --resume to continue it, or choose another --out")
    elif (out / "metrics.csv").exists():
        raise FileExistsError(f"{out / 'metrics.csv'} exists (a run that wrote no checkpoint): choose another "
                              f"--out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    print(f"Fractus CTE {args.preset} + patch embedding (p={vcfg.patch}, {vcfg.n_patches} ticks an image): "
          f"{model.cte.num_params():,} + {sum(p.numel() for p in model.patch.parameters()):,} parameters, "
          f"vocab {cfg.vocab_size}, {device}")
    print(f"digits: {n_train} train / {n_val} held-out images; {args.epochs} epochs × {steps_per_epoch} "
          f"steps of {args.batch_size}, lr {args.lr:g}")
    last, stopped = _epochs(args, out, model, opt, sched, data, text, identity, progress, steps_per_epoch, device)
    if stopped:
        return last
    if not last:  # no epoch ended in this process (e.g. resumed at the end)
        ev = evaluate_images(model, *data["val"], text)
        last = {"step": progress["step"], "epoch": args.epochs, "val_ce": ev["val_ce"], "val_acc": ev["val_acc"]}
    return _report(args, out, model, vcfg, cfg, last, progress, identity, t_start, device)


def _initial_model(args: argparse.Namespace, cfg: FractusConfig, vcfg: VisionConfig) -> VisionCTE:
    """A fresh model, or ``--grow-from``'s grown into ``cfg`` (same patches)."""
    if not args.grow_from or args.resume:
        return VisionCTE(cfg, vcfg)
    src = VisionCTE.load(args.grow_from)
    if src.vcfg != vcfg:
        raise ValueError(f"--grow-from {args.grow_from} reads {asdict(src.vcfg)}, this run {asdict(vcfg)}")
    return grow_vision(src, cfg)


def _resume(args, out: Path, model, opt, sched, identity: dict, steps_per_epoch: int) -> dict:
    """Load ``out``'s checkpoint into the model, optimizer and schedule after checking that it was
    written by this run's settings on this data, with a complete metrics record; returns the
    progress (step, elapsed, epoch sums) and restores the random state."""
    ckpt_path, metrics_path = out / "ckpt.pt", out / "metrics.csv"
    ck = load_checkpoint(ckpt_path)
    lacking = sorted({"args", "optimizer", "scheduler", "step", "elapsed_s", "epoch_sums", "rng", "data"} - set(ck))
    if lacking:
        raise CheckpointError(f"{ckpt_path} holds no vision training state (no {', '.join(lacking)})")
    now = settings(vars(args))
    diff = {k: (v, now[k]) for k, v in settings(ck["args"]).items() if v != now[k]}
    diff.update({f"data {k}": (v, identity[k]) for k, v in ck["data"].items() if identity.get(k) != v})
    if diff:
        raise ValueError(f"--resume with different settings than the checkpoint: {diff}")
    check_metrics_record(metrics_path, ck["step"], every=steps_per_epoch)
    load_model_state(model, ck["model"], ckpt_path)
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    set_rng_state(ck["rng"])
    truncate_metrics(metrics_path, ck["step"])
    print(f"resumed from {ckpt_path} at step {ck['step']}")
    return {"step": ck["step"], "elapsed": ck["elapsed_s"], "sums": dict(ck["epoch_sums"])}


def _epochs(args, out: Path, model, opt, sched, data: dict, text: LabelText, identity: dict, progress: dict,
            steps_per_epoch: int, device: torch.device) -> tuple[dict, bool]:
    """Train to the last epoch from ``progress`` (updated in place): each epoch's held-out reading
    appended to the metrics record, a checkpoint at each epoch's end and on a stop. Returns (the last
    epoch's row, whether ``--stop-after`` stopped the run); raises :class:`Interrupted` on a signal."""
    ckpt_path, metrics_path = out / "ckpt.pt", out / "metrics.csv"
    (x_tr, y_tr), (x_va, y_va) = data["train"], data["val"]
    total = args.epochs * steps_per_epoch
    step, first_step = progress["step"], progress["step"]

    def save():
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise NonFiniteLoss(f"the weights became non-finite by step {step}: lower --lr; {ckpt_path} is "
                                f"left as it was")
        model.save(ckpt_path, optimizer=opt.state_dict(), scheduler=sched.state_dict(), step=step,
                   elapsed_s=progress["elapsed"], epoch_sums=progress["sums"], rng=rng_state(), args=vars(args),
                   data=identity)

    bar = tqdm(total=total, initial=step, disable=args.no_progress, unit="step", dynamic_ncols=True)
    last, stopping = {}, False
    with Stop() as stop:
        while step < total and not stopping:
            t0 = time.perf_counter()
            epoch, pos = divmod(step, steps_per_epoch)
            idx = epoch_order(args.seed, epoch, len(y_tr))[pos * args.batch_size:(pos + 1) * args.batch_size]
            parts = label_loss(model, x_tr[idx].to(device), y_tr[idx], text)
            parts["loss"].backward()
            loss, ce, lb = torch.stack([parts["loss"].detach(), parts["ce"].detach(), parts["lb"].detach()]).tolist()
            if not math.isfinite(loss):
                kept = (f"{ckpt_path}, the last saved state, is kept" if ckpt_path.exists()
                        else "no checkpoint was written yet")
                raise NonFiniteLoss(f"non-finite loss at step {step}: lower --lr; {kept}")
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            sums = progress["sums"]
            progress["sums"] = {"ce": sums["ce"] + ce * len(idx), "lb": sums["lb"] + lb * len(idx),
                                "n": sums["n"] + len(idx)}
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, ce=f"{ce:.3f}")
            end_of_epoch = step % steps_per_epoch == 0
            if end_of_epoch:
                ev, sums = evaluate_images(model, x_va, y_va, text), progress["sums"]
                last = {"step": step, "epoch": step // steps_per_epoch, "images": step // steps_per_epoch * len(y_tr),
                        "lr": sched.get_last_lr()[0], "train_ce": sums["ce"] / sums["n"],
                        "train_lb": sums["lb"] / sums["n"], "val_ce": ev["val_ce"], "val_acc": ev["val_acc"]}
                progress["sums"] = {"ce": 0.0, "lb": 0.0, "n": 0}
            progress["elapsed"] += time.perf_counter() - t0
            progress["step"] = step
            if end_of_epoch:
                last["elapsed_s"] = progress["elapsed"]
                append_csv(metrics_path, {k: last[k] for k in METRICS}, device)
                tqdm.write(f"epoch {last['epoch']}: train CE {last['train_ce']:.4f}, held-out CE {last['val_ce']:.4f}, "
                           f"accuracy {last['val_acc']:.4f}")
            stopping = stop.requested or (args.stop_after is not None and step - first_step >= args.stop_after
                                          and step < total)
            if end_of_epoch or stopping:
                save()
        bar.close()
    if stopping:
        print(f"stopped at step {step} of {total}: checkpoint saved to {ckpt_path}; rerun with --resume")
    if stop.requested:
        raise Interrupted(stop.signum)
    return last, stopping


def _report(args, out: Path, model, vcfg: VisionConfig, cfg: FractusConfig, last: dict, progress: dict,
            identity: dict, t_start: float, device: torch.device) -> dict:
    """Print the held-out result, append it to ``--csv`` if given; the result with its times."""
    wall, elapsed, n_val = time.perf_counter() - t_start, progress["elapsed"], identity["n_val"]
    right = round(last["val_acc"] * n_val)
    print(f"held-out accuracy {last['val_acc']:.4f} ({right}/{n_val}), CE {last['val_ce']:.4f} nats/token "
          f"after {args.epochs} epochs; training {elapsed:.1f} s, this process {wall:.1f} s")
    if args.csv:
        append_csv(args.csv, dict(zip(RESULT_COLUMNS, (
            str(out), args.seed, args.preset, vcfg.patch, cfg.vocab_size, args.epochs, progress["step"],
            args.batch_size, args.lr, sum(p.numel() for p in model.parameters()), identity["n_train"], n_val,
            last["val_acc"], last["val_ce"], round(elapsed, 2), round(wall, 2), torch.get_num_threads(),
            weights_fingerprint(model.state_dict())))), device)
    return {**last, "train_s": elapsed, "wall_s": wall}


def evaluate_checkpoint(ckpt: str | Path, device: str = "cpu", backend: str = "auto") -> dict:
    """{val_ce, val_acc, answers} of a vision checkpoint on the digits' held-out split."""
    model = VisionCTE.load(ckpt, backend=backend).to(device)
    data = load_digits_split()
    x, y = data["val"]
    return evaluate_images(model, x, y, LabelText(data["words"], model.cfg.vocab_size))


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)

    def body():
        if args.command == "evaluate":
            r = evaluate_checkpoint(args.ckpt, args.device, args.backend)
            print(f"{args.ckpt}: held-out accuracy {r['val_acc']:.4f} ({len(r['answers'])} images), "
                  f"CE {r['val_ce']:.4f} nats/token")
            return
        try:
            run(args, time.perf_counter())
        except Interrupted as e:  # saved
            sys.exit(128 + e.signum)
    run_command(body, errors=(ImportError, NonFiniteLoss, RunInUse), interrupted=RESUME_HINT)


if __name__ == "__main__":
    main()
