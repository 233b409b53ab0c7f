"""flashedu.gpt: the shipped text, the tokenizer, causality, and the attention swap giving the same
training run."""

from __future__ import annotations

import pytest
import torch

from flashedu import gpt

TINY = dict(block_size=24, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def corpus():
    text = gpt.load_text()
    tok = gpt.CharTokenizer(text)
    return tok, tok.encode(text)


def _model(tok, attention="sdpa", seed=0):
    torch.manual_seed(seed)
    return gpt.GPT(gpt.GPTConfig(vocab_size=tok.vocab_size, **TINY), attention=attention)


def test_shipped_text_is_small_and_round_trips(corpus):
    tok, data = corpus
    text = gpt.load_text()
    assert 2_000 < len(text.encode()) <= 100_000
    assert tok.decode(data) == text and tok.vocab_size == len(set(text))


def test_loss_at_initialisation_is_near_uniform(corpus):
    tok, data = corpus
    model = _model(tok)
    x, y = gpt.get_batch(data, TINY["block_size"], 4, torch.Generator().manual_seed(0))
    logits, loss = model(x, y)
    assert logits.shape == (4, TINY["block_size"], tok.vocab_size)
    assert abs(loss.item() - torch.log(torch.tensor(float(tok.vocab_size))).item()) < 0.05


@pytest.mark.parametrize("attention", ["sdpa", "flashedu"])
def test_attention_is_causal(attention, corpus):
    """Changing the last token must not change any earlier position's logits."""
    tok, data = corpus
    model = _model(tok, attention)
    x = data[: TINY["block_size"]][None].clone()
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % tok.vocab_size
    with torch.no_grad():
        a, b = model(x)[0], model(y)[0]
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


def test_both_attentions_give_the_same_logits_and_gradients(corpus):
    tok, data = corpus
    model = _model(tok).double()
    x, y = gpt.get_batch(data, TINY["block_size"], 3, torch.Generator().manual_seed(1))
    results = []
    for name in ("sdpa", "flashedu"):
        model.zero_grad()
        logits, loss = model.set_attention(name)(x, y)
        loss.backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (la, ga), (lb, gb) = results
    assert (la - lb).abs().max() < 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(ga, gb)) < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_swapping_attention_gives_the_same_losses_over_training(dtype, tol, corpus):
    """Same weights, same batches, three AdamW steps: the losses agree within `tol` (measured:
    ~1e-15 in float64, ~5e-7 in float32)."""
    tok, data = corpus
    losses = gpt.compare_attention(_model(tok).to(dtype), data, steps=3, batch_size=4, seed=2)
    print({k: [f"{x:.6f}" for x in v] for k, v in losses.items()})
    assert losses["sdpa"][-1] < losses["sdpa"][0]
    assert max(abs(a - b) for a, b in zip(losses["sdpa"], losses["flashedu"])) < tol


def test_generate_extends_the_context(corpus):
    tok, data = corpus
    model = _model(tok, "flashedu")
    out = model.generate(data[None, :5], 30, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 35) and torch.equal(out[0, :5], data[:5])


def test_bad_choices_raise(corpus):
    tok, data = corpus
    with pytest.raises(ValueError, match="attention must be one of"):
        _model(tok, "flex")
    with pytest.raises(ValueError, match="exceeds block_size=24"):
        _model(tok)(data[None, :25])
