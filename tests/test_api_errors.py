"""The model's Python API on bad or degenerate input: a defined result or a ValueError naming the
argument, never an error from deep inside torch."""
import pytest
import torch

from fractus.model import FractusConfig, FractusCTE

@pytest.fixture(scope="module")
def model():
    return FractusCTE(FractusConfig.preset("tiny")).eval()


def test_an_empty_batch_gives_empty_logits_and_an_empty_state(model, one_thread):
    """[0, T] ids: logits [0, T, V] and the state of a batch of 0 streams (init_state(0)'s shapes),
    which a next chunk carries on (not a reshape RuntimeError)."""
    c = model.cfg
    with torch.no_grad():
        logits, parts, state = model(torch.zeros(0, 4, dtype=torch.long))
        assert logits.shape == (0, 4, c.vocab_size) and parts["loss"] is None
        def shapes(st):
            return [[t.shape for t in block] for block in st]
        want = shapes(model.init_state(0))
        assert shapes(state) == want
        logits, _, state = model(torch.zeros(0, 3, dtype=torch.long), state)
        assert logits.shape == (0, 3, c.vocab_size) and shapes(state) == want


def test_an_empty_batch_with_targets_is_a_value_error(model, one_thread):
    """No position to score: the mean cross-entropy is undefined, so it is refused, not NaN."""
    x = torch.zeros(0, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="empty"):
        model(x, None, x)


@pytest.mark.parametrize("top_k", [2.5, True, "2"])
def test_a_top_k_that_is_not_an_integer_is_a_value_error(model, one_thread, top_k):
    """Was a TypeError from torch's topk (2.5, True) or a comparison of str and int ("2")."""
    with pytest.raises(ValueError, match="top_k"):
        model.generate([1], 3, top_k=top_k)


def test_a_max_new_tokens_that_is_not_an_integer_is_a_value_error(model, one_thread):
    """A ValueError, not a TypeError from range() (the same kind of input as top_k)."""
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([1], 2.5)


def test_integer_top_k_and_max_new_tokens_still_work(model, one_thread):
    """The valid neighbours of the cases above (not awaiting anything)."""
    out = model.generate([1, 2], 3, top_k=2, seed=0)
    assert len(out) == 3 and all(isinstance(t, int) for t in out)


def test_a_state_is_checked_against_the_config_it_was_made_for(model, one_thread):
    """Another model's state of the same batch size, an integer state, a state on another device:
    a ValueError naming the tensor, not a RuntimeError from deep inside the attention."""
    x = torch.ones(2, 3, dtype=torch.long)
    other = FractusCTE(FractusConfig.preset("tiny", d_model=64, n_heads=2)).init_state(2)
    ints = [tuple(t.long() for t in block) for block in model.init_state(2)]
    meta = [tuple(t.to("meta") for t in block) for block in model.init_state(2)]
    for state, msg in ((other, "the state of another model"), (ints, "a state holds floating-point"),
                       (meta, "is on meta, the model on cpu")):
        with pytest.raises(ValueError, match=msg):
            model(x, state)
    for token in (3, [1, 2], torch.ones(2, 1, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"step takes token ids as a \[B\] tensor"):
            model.step(token, None)


def test_a_model_too_large_for_memory_is_refused_before_it_is_allocated():
    from fractus.checkpoint import check_fits, parameter_count
    assert parameter_count(FractusCTE, FractusConfig.preset("tiny")) == FractusCTE(FractusConfig.preset("tiny")).num_params()
    for over in ({"n_layers": 1_000_000}, {"vocab_size": 2 ** 44}, {"d_model": 131072, "n_heads": 2048}):
        with pytest.raises(ValueError, match="GiB of fp32 weights alone, more than"):
            check_fits(FractusCTE, FractusConfig.preset("palier0", **over))
