"""The optimization stack (:mod:`fractus.bench.optimizations`, :mod:`fractus.bench.setup`): the
cumulative and single set-ups, the toggles, and the GPU table's bf16 gain."""
import pytest

from fractus.bench import optimizations as O
from fractus.bench.setup import SMOKE_DIMS, Setup

pytestmark = pytest.mark.usefixtures("one_thread")


def test_optimization_stack_and_alone():
    base = Setup(dims=tuple(SMOKE_DIMS.items()))
    assert base.config().top_k == base.config().n_experts  # the baseline runs every expert
    stack = O.stack(base)
    assert len(stack) == len(O.OPTIMIZATIONS) + 1 and stack[0] == ("baseline", base)
    last = stack[-1][1]
    assert (last.tie_head, last.head_positions, last.accum, last.chunk_len, last.detach_kuramoto,
            last.optimizer, last.batch_size, last.vocab_size, last.fused_ce) == \
        (True, "last", 8, 32, True, "sgd", 8, 8192, True)
    assert last.config().top_k == 2 and last.active_blocks == 1 and last.tokens_per_step() == 2048
    alone = dict(O.alone(base))
    assert alone["reduced vocabulary"].vocab_size == base.reduced_vocab
    assert alone["tied head"].head_positions == "all" and alone["tied head"].tie_head
    assert len(alone) == len(O.OPTIMIZATIONS) + len(O.ALONE_EXTRA)
    assert last.lr() == 0.1 and Setup(batch_size=8, chunk_len=32, accum=8).lr() == 2e-3
    assert Setup().lr() == pytest.approx(2e-3 * (16 / 2048) ** 0.5)


def test_toggles_switch_one_optimization_in_the_combined_configuration():
    base = Setup()
    combined, toggles = O.toggles(base)
    assert combined == O.stack(base, O.OPTIMIZATIONS[:-1])[-1][1] and combined.active_blocks == 0
    assert [n for n, *_ in toggles] == [n for n, *_ in O.OPTIMIZATIONS]
    for name, on, off in toggles:
        differ = {k for k in on.__dataclass_fields__ if getattr(on, k) != getattr(off, k)}
        assert len(differ) == 1, (name, differ)
        assert (on == combined) != (name.startswith("PGSU")) and (off == combined) == name.startswith("PGSU")


def test_bf16_gain_of_an_optimizations_table():
    import pandas as pd
    plan = O.gpu_plan(cuda=True)
    table = pd.DataFrame([{"table": t, "optimization": n, "dtype": "bfloat16" if bf16 else "float32", "tok_s": 100.0}
                          for t, n, _, bf16, _ in plan])
    table.loc[table["table"] != "cumulative", "speedup_vs_last_row"] = [0.5, 0.25]  # fp32, then PyTorch
    assert O.bf16_gain(table) == 2.0
    assert O.bf16_gain(table[table["table"] == "cumulative"]) is None  # stopped before its variants
    assert O.bf16_gain(table.assign(dtype="float32")) is None  # a dry run: fp32 throughout
    assert O.bf16_gain(table.iloc[:0]) is None
