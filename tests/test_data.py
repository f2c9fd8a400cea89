"""Tokenizer, corpus preparation (prepared data never replaced unasked, damaged data named) and
the contiguous token streams."""
import json
import os

import numpy as np
import pytest
import torch

from fractus.data import (VAL_PLAYS, TokenStreams, load_meta, load_tokens, main, prepare,
                          shakespeare_plays, split_documents, strip_markdown)
from fractus.tokenizer import get_tokenizer, token_byte_lengths


@pytest.mark.parametrize("n", [512, 8192, 50257])
def test_reduced_vocabulary_roundtrips(n):
    enc = get_tokenizer(n)
    assert enc.n_vocab == n
    text = "Ĉu vi parolas? To be, or not to be — 42 naïve café 🙂\n"
    ids = enc.encode_ordinary(text)
    assert max(ids) < n - 1 and enc.decode(ids) == text
    assert len(get_tokenizer(512).encode_ordinary(text)) > len(get_tokenizer(50257).encode_ordinary(text))
    lens = token_byte_lengths(enc)
    assert int(lens[ids].sum()) == len(text.encode())


def test_vocabulary_bounds():
    with pytest.raises(ValueError):
        get_tokenizer(100)
    with pytest.raises(ValueError):
        get_tokenizer(200_000)


def test_shakespeare_split_by_whole_plays():
    plays = shakespeare_plays()
    assert len(plays) == 38
    train, val = split_documents(plays, val_names=VAL_PLAYS)
    assert sorted(n for n, _ in val) == sorted(VAL_PLAYS)
    assert not {n for n, _ in train} & set(VAL_PLAYS)
    macbeth = dict(plays)["macbeth"]
    assert "FIRST WITCH:\nWhen shall we three meet again" in macbeth
    assert "**" not in macbeth and "##" not in macbeth


def test_strip_markdown():
    md = "# Play\n\n## ACT I\n\n_Enter Bob_\n\n**BOB**  \nHello,  \nworld.\n"
    assert strip_markdown(md) == "Play\n\nACT I\n\nEnter Bob\n\nBOB:\nHello,\nworld.\n"


def test_prepare_directory_and_file(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(5):
        (d / f"doc{i}.txt").write_text(f"Document number {i}. " * 50)
    meta = prepare(str(d), tmp_path / "out", vocab_size=512)
    assert meta["val"]["documents"] and not set(meta["val"]["documents"]) & set(meta["train"]["documents"])
    tr = load_tokens(tmp_path / "out", "train")
    assert len(tr) == meta["train"]["tokens"] and tr.max() < 512
    enc = get_tokenizer(512)
    assert enc.decode(tr[: 20].tolist()).startswith("Document number 0.")
    assert load_meta(tmp_path / "out")["val"]["unigram_entropy_nats"] > 0
    f = tmp_path / "one.txt"
    f.write_text("line one\n" * 200)
    m = prepare(str(f), tmp_path / "out1", vocab_size=512)
    assert m["train"]["tokens"] > m["val"]["tokens"] > 1


def test_bad_corpora(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        prepare(str(tmp_path / "empty"), tmp_path / "o1", vocab_size=512)
    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match="empty"):
        prepare(str(tmp_path / "blank.txt"), tmp_path / "o2", vocab_size=512)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="UTF-8"):
        prepare(str(tmp_path / "bin.txt"), tmp_path / "o3", vocab_size=512)
    with pytest.raises(FileNotFoundError):
        prepare(str(tmp_path / "missing"), tmp_path / "o4", vocab_size=512)
    with pytest.raises(FileNotFoundError, match="prepare"):
        load_meta(tmp_path / "nothing")


