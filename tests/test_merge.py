"""Merge: parameter mean of checkpoints; compiled keys accepted; mismatches (configs, buffers,
starting weights) and outputs that would overwrite an input refused clearly."""
import os

import pytest
import torch

from fractus.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, weights_fingerprint
import fractus.merge as merge_mod
from fractus.merge import distance_to_mean, main, merge
from fractus.model import FractusConfig, FractusCTE
from fractus.training.command import train
from util import cli, make_corpus
from util import assert_rel

ANCESTOR = "0" * 32  # the fingerprint checkpoints saved by hand claim to share


def shard(base: FractusCTE, seed: int) -> FractusCTE:
    """``base`` moved a little, as if trained further on its own data."""
    model = FractusCTE(base.cfg)
    model.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model


def train_ckpt(path, model: FractusCTE, compiled: bool = False) -> None:
    """A trainer-style checkpoint: optimizer, carried state, step… and optionally compiled keys."""
    prefix = "_orig_mod." if compiled else ""
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(path, {"config": model.cfg.to_dict(),
                           "model": {prefix + k: v for k, v in model.state_dict().items()},
                           "optimizer": opt.state_dict(), "step": 7, "states": [model.init_state(2)],
                           "ancestor": ANCESTOR})


def test_merge_is_the_parameter_mean(tmp_path, capsys, monkeypatch):
    base = FractusCTE(FractusConfig.preset("tiny", vocab_size=97))
    shards = [shard(base, s) for s in (1, 2, 3)]
    paths = [tmp_path / f"s{i}.pt" for i in range(3)]
    for i, (m, p) in enumerate(zip(shards, paths)):
        train_ckpt(p, m, compiled=i == 1)
    reads = []
    monkeypatch.setattr(merge_mod, "load_checkpoint", lambda p: reads.append(p) or load_checkpoint(p))
    main([str(p) for p in paths] + ["-o", str(tmp_path / "m.pt")])
    assert reads == [str(p) for p in paths] * 2, "read for the sum, then for the distance: one model in memory"
    ck = load_checkpoint(tmp_path / "m.pt")
    printed = capsys.readouterr().out
    for m, p in zip(shards, paths):
        assert f"{p}: relative distance to the mean {distance_to_mean(m.state_dict(), ck['model']):.4f}" in printed
    assert set(ck) == {"config", "model", "ancestor", "merged_from"}, "no optimizer or recurrent state"
    assert ck["ancestor"] == ANCESTOR
    merged = FractusCTE.load(tmp_path / "m.pt")
    for name, p in merged.named_parameters():
        mean = torch.stack([dict(m.named_parameters())[name] for m in shards]).mean(0)
        assert_rel(p, mean, 1e-6, name)
    x = torch.randint(0, 97, (1, 9))
    assert torch.isfinite(merged(x)[0]).all()


def test_merge_ignores_run_settings(tmp_path):
    """Configs that differ in training settings merge: lb_coef, and a chunk length one saved config names."""
    base = FractusCTE(FractusConfig.preset("tiny", vocab_size=97))
    other = FractusCTE(FractusConfig.preset("tiny", vocab_size=97, lb_coef=0.1))
    other.load_state_dict(base.state_dict())
    base.save(tmp_path / "a.pt", ancestor=ANCESTOR)
    save_checkpoint(tmp_path / "b.pt", {"config": {**other.cfg.to_dict(), "chunk_len": 64},
                                        "model": other.state_dict(), "ancestor": ANCESTOR})
    merged, distances = merge([tmp_path / "a.pt", tmp_path / "b.pt"])
    assert distances == [0.0, 0.0]
    for k, v in base.state_dict().items():
        assert_rel(merged["model"][k], v, 1e-7, k)


@pytest.mark.parametrize("over,msg", [(dict(vocab_size=101), "different vocabularies"),
                                      (dict(n_layers=3), "different configs: n_layers 2 vs 3"),
                                      (dict(router="linear"), "router 'phase' vs 'linear'")])
def test_merge_refuses_different_models(tmp_path, capsys, over, msg):
    FractusCTE(FractusConfig.preset("tiny", vocab_size=97)).save(tmp_path / "a.pt", ancestor=ANCESTOR)
    FractusCTE(FractusConfig.preset("tiny", **{"vocab_size": 97, **over})).save(tmp_path / "b.pt",
                                                                                 ancestor=ANCESTOR)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-o", str(tmp_path / "m.pt")])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()


