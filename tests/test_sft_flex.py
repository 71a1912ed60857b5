"""FlexAttention's gradients on the CPU: the block-mask path equals the explicit mask's, loss and every gradient.

torch refuses FlexAttention with gradients on the CPU in its Python entry point (``flex_attention._validate_device``
raises "FlexAttention does not support backward on CPU"), and the model refuses forced 'flex' under gradients there
(tests/test_flex_attention.py). The operator under that guard is not missing a backward: eager, it runs torch's
dense reference (the scores materialised, the block mask's ``mask_mod`` applied to them) with an autograd formula.
These tests lift the two guards, and only them, so the mask the model builds for FlexAttention (block table and
``mask_mod`` from the document starts) carries gradients through the real model: for pretraining's
``data.document_mask`` (end-of-text ids) and for packed chat windows (``data.chat_packing='pack'``: the start bits).
What they do not check is the fused CUDA kernel's own backward (tests/test_flex_attention.py's CUDA tier). Eager
FlexAttention traces its operator with dynamo's eager backend (~3 s a new mask here), hence one preset per test."""

from __future__ import annotations

import warnings

import pytest
import torch

from test_flex_attention import EOT, _models, packed
from test_sft_packing import chat  # noqa: F401  (the packed chat folder fixture)
from tokenmill.model.gpt import GPT


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """Lift torch's CPU-gradient guard and the model's refusal (the mask is built without gradients, as it is
    on CUDA: it holds indices only); the eager reference's unfused-kernel warning is expected."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *tensors: None)
    build, kinds = GPT.document_attention_mask, []

    def without_the_refusal(self, pos, dtype):
        with torch.no_grad():
            mask = build(self, pos, dtype)
        kinds.append("explicit" if isinstance(mask, torch.Tensor) else "flex")
        return mask

    monkeypatch.setattr(GPT, "document_attention_mask", without_the_refusal)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield kinds  # the mask each forward built


def test_torch_guard_is_what_refuses_cpu_gradients():
    """The guard the fixture lifts is torch's, with this message; without it the same call trains (below)."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        flex_attention(q, q, q)


def loss_and_grads(model, x, y):
    _, loss = model(x, y)
    return loss, torch.autograd.grad(loss, [p for p in model.parameters()])


@pytest.mark.slow  # eager FlexAttention traces its operator with dynamo
def test_document_mask_flex_gradients_equal_explicit(cpu_flex_backward, preset="tiny"):
    """data.document_mask, positions restarting (GPT-2: learned positions; the chat test below runs Llama): flex's
    loss within 1e-6 and every gradient within 1e-6 (fp32; gradients up to ~0.2, differences measured at ~5e-8) of
    the explicit (B, 1, T, T) mask's; the block mask is what flex got, and a plain causal model's gradients differ
    by more than 1e-3 (the check can fail)."""
    explicit, flex = _models(preset, True)
    x, y = packed(3, 32, seed=31), packed(3, 32, seed=32)
    assert ((x == EOT)[:, :-1]).any()  # documents end inside the windows
    (loss_e, grads_e), (loss_f, grads_f) = loss_and_grads(explicit, x, y), loss_and_grads(flex, x, y)
    assert cpu_flex_backward == ["explicit", "flex"]
    torch.testing.assert_close(loss_f, loss_e, atol=1e-6, rtol=0)
    names = [n for n, _ in flex.named_parameters()]
    for name, a, b in zip(names, grads_f, grads_e):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    explicit.doc_eot_id = None  # one causal sequence: other gradients
    _, plain = loss_and_grads(explicit, x, y)
    assert max((a - b).abs().max().item() for a, b in zip(plain, grads_f)) > 1e-3


@pytest.mark.slow  # eager FlexAttention traces its operator with dynamo
def test_packed_chat_flex_gradients_equal_explicit_and_one_by_one(cpu_flex_backward, chat,  # noqa: F811 (fixture)
                                                                  preset="tiny-llama"):
    """Llama (RoPE restarting, 4 query heads on 2 key/value heads), data.chat_packing='pack' with model.document_attention='flex' (the block mask from the start bits): the
    packed window's summed loss and gradients equal the explicit mask's (loss rtol 1e-6, gradients atol 1e-5)
    and its conversations padded one by one (loss rtol 1e-5, gradients rtol 1e-4 / atol 1e-5, as
    tests/test_sft_packing.py's explicit check)."""
    from test_sft_packing import packed_and_one_by_one

    flex = packed_and_one_by_one(chat, preset, "cpu", **{"model.document_attention": "flex"})
    assert cpu_flex_backward[0] == "flex"  # the packed model's forward (the padded ones build no mask)
    explicit = packed_and_one_by_one(chat, preset, "cpu")
    assert cpu_flex_backward[-1] == "explicit"
    torch.testing.assert_close(flex["loss"], explicit["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(flex["loss"], flex["ref"], rtol=1e-5, atol=0)
    for a, b, c in zip(flex["grads"], explicit["grads"], flex["ref_grads"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