def test_prepare_refuses_prepared_data_unless_forced(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("line one\n" * 200)
    (tmp_path / "b.txt").write_text("another corpus\n" * 300)
    out = tmp_path / "out"
    prepare(str(tmp_path / "a.txt"), out, vocab_size=512)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--input", str(tmp_path / "b.txt"), "--out", str(out), "--vocab", "512"])
    assert e.value.code == 2
    assert "already holds prepared data (meta.json)" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    main(["prepare", "--input", str(tmp_path / "b.txt"), "--out", str(out), "--vocab", "512", "--force"])
    assert load_meta(out)["source"] == str(tmp_path / "b.txt")
    (tmp_path / "f.txt").write_text("a file, not a folder\n")
    with pytest.raises(SystemExit) as e:  # NotADirectoryError: a message, not a traceback
        main(["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "f.txt" / "d")])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: ")


def test_hidden_directories_are_skipped(tmp_path):
    d = tmp_path / "corpus"
    (d / ".git").mkdir(parents=True)
    (d / ".git" / "index").write_bytes(b"DIRC\xff\xfe\x00")  # not UTF-8
    for i in range(3):
        (d / f"doc{i}.txt").write_text(f"Document number {i}. " * 50)
    meta = prepare(str(d), tmp_path / "out", vocab_size=512)
    assert meta["train"]["documents"] == ["doc0.txt", "doc1.txt", "doc2.txt:train"]
    assert meta["val"]["documents"] == ["doc2.txt:val"]


@pytest.mark.parametrize("sizes,val_docs", [((100, 900), ["b:val"]), ((900, 100), ["b"]),
                                            ((850, 60, 90), ["b:val", "c"]), ((1000,), ["a:val"])])
def test_validation_is_the_last_fraction_of_the_text(sizes, val_docs):
    """Whole documents from the end, the one the boundary falls in cut at a line break: never a
    validation split larger than asked because the last document is long."""
    docs = [(name, "word\n" * n) for name, n in zip("abc", sizes)]
    train, val = split_documents(docs, val_fraction=0.1)
    assert [n for n, _ in val] == val_docs
    assert "".join(t for _, t in train + val) == "".join(t for _, t in docs)
    assert sum(len(t) for _, t in val) == pytest.approx(0.1 * 5 * sum(sizes), abs=5)



def test_a_boundary_without_a_line_break_before_it_is_cut_mid_line():
    text = "\n" + "word " * 2000  # a blank line, then one long line: no text before its line break
    train, val = split_documents([("a", text)], val_fraction=0.1)
    assert [n for n, _ in train] == ["a:train"] and len(val[0][1]) == 1000


@pytest.mark.parametrize("damage,msg", [("json", "Expecting"), ("no val", "val.tokens is missing, not int"),
                                        ("str vocab", "vocab_size is '512', not int"),
                                        ("list", "vocab_size is missing")])
def test_damaged_meta_is_named(tmp_path, damage, msg):
    (tmp_path / "c.txt").write_text("line one\n" * 200)
    meta = prepare(str(tmp_path / "c.txt"), tmp_path / "out", vocab_size=512)
    text = {"json": json.dumps(meta)[:-3], "no val": json.dumps({k: v for k, v in meta.items() if k != "val"}),
            "str vocab": json.dumps({**meta, "vocab_size": "512"}), "list": "[]"}[damage]
    (tmp_path / "out" / "meta.json").write_text(text)
    with pytest.raises(ValueError, match=rf"out/meta.json is damaged \(.*{msg}.*\): prepare the data again"):
        load_meta(tmp_path / "out")


def test_token_files_of_the_wrong_size_are_named(tmp_path):
    (tmp_path / "c.txt").write_text("line one\n" * 200)
    n = prepare(str(tmp_path / "c.txt"), tmp_path / "out", vocab_size=512)["train"]["tokens"]
    with open(tmp_path / "out" / "train.bin", "ab") as f:
        f.write(b"\0")  # half a token: not numpy's "not a multiple of the data-type size"
    with pytest.raises(ValueError, match=f"train.bin holds {2 * n + 1:,} bytes but meta.json says {n:,} tokens "
                                         "of 2 bytes.*prepare it again"):
        load_tokens(tmp_path / "out", "train")


def test_token_streams_are_contiguous_and_resumable():
    tokens = np.arange(1000, dtype=np.uint16)
    s = TokenStreams(tokens, batch_size=3, chunk_len=10)
    x, y, new = s.next()
    assert new and x.shape == (3, 10) and (y == x + 1).all()
    assert x[1, 0] == s.stream_len and x[2, 0] == 2 * s.stream_len
    x2, _, new2 = s.next()
    assert not new2 and (x2[:, 0] == x[:, -1] + 1).all()
    r = TokenStreams(tokens, 3, 10, position=s.position)
    assert (r.next()[0] == s.next()[0]).all()
    s.position = s.chunks_per_epoch
    assert s.next()[2]  # wrapped: a new epoch
    ranks = [TokenStreams(tokens, 2, 10, rank=k, world=2).next()[0] for k in range(2)]
    whole = TokenStreams(tokens, 4, 10).next()[0]
    assert (np.concatenate(ranks) == whole.numpy()).all()
    with pytest.raises(ValueError, match="too short"):
        TokenStreams(np.arange(20, dtype=np.uint16), batch_size=4, chunk_len=10)
    with pytest.raises(ValueError, match="batch_size and chunk_len must be ≥ 1, got 0 and 10"):
        TokenStreams(tokens, batch_size=0, chunk_len=10)


def test_a_vocab_size_that_is_not_the_datas_is_refused(tmp_path):
    """meta.json's vocab_size edited (512 → 600): the data was encoded with 512, its end-of-text id is
    511, and a 600-token model would score it as text. Named by the encoding, or, with the encoding
    edited too, by the ids."""
    (tmp_path / "c.txt").write_text("line one\n" * 200)
    meta = prepare(str(tmp_path / "c.txt"), tmp_path / "out", vocab_size=512)
    assert meta["encoding"] == "cl100k_512" and load_tokens(tmp_path / "out", "val")[-1] == 511
    (tmp_path / "out" / "meta.json").write_text(json.dumps({**meta, "vocab_size": 600}))
    with pytest.raises(ValueError, match=r"meta.json is damaged \(vocab_size 600 is not the vocabulary of its "
                                         r"encoding 'cl100k_512'\): prepare the data again"):
        load_meta(tmp_path / "out")
    (tmp_path / "out" / "meta.json").write_text(json.dumps({**meta, "vocab_size": 600, "encoding": "cl100k_600"}))
    with pytest.raises(ValueError, match="val.bin ends with token id 511, not the end-of-text id 599 of meta.json's "
                                         "vocab_size 600: it was encoded with another vocabulary"):
        load_tokens(tmp_path / "out", "val")
    (tmp_path / "out" / "meta.json").write_text(json.dumps({**meta, "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"meta.json is damaged \(vocab_size must be in \[257"):
        load_meta(tmp_path / "out")


def test_a_full_disk_names_the_file_and_its_cause(tmp_path, capsys, monkeypatch):
    """Every file prepare writes goes to /dev/full (writes fail with ENOSPC): the error names the
    file and the cause (not numpy's "1080002 requested and 512000 written"), and nothing is left."""
    import fractus.atomic

    def full_disk(fd, mode, **kwargs):
        os.close(fd)
        return open("/dev/full", mode, **kwargs)
    (tmp_path / "c.txt").write_text("line one\n" * 20000)
    monkeypatch.setattr(fractus.atomic.os, "fdopen", full_disk)
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--input", str(tmp_path / "c.txt"), "--out", str(tmp_path / "out"), "--vocab", "512"])
    monkeypatch.undo()
    assert e.value.code == 2
    train_bin = tmp_path / "out" / ".prepare" / "train-00000.bin"  # the first shard, written aside
    assert capsys.readouterr().err == f"error: cannot write {train_bin}: No space left on device\n"
    assert list((tmp_path / "out").iterdir()) == []


def test_shuffled_windows_read_every_window_once_an_epoch_in_a_random_order():
    """Each epoch visits every non-overlapping window once from one offset, the order and offset
    differ between epochs and seeds, a batch spans the corpus, ranks split each draw, and the
    position alone resumes the sequence."""
    import numpy as np
    from fractus.data import ShuffledWindows
    tokens = np.arange(1003)
    w = ShuffledWindows(tokens, 4, 10, seed=3)
    n = w.windows_per_epoch
    assert n == 99
    starts = [int(x[0]) for _ in range(-(-n // 4)) for x in w.next()[0]]
    epoch0 = starts[:n]
    offset = epoch0[0] % 10
    assert sorted(epoch0) == [offset + 10 * j for j in range(n)] and epoch0 != sorted(epoch0)
    x, y, fresh = ShuffledWindows(tokens, 4, 10, seed=3, position=5).next()
    assert fresh and torch.equal(y, x + 1) and [int(r[0]) for r in x] == starts[20:24]
    assert [int(r[0]) for r in ShuffledWindows(tokens, 4, 10, seed=4).next()[0]] != starts[:4]
    ranks = [ShuffledWindows(tokens, 2, 10, seed=3, rank=r, world=2).next()[0] for r in (0, 1)]
    assert [int(r[0]) for x in ranks for r in x] == starts[:4]
    with pytest.raises(ValueError, match="corpus too short"):
        ShuffledWindows(np.arange(15), 1, 10, seed=0)
