"""Generation: KV cache (same tokens as without it, linear work), top-k, top-p, temperature,
several samples per prompt, inference mode."""

from __future__ import annotations

import pytest
import torch

from tokenmill import config as C
from tokenmill.errors import SampleError
from tokenmill.model import GPT
from tokenmill.model.sampling import sample_next_token

V, BS = 61, 24


def build(**kw) -> GPT:
    """A tiny random GPT; init_std 0.3 gives peaked logits, so that a wrong attention (a mask or a
    cached key off by one) changes the greedy tokens, not only the logits' last digits."""
    torch.manual_seed(0)
    cfg = C.ModelConfig(vocab_size=V, block_size=BS, n_layer=2, n_head=4, n_embd=32, init_std=0.3, **kw)
    return GPT(cfg, V)


def prompt(B=3, T=5, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_greedy_same_with_and_without_kv_cache(attention, fused):
    """30 new tokens from 5: the sequence passes block_size (24), where the cached path hands over
    to whole-window steps; every token matches the uncached generation."""
    m = build(attention=attention, fused_qkv=fused, vocab_pad_multiple=16, dropout=0.1)
    p = prompt()
    cached = m.generate(p, 30, temperature=0.0, use_cache=True)
    plain = m.generate(p, 30, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 35) and torch.equal(cached[:, :5], p)
    assert torch.equal(cached, plain)
    assert m.training  # dropout was off inside generate; the mode is restored
    # the cached logits equal the full forward's at every position (not only their argmax)
    m.eval()
    seq = cached[:, :BS]
    with torch.no_grad():
        full = m(seq)[0]
    from tokenmill.model.gpt import KVCache

    cache = KVCache(m.cfg.n_layer, BS)
    with torch.inference_mode():
        steps = [m._last_logits(seq[:, :4], cache)] + [m._last_logits(seq[:, t : t + 1], cache) for t in range(4, BS)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 3:], atol=1e-5, rtol=1e-5)


def test_sampling_same_with_and_without_kv_cache():
    m = build().eval()
    a = m.generate(prompt(), 15, temperature=0.9, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(3))
    b = m.generate(prompt(), 15, temperature=0.9, top_k=20, top_p=0.9, use_cache=False,
                   generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_kv_cache_makes_work_linear_in_length():
    """Tokens run through the model: with the cache each token once (prompt + new - 1), without it the
    whole growing sequence at every step (quadratic)."""
    m = build().eval()
    seen = []
    m.wte.register_forward_hook(lambda mod, args, out: seen.append(args[0].numel()))
    T, N = 4, 16  # stays within block_size
    m.generate(prompt(B=1, T=T), N, temperature=0.0)
    assert sum(seen) == T + N - 1 and seen[0] == T and set(seen[1:]) == {1}
    seen.clear()
    m.generate(prompt(B=1, T=T), N, temperature=0.0, use_cache=False)
    assert sum(seen) == sum(T + i for i in range(N))


def test_inference_mode_and_checkpoint_wrapped_blocks():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    m = build()
    ref = m.generate(prompt(), 8, temperature=0.0)
    assert torch.is_inference(ref) and not ref.requires_grad
    m.blocks[0] = checkpoint_wrapper(m.blocks[0], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    assert torch.equal(m.generate(prompt(), 8, temperature=0.0), ref)


def test_num_samples():
    m = build().eval()
    p = prompt(B=2)
    out = m.generate(p, 10, temperature=1.0, num_samples=3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (6, 15)
    assert torch.equal(out[:3, :5], p[0].expand(3, 5)) and torch.equal(out[3:, :5], p[1].expand(3, 5))
    assert len({tuple(r) for r in out[:3, 5:].tolist()}) > 1  # the samples of one prompt differ
    again = m.generate(p, 10, temperature=1.0, num_samples=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)  # a seeded generator reproduces them
    greedy = m.generate(p, 10, temperature=0.0, num_samples=2)
    assert torch.equal(greedy[0], greedy[1]) and torch.equal(greedy[0], m.generate(p[:1], 10, temperature=0.0)[0])


def draws(logits, n=4000, **kw) -> torch.Tensor:
    """Counts per id over ``n`` draws from one row of logits."""
    g = torch.Generator().manual_seed(0)
    rows = logits.expand(n, -1)
    ids = sample_next_token(rows, generator=g, **kw)[:, 0]
    return torch.bincount(ids, minlength=logits.size(-1))


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # sorted: id1 .5, id3 .3, id2 .15, id0 .05
    logits = probs.log()
    c = draws(logits, top_p=0.7)  # .5 < .7, .8 >= .7: keep ids 1 and 3
    assert c[0] == 0 and c[2] == 0 and c.sum() == 4000
    assert abs(c[1] / 4000 - 0.5 / 0.8) < 0.03  # renormalised over the nucleus
    assert set(draws(logits, top_p=0.45).nonzero().flatten().tolist()) == {1}  # always the most likely
    assert set(draws(logits, top_p=0.85).nonzero().flatten().tolist()) == {1, 2, 3}
    assert set(draws(logits, top_p=1.0).nonzero().flatten().tolist()) == {0, 1, 2, 3}


def test_top_k_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    assert set(draws(logits, top_k=2).nonzero().flatten().tolist()) == {1, 3}
    assert sample_next_token(logits, temperature=0.0).item() == 1
    assert sample_next_token(logits, top_k=1).item() == 1
    # temperature sharpens (low) or flattens (high) the distribution
    assert draws(logits, temperature=0.3)[1] > draws(logits, temperature=1.0)[1] > draws(logits, temperature=3.0)[1]
    # top-k then top-p: k=3 leaves ids 1, 3, 2 (p .67, .24, .09); the nucleus at 0.8 is ids 1 and 3
    kept = draws(logits, top_k=3, top_p=0.8).nonzero().flatten().tolist()
    assert set(kept) == {1, 3}


@pytest.mark.parametrize("kw,match", [
    ({"top_k": 0}, "top_k must be >= 1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"num_samples": 0}, "num_samples >= 1"),
])
def test_bad_options_are_named(kw, match):
    with pytest.raises(SampleError, match=match):
        build().generate(prompt(), 2, **kw)