def test_merge_refuses_different_phases_and_bad_files(tmp_path):
    a = FractusCTE(FractusConfig.preset("tiny", vocab_size=97))
    b = shard(a, 1)
    with torch.no_grad():
        b.blocks[0].moe.phases.copy_(b.blocks[0].moe.phases.roll(1))
    a.save(tmp_path / "a.pt", ancestor=ANCESTOR)
    b.save(tmp_path / "b.pt", ancestor=ANCESTOR)
    with pytest.raises(CheckpointError, match="buffer blocks.0.moe.phases differs"):
        merge([tmp_path / "a.pt", tmp_path / "b.pt"])
    (tmp_path / "t.pt").write_bytes((tmp_path / "a.pt").read_bytes()[:500])
    with pytest.raises(CheckpointError, match="truncated"):
        merge([tmp_path / "a.pt", tmp_path / "t.pt"])
    with pytest.raises(CheckpointError, match="at least two"):
        merge([tmp_path / "a.pt"])


def test_merge_needs_one_ancestor(tmp_path, capsys):
    """Trainer checkpoints: runs from one seed merge, runs from two seeds are refused (the
    original merged shards started from different seeds), and so is a checkpoint without a record."""
    data = make_corpus(tmp_path)
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        runs[name] = tmp_path / name / "ckpt.pt"
        train(cli(data, tmp_path / name, "--seed", str(seed), "--eval-every", "0", tokens=2 * 32))
    ab, _ = merge([runs["a"], runs["b"]])
    torch.manual_seed(1)
    assert ab["ancestor"] == weights_fingerprint(FractusCTE(FractusConfig.from_saved(ab["config"])).state_dict())
    with pytest.raises(SystemExit) as e:
        main([str(runs["a"]), str(runs["c"]), "-o", str(tmp_path / "m.pt")])
    assert e.value.code == 2 and "started from different weights" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()
    FractusCTE.load(runs["a"]).save(tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="does not record the weights its run started from"):
        merge([runs["a"], tmp_path / "bare.pt"])


@pytest.mark.parametrize("alias", ["same", "spelled", "symlink", "hardlink"])
def test_merge_refuses_to_overwrite_an_input(tmp_path, capsys, alias):
    base = FractusCTE(FractusConfig.preset("tiny", vocab_size=97))
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    train_ckpt(a, shard(base, 1))
    train_ckpt(b, shard(base, 2))
    out = {"same": a, "spelled": tmp_path / "sub" / ".." / "a.pt", "symlink": tmp_path / "link.pt",
           "hardlink": tmp_path / "hard.pt"}[alias]
    (tmp_path / "sub").mkdir()
    os.symlink(b, tmp_path / "link.pt")
    os.link(b, tmp_path / "hard.pt")
    before = a.read_bytes(), b.read_bytes()
    with pytest.raises(SystemExit) as e:
        main([str(a), str(b), "-o", str(out)])
    assert e.value.code == 2 and "it is the input" in capsys.readouterr().err
    assert (a.read_bytes(), b.read_bytes()) == before
    assert load_checkpoint(a)["step"] == 7, "the trainer checkpoint is still resumable"


def test_merge_refuses_a_directory_as_output(tmp_path, capsys):
    base = FractusCTE(FractusConfig.preset("tiny", vocab_size=97))
    train_ckpt(tmp_path / "a.pt", shard(base, 1))
    train_ckpt(tmp_path / "b.pt", shard(base, 2))
    (tmp_path / "m").mkdir()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-o", str(tmp_path / "m")])
    assert e.value.code == 2 and "it is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt", "m"], "nothing written"


def test_merge_refuses_an_existing_output_unless_forced(tmp_path, capsys):
    base = FractusCTE(FractusConfig.preset("tiny", vocab_size=97))
    a, b, out = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "ckpt.pt"
    train_ckpt(a, shard(base, 1))
    train_ckpt(b, shard(base, 2))
    train_ckpt(out, shard(base, 3))  # a training run's resumable checkpoint
    before = out.read_bytes()
    with pytest.raises(SystemExit) as e:
        main([str(a), str(b), "-o", str(out)])
    assert e.value.code == 2 and "the file exists (--force replaces it)" in capsys.readouterr().err
    assert out.read_bytes() == before
    main([str(a), str(b), "-o", str(out), "--force"])
    assert "step" not in load_checkpoint(out) and load_checkpoint(out)["merged_from"] == [str(a), str(b)]


def test_merge_refuses_a_non_finite_mean(tmp_path, capsys):
    base = FractusCTE(FractusConfig.preset("tiny", vocab_size=97))
    bad = shard(base, 2)
    with torch.no_grad():
        bad.embed.weight[0, 0] = float("inf")
    train_ckpt(tmp_path / "a.pt", shard(base, 1))
    train_ckpt(tmp_path / "b.pt", bad)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-o", str(tmp_path / "m.pt")])
    assert e.value.code == 2 and "the merge holds non-finite values (NaN or inf)" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()
