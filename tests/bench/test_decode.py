"""The decode benchmark at tiny sizes: every model at every position and batch, the CTE's state of
one size, the full cache growing with the position, the sliding one capped at the context, and a
synthetic cache that decodes as a real one of its length does."""
import pandas as pd
import pytest
import torch

from fractus.bench import decode as D

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rows_cover_every_model_position_and_batch(tmp_path):
    rows = pd.DataFrame(D.run(tmp_path, smoke=True))
    dec = rows[rows.kind == "decode"]
    assert len(dec) == len(D.MODELS) * 3 * 2 and set(dec.model) == set(D.MODELS)
    assert (tmp_path / "decode_cpu.csv").exists() and (tmp_path / "decode.png").exists()
    for b, g in dec.groupby("batch"):
        by = g.set_index(["model", "tokens"]).state_bytes
        assert by["cte"].nunique() == 1 and by["cte"].iloc[0] > 0 and (by["cte, compiled"] == by["cte"]).all()
        full, sliding = by["transformer, full cache"], by["transformer, sliding cache"]
        assert full.is_monotonic_increasing and full.loc[300] == 300 * full.loc[1]
        assert sliding.loc[300] == sliding.loc[64] * 256 / 64 < full.loc[300]  # capped at the context, 256
    compile_s = rows[rows.kind == "compile"]  # once per batch size, at the first position
    assert list(compile_s.batch) == [1, 2] and (compile_s.ms > 0).all()
    pre = rows[rows.kind == "prefill"]
    assert sorted(pre.model.unique()) == ["cte", "transformer"] and (pre.tokens_s > 0).all()


def test_a_synthetic_cache_decodes_like_a_real_one_of_its_length():
    cte, tf = D.build("tiny", vocab=512)
    torch.manual_seed(1)
    real = tf.new_cache("full")
    tf.extend(torch.randint(0, 512, (2, 40)), real)
    fake = D.synthetic_cache(tf, 2, 40, None, spare=4)
    for layer, src in zip(fake.layers, real.layers):
        layer.keys[:, :, :40], layer.values[:, :, :40] = src.keys[:, :, :40], src.values[:, :, :40]
    tok = torch.randint(0, 512, (2, 1))
    assert torch.allclose(tf.extend(tok, fake), tf.extend(tok, real), atol=1e-6)
