"""The vision path: patch ticks through the chunked forward equal tick_vec decode, labels as text
through the language model's loss and sampler, bad images, growth, the digits split, and the
trainer's CLI (smoke size): learning, exact resume after --stop-after and after a signal, errors."""
import csv
import os
import signal

import pytest
import torch
import torch.nn.functional as F

import fractus.vision as V
from fractus.checkpoint import load_checkpoint
from fractus.model import FractusConfig, FractusCTE
from fractus.vision import DIGIT_WORDS, LabelText, VisionConfig, VisionCTE, grow_vision, label_loss
from util import assert_rel


def model_of(patch=4, image_size=8, channels=1, **over) -> VisionCTE:
    """A tiny vision model moved away from its initialisation (biases, LayerNorms, positions ≠ their init)."""
    model = VisionCTE(FractusConfig.preset("tiny", vocab_size=1024, **over),
                      VisionConfig(image_size=image_size, channels=channels, patch=patch))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p) * (p.std() if p.numel() > 1 else 1.0))
    return model.eval()


def images(B=3, C=1, S=8):
    return torch.rand(B, C, S, S)


@pytest.mark.parametrize("patch,channels,over", [(4, 1, {}), (2, 1, {}), (2, 3, dict(router="linear"))],
                         ids=["p4", "p2", "p2-rgb-linear-router"])
@pytest.mark.parametrize("after_text", [False, True], ids=["fresh", "after-text"])
def test_patches_through_the_chunked_forward_equal_tick_vec(patch, channels, over, after_text, one_thread):
    model = model_of(patch, channels=channels, **over)
    x = images(C=channels)
    state = None
    if after_text:  # an image read after some text: the same carried state as text
        _, _, state = model.cte(torch.randint(0, 1023, (3, 5)))
    chunked, s_chunked = model.read(x, state)
    ticked, s_ticked = model.read(x, state, tick_by_tick=True)
    assert chunked.shape == (3, VisionConfig(channels=channels, patch=patch).n_patches, 1024)
    assert_rel(ticked, chunked, 1e-5, "tick_vec per patch vs one chunk")
    for a, b in zip(s_ticked, s_chunked):
        for u, v in zip(a, b):
            assert_rel(u, v, 1e-5, "carried state")
    # the patches as the model's first positions, then text: the same logits as ticks then steps
    text = torch.randint(0, 1023, (3, 4))
    whole, _, _ = model(x, text, state)
    logits, st = ticked[:, -1], s_ticked
    steps = []
    for t in range(text.shape[1]):
        logits, st = model.cte.step(text[:, t], st)
        steps.append(logits)
    assert_rel(torch.cat([ticked, torch.stack(steps, 1)], 1), whole, 1e-5, "image + text: decode vs forward")


def test_reading_an_image_then_generating_text(one_thread):
    """Greedy generation after an image (and after text then an image) writes the argmax of one
    forward over image + the generated text at every position; sampling is seeded."""
    model = model_of(2)
    x = images()
    prefix = torch.randint(0, 1023, (3, 5))
    _, _, text_state = model.cte(prefix)
    for state in (None, text_state):
        out = model.generate(x, 6, state=state, stop_at_eot=False)
        assert [len(o) for o in out] == [6, 6, 6]
        ids = torch.tensor(out)
        logits, _, _ = model(x, ids[:, :-1], state)
        assert torch.equal(logits[:, model.vcfg.n_patches - 1:].argmax(-1), ids)
    a = model.generate(x, 6, temperature=1.0, seed=3, stop_at_eot=False)
    assert a == model.generate(x, 6, temperature=1.0, seed=3, stop_at_eot=False)
    assert a != model.generate(x, 6, temperature=1.0, seed=4, stop_at_eot=False)
    assert all(isinstance(s, str) for s in model.answer(x))
    assert model.training is False


def test_generation_stops_each_image_at_its_eot():
    model, x = model_of(), images(8)
    full = model.generate(x, 5, stop_at_eot=False)
    cut = [row[:row.index(1023)] if 1023 in row else row for row in full]
    assert model.generate(x, 5) == cut
    with torch.no_grad():  # a final norm that outputs EOT's (enlarged) embedding: EOT is every argmax
        model.cte.embed.weight[1023] *= 100
        model.cte.ln_f.weight.zero_()
        model.cte.ln_f.bias.copy_(model.cte.embed.weight[1023])
    assert model.generate(x, 5) == [[]] * 8 and model.answer(x) == [""] * 8
    assert model.generate(x, 2, stop_at_eot=False) == [[1023, 1023]] * 8


