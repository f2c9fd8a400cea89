"""Generation: the Transformer++'s KV cache equals recomputation, batched generation equals
single prompts for both models, and the arguments are checked."""
import pytest
import torch

from fractus.baseline import Transformer, TransformerConfig
from fractus.model import FractusConfig, FractusCTE

pytestmark = pytest.mark.usefixtures("one_thread")


def transformer(short_conv=0, context=40):
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=64, d_model=32, head_dim=16, n_layers=2, context=context,
                                         short_conv=short_conv)).eval()


@pytest.mark.parametrize("short_conv", [0, 4])
@pytest.mark.parametrize("cache", ["full", "sliding"])
def test_the_kv_cache_equals_recomputation_within_the_context(short_conv, cache):
    tf = transformer(short_conv)
    x = torch.randint(0, 64, (3, 40))
    kv = tf.new_cache(cache)
    got = torch.cat([tf.extend(x[:, :17], kv)] + [tf.extend(x[:, t:t + 1], kv) for t in range(17, 40)], 1)
    assert (got - tf(x)[0]).abs().max() < 1e-5 and kv.position == 40
    held = 2 * 2 * 3 * 40 * 32 * 4  # layers · (k, v) · B · positions · d · fp32 bytes
    assert kv.nbytes() == held + (2 * 3 * 3 * 3 * 32 * 4 if short_conv else 0)  # + the convolution's last 3 inputs


@pytest.mark.parametrize("short_conv", [0, 4])
def test_a_sliding_cache_attends_to_the_last_context_positions(short_conv):
    """Past the context, token-by-token decoding (old keys dropped as the buffer fills) equals one
    read of the whole sequence under a banded mask; the full cache attends to everything and the
    cache's bytes stop growing only for the sliding one."""
    tf = transformer(short_conv, context=16)
    x = torch.randint(0, 64, (2, 100))
    banded = tf.extend(x, tf.new_cache("sliding"), block=100)  # one block: the mask alone slides
    kv = tf.new_cache("sliding")
    sizes = []
    steps = [tf.extend(x[:, :5], kv)]
    for t in range(5, 100):
        steps.append(tf.extend(x[:, t:t + 1], kv))
        sizes.append(kv.layers[0].length)
    assert (torch.cat(steps, 1) - banded).abs().max() < 1e-5
    assert max(sizes) <= 32 and min(sizes[20:]) >= 15  # at most 2·context held, at least context − 1
    full = tf.new_cache("full")
    assert not torch.allclose(tf.extend(x, full)[:, -1], banded[:, -1], atol=1e-3)
    assert full.layers[0].length == 100


@pytest.mark.parametrize("make", [lambda: transformer(4), lambda: FractusCTE(FractusConfig.preset("tiny", vocab_size=64))],
                         ids=["transformer", "cte"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_generation_equals_each_prompt_alone(make, temperature):
    model = make()
    prompts = torch.randint(0, 64, (4, 7))
    batch = model.generate(prompts, 12, temperature=temperature, top_k=20, seed=11)
    assert len(batch) == 4 and all(len(r) == 12 for r in batch)
    for i in range(4):
        assert model.generate(prompts[i].tolist(), 12, temperature=temperature, top_k=20, seed=11 + i) == batch[i]
    assert model.generate(prompts.tolist(), 12, temperature=temperature, top_k=20, seed=11) == batch


def test_the_transformers_caches_generate_what_recomputation_does_within_the_context():
    tf = transformer(context=64)
    p = torch.randint(0, 64, (10,)).tolist()
    ref = tf.generate(p, 30, temperature=0.8, seed=1, cache="none")
    assert tf.generate(p, 30, temperature=0.8, seed=1, cache="full") == ref
    assert tf.generate(p, 30, temperature=0.8, seed=1) == ref  # sliding: the default


@pytest.mark.parametrize("make", [lambda: transformer(), lambda: FractusCTE(FractusConfig.preset("tiny", vocab_size=64))],
                         ids=["transformer", "cte"])
def test_generate_refuses_bad_arguments(make):
    model = make()
    cases = [([[1, 2], [3]], "equal lengths"), (torch.zeros(1, 2, 3, dtype=torch.long), "integer token ids"),
             ([[1.5, 2.0]], "integer token ids"), ([], "the prompt is empty")]
    for prompt, msg in cases:
        with pytest.raises(ValueError, match=msg):
            model.generate(prompt, 2)
    for seed in (1.5, -1, True, "1"):
        with pytest.raises(ValueError, match="seed must be None or an integer"):
            model.generate([1, 2], 2, seed=seed)
    if isinstance(model, Transformer):
        with pytest.raises(ValueError, match="cache must be one of"):
            model.generate([1, 2], 2, cache="paged")
