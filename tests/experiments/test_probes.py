"""The generation and merge probes' helpers (:mod:`fractus.experiments.probes`): repetition metrics,
the mean merge, decode against the chunked forward."""
import pytest
import torch

from fractus.experiments import probes as PR
from fractus.model import FractusConfig, FractusCTE

pytestmark = pytest.mark.usefixtures("one_thread")


def test_repetition_metrics_on_known_sequences():
    assert PR.distinct_n(list("abcd"), 1) == 1.0
    assert PR.distinct_n(list("aaaa"), 1) == 0.25
    assert PR.distinct_n(list("abab"), 2) == pytest.approx(2 / 3)
    assert PR.distinct_n(list("a"), 2) == 0.0
    assert PR.longest_repeat_run(list("ababab")) == (6, 2)
    assert PR.longest_repeat_run(list("xaaaay")) == (4, 1)
    assert PR.longest_repeat_run(list("abcabcab")) == (8, 3)
    assert PR.longest_repeat_run(list("abcdef")) == (0, 0)
    assert PR.longest_repeat_run(list("abcab")) == (0, 0)  # one and a half copies is not a repeat
    assert PR.longest_repeat_run([7, 7]) == (2, 1)
    assert PR.top_token_share(list("aabc")) == 0.5
    m = PR.repetition_metrics([1, 2, 1, 2, 1, 2, 3])
    assert m == {"distinct_1": 3 / 7, "distinct_2": 3 / 6, "longest_repeat_run": 6, "repeat_period": 2,
                 "top_token_share": 3 / 7}
    ref = PR.reference_metrics(list(range(100)), n_windows=4, length=10)
    assert len(ref) == 4 and all(r["distinct_1"] == 1.0 and r["longest_repeat_run"] == 0 for r in ref)


def test_mean_merge():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor([3])}
    m = PR.mean_merge([a, b])
    assert torch.equal(m["w"], torch.tensor([2.0, 4.0])) and torch.equal(m["n"], torch.tensor([3]))


def test_decode_vs_forward_and_generation_table():
    torch.manual_seed(0)
    model = FractusCTE(FractusConfig.preset("tiny"))
    r = PR.decode_vs_forward(model, list(range(1, 40)))
    assert r["positions"] == 39 and r["max_rel_err"] < 1e-5 and r["argmax_agreement"] == 1.0

    class Enc:  # a stand-in tokenizer over the tiny vocabulary
        def encode_ordinary(self, s):
            return [ord(c) % 500 for c in s]

        def decode(self, ids):
            return " ".join(map(str, ids))

    rows = PR.generation_table(model, Enc(), prompts=("ab", "cd"), max_new_tokens=6)
    assert len(rows) == 2 * len(PR.STRATEGIES)
    assert all(len(r["ids"]) == 6 and 0 <= r["distinct_2"] <= 1 for r in rows)
