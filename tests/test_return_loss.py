"""``model.return_logits``: the forward returns only the loss, with the same loss and gradients; under
whole-model compile the logits' buffers are saved, which the estimate predicts; an inert row where nothing is
compiled with the loss."""

import dataclasses

import pytest
import torch

from tokenmill import config as C
from tokenmill.config import inert
from tokenmill.model.gpt import GPT

TINY = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 1, "model.n_embd": 32,
        "model.n_head": 2, "model.block_size": 32, "train.batch_size": 4}


def _cfg(**over):
    return C.resolve("gpt2-124m", overrides={**TINY, **over}, overrides_from_string=False)


def _loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pad", [1, 64])  # a padded head slices the logits: the loss alone skips that too
def test_the_loss_alone_equals_the_loss_beside_the_logits(pad):
    cfg = _cfg(**{"model.vocab_pad_multiple": pad, "model.vocab_size": 500})
    torch.manual_seed(0)
    model = GPT(cfg.model, 500)
    x, y = torch.randint(0, 500, (2, 32)), torch.randint(0, 500, (2, 32))
    logits, loss, grads = _loss_and_grads(model, x, y)
    assert logits.shape == (2, 32, 500)
    model.cfg = dataclasses.replace(cfg.model, return_logits=False)
    none, loss_only, grads_only = _loss_and_grads(model, x, y)
    assert none is None
    assert abs(float(loss_only) - float(loss)) <= 1e-6
    assert grads.keys() == grads_only.keys()
    for n, g in grads.items():
        torch.testing.assert_close(grads_only[n], g, rtol=0, atol=1e-6, msg=n)
    with torch.no_grad():  # without targets (generation, eval by logits) the logits still come back
        assert model(x)[0].shape == (2, 32, 500)


def test_the_switch_is_inert_unless_the_loss_is_compiled():
    on = {"compile.enabled": True, "model.return_logits": False}
    assert inert.inert_warnings(_cfg(**on)) == []
    assert inert.inert_warnings(_cfg(**on, **{"compile.scope": "block"})) == []  # the head's own graph
    for other in ({"compile.enabled": False}, {"compile.loss_outside": True},
                  {"compile.scope": "block", "compile.loss_outside": True}, {"model.loss_impl": "chunked"}):
        [line] = inert.inert_warnings(_cfg(**{**on, **other}))
        assert line.startswith("model.return_logits = False does nothing"), line


@pytest.mark.slow  # traces the compiled graphs
def test_the_estimate_saves_the_logits_under_whole_model_compile_only():
    from tokenmill.estimate import estimate

    big = {"model.vocab_size": 4096, "train.batch_size": 8, "model.block_size": 64}
    logits_mib = 8 * 64 * 4096 * 4 / 2**20  # batch x seq x vocab, fp32: the largest buffer of this model
    peak = {(comp, ret): estimate(_cfg(**big, **{"compile.enabled": comp, "model.return_logits": ret}),
                                  "h100-sxm").peak_alloc_mb for comp in (True, False) for ret in (True, False)}
    assert peak[True, True] - peak[True, False] >= 0.8 * logits_mib
    assert peak[False, True] == peak[False, False]  # eager: the trainer drops the logits at once anyway


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_step_keeps_less_memory_without_the_logits():
    """Measured: the peak of a whole-model compiled step, with the loss inside, with and without the logits."""
    from tokenmill.model.build import apply_compile

    def peak(ret: bool) -> int:
        cfg = _cfg(**{"compile.enabled": True, "model.return_logits": ret, "model.vocab_size": 32768,
                      "train.batch_size": 16})
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = apply_compile(GPT(cfg.model, 32768), cfg.compile)
        x = torch.randint(0, 32768, (16, 32), device="cuda")
        model(x, x)[1].backward()  # compiles
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x, x)[1].backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    logits = 16 * 32 * 32768 * 4
    assert peak(True) - peak(False) >= 0.9 * logits