def test_label_text_encodes_the_words_then_eot():
    text = LabelText(DIGIT_WORDS, 1024)
    K, L = text.ids.shape
    assert K == 10 and L == 4  # "z|er|o", "se|v|en" are the longest: 3 tokens and EOT
    for k, w in enumerate(DIGIT_WORDS):
        n = (text.targets[k] != -100).sum()
        assert text.enc.decode(text.ids[k, :n - 1].tolist()) == w and text.ids[k, n - 1] == 1023
        assert (text.ids[k, n:] == 1023).all() and (text.targets[k, n:] == -100).all()
    ids, targets = text.batch(torch.tensor([7, 1]), n_patches=4)
    assert ids.shape == (2, 3) and targets.shape == (2, 7)  # 4 patches, then 3 fed tokens
    assert (targets[:, :3] == -100).all()  # only the last patch and the label text are scored
    assert torch.equal(targets[0, 3:], text.ids[7]) and torch.equal(ids[0], text.ids[7, :3])
    assert targets[1, 3:].tolist() == [text.ids[1, 0].item(), 1023, -100, -100]


def test_label_loss_is_the_language_models_cross_entropy(one_thread):
    """The trainer's loss: the tied head's fused CE over the label tokens and EOT only."""
    model = model_of(2)
    text = LabelText(DIGIT_WORDS, 1024)
    x, y = images(4), torch.tensor([0, 7, 3, 9])
    parts = label_loss(model, x, y, text)
    ids, targets = text.batch(y, model.vcfg.n_patches)
    logits, _, _ = model(x, ids)
    scored = targets != -100
    ref = F.cross_entropy(logits[scored], targets[scored])
    assert abs(parts["ce"].item() - ref.item()) < 1e-5 * ref.item()
    assert int(parts["n"]) == int(scored.sum()) == sum(len(text.enc.encode_ordinary(DIGIT_WORDS[k])) + 1 for k in y)
    assert parts["loss"].item() == pytest.approx(ref.item() + model.cfg.lb_coef * parts["lb"].item(), rel=1e-5)


@pytest.mark.parametrize("bad,message", [
    (torch.rand(2, 3, 8, 8), "1-channel images, got 3 channels"),
    (torch.rand(2, 1, 8, 9), "8×8 images, got 8×9"),
    (torch.rand(2, 1, 16, 16), "8×8 images, got 16×16"),
    (torch.rand(1, 8, 8), r"floating \[B, 1, 8, 8\] tensor, got shape \(1, 8, 8\)"),
    (torch.randint(0, 16, (2, 1, 8, 8)), r"floating \[B, 1, 8, 8\] tensor, got shape \(2, 1, 8, 8\) torch.int64"),
    ([[0.0]], "got list"),
], ids=["channels", "width", "size", "no-batch", "integers", "not-a-tensor"])
def test_bad_images_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        model_of().read(bad)


def test_non_finite_pixels_are_refused():
    x = images()
    x[1, 0, 2, 3], x[2, 0, 0, 0] = float("nan"), float("inf")
    for call in (lambda m: m.read(x), lambda m: m.generate(x, 2), lambda m: m(x)):
        with pytest.raises(ValueError, match=r"2 non-finite pixel\(s\)"):
            call(model_of())


@pytest.mark.parametrize("kw,message", [
    (dict(patch=3), "the patch size 3 does not divide the image size 8"),
    (dict(patch=5, image_size=28), "the patch size 5 does not divide the image size 28"),
    (dict(patch=0), "patch must be an integer ≥ 1, got 0"),
    (dict(channels=2.0), "channels must be an integer ≥ 1, got 2.0"),
])
def test_bad_vision_configs(kw, message):
    with pytest.raises(ValueError, match=message):
        VisionConfig(**kw)


def test_growth_keeps_the_vision_models_logits(one_thread):
    old = model_of(2)
    dst = FractusConfig.preset("tiny", vocab_size=1024, d_model=64, n_heads=4, n_layers=3, n_experts=6,
                               expert_d_ff=48, n_oscillators=8, coupling_rank=3, expert_rank=12)
    new = grow_vision(old, dst).eval()
    assert new.cfg.d_model == 64 and new.patch.pos.shape == (16, 64)
    text = LabelText(DIGIT_WORDS, 1024)
    x, y = images(4), torch.tensor([2, 5, 8, 0])
    ids, _ = text.batch(y, 16)
    with torch.no_grad():
        l0, _, _ = old(x, ids)
        l1, _, _ = new(x, ids)
        ce0, ce1 = label_loss(old, x, y, text)["ce"].item(), label_loss(new, x, y, text)["ce"].item()
    assert_rel(l1, l0, 1e-5, "grown vision model's logits")
    assert abs(ce1 - ce0) < 1e-4 * ce0
    assert_rel(new.read(x, tick_by_tick=True)[0], l0[:, :16], 1e-5, "grown model's tick_vec decode")
    tok = torch.randint(0, 1023, (2, 7))  # text: the CTE part is grown as fractus.grow grows it
    assert_rel(new.cte(tok)[0], old.cte(tok)[0], 1e-5, "the grown model's logits on text")


