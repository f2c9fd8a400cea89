"""The architecture ablation's runner (:mod:`fractus.experiments.architecture`)."""
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


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
    from fractus.training.optim import ADAMW_LR
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
