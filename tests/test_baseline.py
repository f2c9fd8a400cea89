"""The transformer baseline: causal, its generate reads a sliding context, and the trainer, its
resume, the evaluation and the sampler serve it as they serve the CTE."""
import pytest
import torch

from fractus.baseline import Transformer, TransformerConfig
from fractus.evaluate import evaluate_checkpoint
from fractus.training.registry import load_model
from fractus.training.command import main, train
from util import cli, make_corpus, metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_causal_and_context_checked():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=50, d_model=32, head_dim=16, n_layers=2, context=24)).eval()
    x = torch.randint(0, 50, (2, 24))
    y = x.clone()
    y[:, 11] = (y[:, 11] + 1) % 50
    with torch.no_grad():
        lx, ly = model(x)[0], model(y)[0]
    assert torch.equal(lx[:, :11], ly[:, :11]) and not torch.allclose(lx[:, 11:], ly[:, 11:])
    with pytest.raises(ValueError, match="reads 1 to 24 positions"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="head_positions='all'"):
        model(x, None, x, "last")
    with pytest.raises(ValueError, match="must be a multiple of head_dim"):
        TransformerConfig(d_model=30, head_dim=4)


def test_fused_loss_equals_cross_entropy_of_the_logits():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=50, d_model=32, head_dim=16, n_layers=1, context=16))
    x, t = torch.randint(0, 50, (3, 16)), torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        logits, _, _ = model(x)
        _, parts, state = model(x, None, t)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), t.reshape(-1))
    assert state is None and abs(float(parts["ce"]) - float(ce)) < 1e-5 and float(parts["lb"]) == 0


def test_generate_reads_the_last_context_tokens():
    """Greedy generation past the context: each new token is the argmax of a forward over the last
    ``context`` tokens."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=40, d_model=32, head_dim=16, n_layers=1, context=8)).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    out = model.generate(prompt, 5, temperature=0)
    ids = list(prompt)
    for tok in out:
        with torch.no_grad():
            assert tok == int(model(torch.tensor([ids[-8:]]))[0][0, -1].argmax())
        ids.append(tok)


def test_trainer_resume_evaluate_and_sample(data, tmp_path, capsys):
    """--model transformer through the trainer: a stopped and resumed run's metrics equal an uninterrupted
    one's; the checkpoint loads as a Transformer for evaluation and sampling; the CTE's own switches and a
    resume as the other model are refused."""
    argv = ["--model", "transformer", "--chunk-len", "16"]
    full, parts = tmp_path / "full", tmp_path / "parts"
    train(cli(data, full, *argv, tokens=30 * 32))
    train(cli(data, parts, *argv, "--stop-after", "13", tokens=30 * 32))
    train(cli(data, parts, *argv, "--resume", tokens=30 * 32))
    assert metrics(parts) == metrics(full)
    model = load_model(full / "ckpt.pt")
    assert isinstance(model, Transformer) and model.cfg.context == 16
    r = evaluate_checkpoint(full / "ckpt.pt", data, streams=2, chunk_len=16)
    assert abs(r["val_ce"] - float(metrics(full)[-1]["val_ce"])) < 1e-4  # the trainer's final validation
    assert r["val_read"] == "sliding"
    assert len(model.generate([1, 2, 3], 4, seed=0)) == 4
    capsys.readouterr()
    for extra, msg in ((["--detach-kuramoto"], "--model transformer has no --detach-kuramoto"),
                       (["--head-positions", "last"], "--model transformer has no --head-positions last"),
                       (["--set", "context=8"], "set the transformer's context with --chunk-len")):
        with pytest.raises(SystemExit) as e:
            main(cli(data, tmp_path / "bad", *argv, *extra))
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(cli(data, full, "--resume", tokens=40 * 32))
    assert e.value.code == 2 and "'model': ('transformer', 'cte')" in capsys.readouterr().err


def test_transformer_plus_plus_shape_and_size():
    """palier0's width and depth: 4 heads of 32, SwiGLU hidden ⌈8/3·128 / 8⌉·8 = 344, no biases,
    tied head, RMSNorm gains only: 1,444,480 parameters."""
    cfg = TransformerConfig()
    model = Transformer(cfg)
    assert (cfg.n_heads, cfg.d_ff) == (4, 344)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model.num_params() == 8192 * 128 + 2 * (4 * 128 ** 2 + 3 * 128 * 344 + 2 * 128) + 128 == 1_444_480


def test_input_checks_are_the_cte_s():
    """Token ids out of range, a state, and generate's arguments are refused as the CTE refuses them."""
    model = Transformer(TransformerConfig(vocab_size=50, d_model=32, head_dim=16, n_layers=1, context=8))
    for bad in (torch.tensor([[1, 50]]), torch.tensor([[-1, 2]])):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
            model(bad)
    with pytest.raises(ValueError, match="carries no state"):
        model(torch.tensor([[1, 2]]), [torch.zeros(1)])
    for kwargs, msg in (({"top_k": 2.5}, "top_k must be an integer"), ({"temperature": -1}, "temperature must be"),
                        ({"top_p": 0}, "top_p in"), ({"max_new_tokens": -5}, "max_new_tokens must be")):
        with pytest.raises(ValueError, match=msg):
            model.generate([1, 2], **{"max_new_tokens": 3, **kwargs})
    with pytest.raises(ValueError, match="integer token ids"):
        model.generate([1.7, 2.9], 3)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        model.generate([1, 60], 3)


def test_sliding_windows_score_every_target_once_with_context():
    """The sliding reading scores each target of the split exactly once; each scored target outside
    the first window sees at least context/2 tokens; its CE equals the per-target CE of a forward
    over exactly that window."""
    from fractus.training.evaluation import evaluate_text, sliding_windows as _windows
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (203,)).numpy()
    context, stride = 16, 8
    seen = []
    for x, y in _windows(tokens, context, stride, 3, None):
        for row_x, row_y in zip(x, y):
            start = int(np_where_equal(tokens, row_x))
            scored = (row_y != -100).nonzero().flatten().tolist()
            assert start == 0 or min(scored) >= context - stride
            seen += [start + j for j in scored]
    assert sorted(seen) == list(range(len(tokens) - 1))
    model = Transformer(TransformerConfig(vocab_size=50, d_model=32, head_dim=16, n_layers=1, context=context)).eval()
    tb = torch.ones(50, dtype=torch.long)
    r = evaluate_text(model, tokens, 3, context, None, tb, torch.device("cpu"), read="sliding")
    total = 0.0
    with torch.no_grad():
        for x, y in _windows(tokens, context, stride, 1, None):
            logits = model(x)[0]
            total += float(torch.nn.functional.cross_entropy(logits[0], y[0], ignore_index=-100, reduction="sum"))
    assert r["val_tokens"] == len(tokens) - 1 and abs(r["val_ce"] - total / (len(tokens) - 1)) < 1e-5
    chunks = evaluate_text(model, tokens, 3, context, None, tb, torch.device("cpu"), read="chunks")
    assert chunks["val_tokens"] == 3 * context * ((len(tokens) - 1) // 3 // context)
    with pytest.raises(ValueError, match="read must be one of"):
        evaluate_text(model, tokens, 3, context, None, tb, torch.device("cpu"), read="windows")


def np_where_equal(tokens, row) -> int:
    """The offset of ``row`` in ``tokens`` (the windows' rows are slices of it)."""
    row = row.numpy()
    for s in range(len(tokens) - len(row) + 1):
        if (tokens[s:s + len(row)] == row).all():
            return s
    raise AssertionError("not a slice of the split")
