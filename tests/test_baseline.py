"""The transformer baseline: causal, its generate reads a sliding context, and the trainer, its
resume, the evaluation and the sampler serve it as they serve the CTE."""
import pytest
import torch

from fractus.baseline import Transformer, TransformerConfig
from fractus.evaluate import evaluate_checkpoint
from fractus.registry import load_model
from fractus.train import main, train
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