def test_the_digits_split_is_fixed_stratified_and_disjoint():
    a, b = V.load_digits_split(), V.load_digits_split()
    (x_tr, y_tr), (x_va, y_va) = a["train"], a["val"]
    assert x_tr.shape == (1437, 1, 8, 8) and x_va.shape == (360, 1, 8, 8) and x_tr.dtype == torch.float32
    assert torch.equal(x_va, b["val"][0]) and torch.equal(y_tr, b["train"][1])
    assert x_tr.min() == 0 and x_tr.max() == 1
    assert torch.bincount(y_va).tolist() == [36, 36, 35, 37, 36, 37, 36, 36, 35, 36]  # stratified
    def distinct(x):
        return len(x.flatten(1).unique(dim=0))
    assert distinct(torch.cat([x_tr, x_va])) == distinct(x_tr) + distinct(x_va)  # no image in both splits
    assert a["words"] == DIGIT_WORDS


# -- the trainer ------------------------------------------------------------------------------------
BASE = ["--preset", "tiny", "--batch-size", "128", "--epochs", "3", "--lr", "1e-2", "--warmup", "5",
        "--threads", "1", "--no-progress"]
SMOKE = [*BASE, "--set", "d_model=64"]
STEPS = 3 * 12  # 1,437 images in batches of 128


def metrics(out):
    """metrics.csv's rows without what differs between equal runs (time, date)."""
    with open(out / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in ("elapsed_s", "date")} for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision") / "run"
    result = V.train([*SMOKE, "--out", str(out), "--csv", str(out.parent / "results.csv")])
    return out, result


