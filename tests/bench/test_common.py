"""The benchmarks' shared helpers (:mod:`fractus.bench.common`): the allocator's setting and runs in a
fresh process."""
import pytest


def test_keep_freed_memory_applies_on_linux_glibc():
    import platform

    from fractus.allocator import keep_freed_memory
    expected = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is expected
    assert keep_freed_memory() is expected  # idempotent


def test_in_fresh_process_returns_result_and_reraises():
    from fractus.bench.common import in_fresh_process
    r = in_fresh_process("fractus.bench.throughput:measure_training", preset="tiny", batch_size=2, chunk_len=8,
                         accum=1, steps=1)
    assert r["preset"] == "tiny" and r["tok_s"] > 0 and r["tok_s_best"] >= r["tok_s"]
    with pytest.raises(RuntimeError, match="unknown preset"):
        in_fresh_process("fractus.bench.throughput:measure_training", preset="nope")
