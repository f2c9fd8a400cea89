"""Corpora larger than memory: every input format, shards read as one array, the same tokens
whatever the workers or shard size, and bad input named by file and line."""
import gzip
import json

import numpy as np
import pytest
import torch

from fractus import corpus
from fractus.data import ShuffledWindows, TokenStreams, load_meta, load_tokens, main, prepare
from fractus.tokenizer import get_tokenizer

VOCAB = 512
TEXTS = [f"Document {i}: " + " ".join(["the cat sat on the mat", "a dog ran far", "birds sang"][i % 3] for _ in range(i % 7 + 1))
         for i in range(200)]


def expected_ids(texts):
    enc = get_tokenizer(VOCAB)
    return np.concatenate([np.asarray(enc.encode_ordinary(t) + [enc.eot_token]) for t in texts])


def write_jsonl(path, texts, field="text"):
    lines = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines.encode()))
    elif path.suffix == ".zst":
        import zstandard
        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


def write_parquet(path, texts, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path, row_group_size=37)
    return path


def both_splits(out):
    meta = load_meta(out)
    return meta, np.asarray(load_tokens(out, "train")[:]), np.asarray(load_tokens(out, "val")[:])


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet"])
def test_every_record_format_gives_the_documents_tokens(tmp_path, name):
    path = tmp_path / name
    write_parquet(path, TEXTS) if name.endswith("parquet") else write_jsonl(path, TEXTS)
    meta = prepare(str(path), tmp_path / "out", VOCAB, val_fraction=0.2, shard_tokens=1000)
    _, train, val = both_splits(tmp_path / "out")
    is_val = [d.startswith(str(path)) for d in meta["val"]["documents"]]
    assert all(is_val) and meta["train"]["n_documents"] + meta["val"]["n_documents"] == len(TEXTS)
    rows = lambda split: [int(d.rsplit(":", 1)[1].replace("row ", "")) - 1 for d in meta[split]["documents"]]
    assert np.array_equal(train, expected_ids([TEXTS[i] for i in rows("train")]))
    assert np.array_equal(val, expected_ids([TEXTS[i] for i in rows("val")]))
    assert 0.1 < meta["val"]["n_documents"] / len(TEXTS) < 0.3  # drawn per document, deterministic
    assert len(meta["train"]["shards"]) == -(-meta["train"]["tokens"] // 1000)
    assert all(s["tokens"] == 1000 for s in meta["train"]["shards"][:-1])


def test_the_same_tokens_whatever_the_workers_and_shards(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", TEXTS * 30)  # ~400 kB: several batches
    one = prepare(str(tmp_path / "a.jsonl"), tmp_path / "one", VOCAB, workers=1)
    two = prepare(str(tmp_path / "a.jsonl"), tmp_path / "two", VOCAB, workers=2, shard_tokens=7777)
    assert [s["file"] for s in one["train"]["shards"]] == ["train.bin"] and len(two["train"]["shards"]) > 5
    for split in ("train", "val"):
        a, b = load_tokens(tmp_path / "one", split), load_tokens(tmp_path / "two", split)
        assert len(a) == len(b) and np.array_equal(a[:], b[:]) and np.array_equal(np.asarray(b), a)
        assert int(b[7777]) == int(a[7777]) and int(b[-1]) == int(a[-1])  # single ids across shards
    assert one["val"]["unigram_entropy_nats"] == pytest.approx(two["val"]["unigram_entropy_nats"], abs=1e-12)


def test_training_reads_the_same_batches_from_shards_as_from_one_file(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", TEXTS * 5)
    prepare(str(tmp_path / "a.jsonl"), tmp_path / "one", VOCAB)
    prepare(str(tmp_path / "a.jsonl"), tmp_path / "many", VOCAB, shard_tokens=333)
    one, many = load_tokens(tmp_path / "one", "train"), load_tokens(tmp_path / "many", "train")
    for reader in (lambda t: TokenStreams(t, 3, 17), lambda t: ShuffledWindows(t, 4, 19, seed=3),
                   lambda t: ShuffledWindows(t, 2, 19, rank=1, world=2, seed=3)):
        a, b = reader(one), reader(many)
        for _ in range(40):
            xa, ya, _ = a.next()
            xb, yb, _ = b.next()
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_long_texts_are_encoded_in_pieces_with_the_same_tokens():
    enc = get_tokenizer(VOCAB)
    text = "".join(f"Line {i} of the play,\n\n  indented {i}\n\tand tabbed.\n" for i in range(2000))
    parts = corpus.pieces(text, size=500)
    assert len(parts) > 50 and "".join(parts) == text
    assert sum((enc.encode_ordinary(p) for p in parts), []) == enc.encode_ordinary(text)
    assert corpus.pieces("no break " * 100, size=50) == ["no break " * 100]


def test_text_inputs_keep_their_split_and_the_builtin_its_tokens(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(3):
        (tmp_path / "d" / f"doc{i}.txt.gz").write_bytes(gzip.compress(("line of text\n" * 50).encode()))
    meta = prepare(str(tmp_path / "d"), tmp_path / "out", VOCAB, val_fraction=0.2)
    assert meta["train"]["documents"] == ["doc0.txt.gz", "doc1.txt.gz", "doc2.txt.gz:train"]
    assert meta["val"]["documents"] == ["doc2.txt.gz:val"]


def test_a_separate_validation_input(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", TEXTS[:150])
    write_parquet(tmp_path / "val.parquet", TEXTS[150:])
    prepare(str(tmp_path / "train.jsonl"), tmp_path / "out", VOCAB, val_input=str(tmp_path / "val.parquet"))
    _, train, val = both_splits(tmp_path / "out")
    assert np.array_equal(train, expected_ids(TEXTS[:150])) and np.array_equal(val, expected_ids(TEXTS[150:]))


def bad(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["prepare", *argv, "--out", str(tmp_path / "out"), "--vocab", str(VOCAB), "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "meta.json").exists() and not (tmp_path / "out" / ".prepare").exists()
    return err


def test_bad_input_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"text": "fine"}) + "\nnot json\n")
    assert f"{j}:2: not a JSON line" in bad(tmp_path, capsys, ["--input", str(j)])
    j.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    assert f"{j}:2: no text field 'text'" in bad(tmp_path, capsys, ["--input", str(j)])
    j.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert f"{j}:2: not UTF-8" in bad(tmp_path, capsys, ["--input", str(j)])
    p = write_parquet(tmp_path / "c.parquet", ["a", "b"], column="body")
    assert "no column 'text'" in bad(tmp_path, capsys, ["--input", str(p)])
    (tmp_path / "x.parquet").write_text("not parquet")
    assert "not a Parquet file" in bad(tmp_path, capsys, ["--input", str(tmp_path / "x.parquet")])
    (tmp_path / "c.csv").write_text("a,b\n")
    assert "c.csv: files ending in .csv are not read" in bad(tmp_path, capsys, ["--input", str(tmp_path / "c.csv")])
    (tmp_path / "t.txt").write_bytes(b"ok\n\xff\xfe\n")
    assert "t.txt is not UTF-8 text: line 2" in bad(tmp_path, capsys, ["--input", str(tmp_path / "t.txt")])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("text\n")
    write_jsonl(mixed / "b.jsonl", ["x"])
    assert "mixes text files" in bad(tmp_path, capsys, ["--input", str(mixed)])
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "the corpus is empty" in bad(tmp_path, capsys, ["--input", str(tmp_path / "empty.jsonl")])
    (tmp_path / "z.jsonl.zst").write_bytes(b"not zstd")
    assert "z.jsonl.zst" in bad(tmp_path, capsys, ["--input", str(tmp_path / "z.jsonl.zst")])


def test_an_interrupted_force_keeps_the_data_that_was_there(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", TEXTS)
    prepare(str(tmp_path / "a.jsonl"), tmp_path / "out", VOCAB)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    write_jsonl(tmp_path / "b.jsonl", TEXTS[::-1] * 3)

    def interrupted(*a, **k):
        yield next(iter(real(*a, **k)))
        raise KeyboardInterrupt
    import fractus.data
    real = fractus.data.encoded_batches
    monkeypatch.setattr(fractus.data, "encoded_batches", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(tmp_path / "b.jsonl"), tmp_path / "out", VOCAB, force=True, shard_tokens=100)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    monkeypatch.undo()
    meta = prepare(str(tmp_path / "b.jsonl"), tmp_path / "out", VOCAB, force=True, shard_tokens=1000)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(["meta.json", *(s["file"] for sp in ("train", "val") for s in meta[sp]["shards"])])


def test_a_load_checks_sizes_and_checksums_without_reading_the_corpus_whole(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", TEXTS * 3)
    meta = prepare(str(tmp_path / "a.jsonl"), tmp_path / "out", VOCAB, shard_tokens=500)
    shard = tmp_path / "out" / meta["train"]["shards"][2]["file"]
    ids = np.memmap(shard, dtype=np.uint16, mode="r+")
    ids[10] = (int(ids[10]) + 1) % (VOCAB - 1)  # a valid id, changed: only the checksum sees it
    ids.flush()
    del ids
    with pytest.raises(ValueError, match=f"{shard} does not match meta.json's checksum"):
        load_tokens(tmp_path / "out", "train")
    assert len(load_tokens(tmp_path / "out", "train", verify=False)) == meta["train"]["tokens"]


def test_the_prepare_benchmark_measures_both_methods_on_one_corpus(tmp_path):
    from fractus.bench import prepare as bench
    path = bench.write_corpus(tmp_path / "c.jsonl", gigabytes=0.0005)
    assert path.stat().st_size > 500_000
    rows = bench.measure(path, vocab=VOCAB, cores=(1,))
    assert [r["method"] for r in rows] == ["tiktoken", "prepare"]
    assert rows[0]["tokens"] == rows[1]["tokens"] - sum(1 for _ in open(path))  # prepare adds one EOT a document
    assert rows[0]["vs_tiktoken"] == 1 and all(r["peak_rss_mb"] > 10 and r["mb_s"] > 0 for r in rows)