def test_smoke_training_learns_and_records(reference, capsys):
    out, result = reference
    rows = metrics(out)
    assert [int(r["step"]) for r in rows] == [12, 24, 36] and [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert all(r["git_sha"] and r["device"].startswith("cpu") for r in rows)  # provenance on every row
    ces = [float(r["train_ce"]) for r in rows]
    assert ces[2] < ces[0]
    assert result["val_acc"] == float(rows[-1]["val_acc"]) >= 0.4  # chance: 0.1
    with open(out.parent / "results.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["val_acc"] == rows[-1]["val_acc"] and float(row["wall_s"]) >= float(row["train_s"]) > 0
    assert row["steps"] == str(STEPS) and row["n_val"] == "360" and row["machine"] and row["git_sha"]
    ck = load_checkpoint(out / "ckpt.pt")
    assert ck["step"] == STEPS and ck["vision"] == {"image_size": 8, "channels": 1, "patch": 4}
    model = VisionCTE.load(out / "ckpt.pt")
    assert isinstance(model, VisionCTE) and model.cfg.d_model == 64
    V.main(["evaluate", str(out / "ckpt.pt")])
    assert f"held-out accuracy {result['val_acc']:.4f} (360 images)" in capsys.readouterr().out


def test_stop_after_then_resume_equals_uninterrupted(reference, tmp_path, capsys):
    ref, _ = reference
    out = tmp_path / "run"
    V.train([*SMOKE, "--out", str(out), "--stop-after", "17"])
    assert f"stopped at step 17 of {STEPS}" in capsys.readouterr().out
    assert load_checkpoint(out / "ckpt.pt")["step"] == 17 and len(metrics(out)) == 1
    V.train([*SMOKE, "--out", str(out), "--resume"])
    assert metrics(out) == metrics(ref)
    a, b = load_checkpoint(out / "ckpt.pt")["model"], load_checkpoint(ref / "ckpt.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_signal_saves_and_resume_continues_exactly(reference, tmp_path, monkeypatch):
    """SIGTERM after the 20th step (mid-epoch): saved there, Interrupted (exit 143); resume equals the
    uninterrupted run, epoch averages included; a row logged after the checkpoint is dropped."""
    ref, _ = reference
    real, calls = label_loss, []

    def signal_at_step_20(model, *args):
        calls.append(model.training)
        if model.training and sum(calls) == 20:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(model, *args)
    monkeypatch.setattr(V, "label_loss", signal_at_step_20)
    out = tmp_path / "run"
    with pytest.raises(V.Interrupted) as e:
        V.train([*SMOKE, "--out", str(out)])
    assert e.value.signum == signal.SIGTERM and load_checkpoint(out / "ckpt.pt")["step"] == 20
    monkeypatch.setattr(V, "label_loss", real)
    with open(out / "metrics.csv", "a", newline="") as f:  # as if killed after logging epoch 2, before its save
        f.write(open(ref / "metrics.csv").read().splitlines()[2] + "\n")
    V.train([*SMOKE, "--out", str(out), "--resume"])
    assert metrics(out) == metrics(ref)
    a, b = load_checkpoint(out / "ckpt.pt")["model"], load_checkpoint(ref / "ckpt.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_grow_from_a_vision_checkpoint(reference, tmp_path, capsys):
    ref, result = reference
    out = tmp_path / "grown"
    V.main(["train", *BASE, "--set", "d_model=128", "n_heads=4", "n_layers=3", "--epochs", "1", "--stop-after",
            "1", "--lr", "0", "--warmup", "1", "--out", str(out), "--grow-from", str(ref / "ckpt.pt")])
    grown = VisionCTE.load(out / "ckpt.pt")
    assert (grown.cfg.d_model, grown.cfg.n_heads, grown.cfg.n_layers) == (128, 4, 3)
    assert V.evaluate_checkpoint(out / "ckpt.pt")["val_acc"] == result["val_acc"]  # lr 0: the grown function


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        V.main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_cli_errors(reference, tmp_path, capsys):
    ref, _ = reference
    out = str(tmp_path / "run")
    assert "error: the patch size 3 does not divide the image size 8" in run_cli(
        capsys, "train", *SMOKE, "--out", out, "--patch", "3")
    assert "error: set vocab_size with --vocab" in run_cli(capsys, "train", *SMOKE, "--out", out,
                                                            "--set", "vocab_size=512")
    assert "invalid int value" in run_cli(capsys, "train", *SMOKE, "--out", out, "--patch", "two")
    assert f"error: {ref / 'ckpt.pt'} exists: pass --resume" in run_cli(capsys, "train", *SMOKE, "--out", str(ref))
    err = run_cli(capsys, "train", *SMOKE, "--out", str(ref), "--resume", "--lr", "0.5")
    assert "error: --resume with different settings than the checkpoint: {'lr': (0.01, 0.5)}" in err
    assert "error: checkpoint" in run_cli(capsys, "train", *SMOKE, "--out", out, "--resume")
    text_ckpt = tmp_path / "text.pt"
    FractusCTE(FractusConfig.preset("tiny")).save(text_ckpt)
    assert "is not a vision checkpoint" in run_cli(capsys, "evaluate", str(text_ckpt))
    assert "is not a vision checkpoint" in run_cli(capsys, "train", *SMOKE, "--out", out, "--grow-from",
                                                   str(text_ckpt))
    assert "error: --csv" in run_cli(capsys, "train", *SMOKE, "--out", out, "--csv", str(tmp_path))


def test_a_second_run_on_one_out_is_refused(tmp_path, capsys):
    """A run holds its directory's lock (fractus.training.runs), as text training does: a second vision run on
    the same --out is refused at once, and nothing of the first is touched."""
    from fractus.training.runs import run_lock
    out = tmp_path / "run"
    with run_lock(out):
        assert f"error: {out} is in use by another run" in run_cli(capsys, "train", *SMOKE, "--out", str(out))
    assert not (out / "metrics.csv").exists() and not (out / "ckpt.pt").exists()


def test_resume_refuses_a_run_whose_record_was_lost(tmp_path, capsys):
    """--resume with metrics.csv deleted (or cut short) is refused: the run's record would lack epochs."""
    out = tmp_path / "run"
    V.train([*SMOKE, "--out", str(out), "--stop-after", "13"])  # past the first epoch (12 steps)
    (out / "metrics.csv").unlink()
    err = run_cli(capsys, "train", *SMOKE, "--out", str(out), "--resume")
    assert "error: refusing to resume: the checkpoint is at step 13" in err and "does not exist" in err


def test_a_first_step_failure_says_no_checkpoint_exists(tmp_path, capsys, monkeypatch):
    def nan_loss(model, *args):
        parts = label_loss(model, *args)
        return {**parts, "loss": parts["loss"] * float("nan")}
    monkeypatch.setattr(V, "label_loss", nan_loss)
    err = run_cli(capsys, "train", *SMOKE, "--out", str(tmp_path / "run"))
    assert "error: non-finite loss at step 0: lower --lr; no checkpoint was written yet" in err
