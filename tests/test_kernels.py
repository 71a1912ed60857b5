"""The Triton LayerNorm (model.norm='triton') against PyTorch's nn.LayerNorm: forward and gradients.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set per test below; the kernels
are built on first use, so the fixture rebuilds them under it). fp32 tolerance: 1e-5 (the kernel and
PyTorch sum in a different order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import run_cli
from test_model import assert_same_math, batch, build
from tokenmill.errors import ConfigError
from tokenmill.model.kernels import layernorm as K

needs_triton = pytest.mark.skipif(not K.triton_available(), reason="triton is not installed (pip install triton)")


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels in Triton's CPU interpreter for this test (unless on a GPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    K._kernels.cache_clear()
    yield
    K._kernels.cache_clear()


def _ref_and_triton(C: int, bias: bool, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    ref = nn.LayerNorm(C, bias=bias).to(device)
    tri = K.TritonLayerNorm(C, bias=bias).to(device)
    with torch.no_grad():  # weights off their init (1 and 0 would hide affine bugs)
        ref.weight.normal_(1.0, 0.3)
        if bias:
            ref.bias.normal_(0.0, 0.3)
    tri.load_state_dict(ref.state_dict())
    return ref.to(dtype), tri.to(dtype)


def _fwd_bwd(mod: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    mod.zero_grad(set_to_none=True)
    y = mod(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in mod.named_parameters()}


@needs_triton
@pytest.mark.parametrize("shape", [(3, 5, 48), (1, 7, 32), (2, 3, 100)])  # widths below/at/above powers of 2
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_pytorch(interpret, shape, bias):
    ref, tri = _ref_and_triton(shape[-1], bias)
    g = torch.Generator().manual_seed(1)
    x = 3.0 + 2.0 * torch.randn(shape, generator=g)  # off-centre rows: the mean matters
    dy = torch.randn(shape, generator=g)
    y1, dx1, gp1 = _fwd_bwd(ref, x, dy)
    y2, dx2, gp2 = _fwd_bwd(tri, x, dy)
    torch.testing.assert_close(y2, y1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx2, dx1, atol=1e-5, rtol=1e-5)
    assert gp2.keys() == gp1.keys() == ({"weight", "bias"} if bias else {"weight"})
    for n in gp1:
        torch.testing.assert_close(gp2[n], gp1[n], atol=1e-5, rtol=1e-5, msg=n)


@needs_triton
@pytest.mark.skipif(not K._TRITON_OP, reason="torch.library.triton_op needs torch >= 2.6")
def test_both_operator_forms_match_pytorch(interpret):
    """The triton_op form (GPUs) and the custom_op form (the interpreter, torch < 2.6) run the same kernels
    eagerly: both equal nn.LayerNorm, forward and gradients."""
    ref, _ = _ref_and_triton(48, True)
    g = torch.Generator().manual_seed(3)
    x = 1.0 + torch.randn(2, 5, 48, generator=g)
    dy = torch.randn(2, 5, 48, generator=g)
    y1, dx1, gp1 = _fwd_bwd(ref, x, dy)
    for form in (True, False):
        xr = x.clone().requires_grad_(True)
        w, b = (p.detach().clone().requires_grad_(True) for p in (ref.weight, ref.bias))
        y = K.triton_layer_norm(xr, w, b, 1e-5, triton_op=form)
        y.backward(dy)
        for got, want, what in ((y, y1, "y"), (xr.grad, dx1, "dx"), (w.grad, gp1["weight"], "dw"),
                                (b.grad, gp1["bias"], "db")):
            torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5, msg=f"{what} (triton_op={form})")


@needs_triton
def test_bf16_matches_pytorch_bf16(interpret):
    """bf16 in and out, fp32 statistics inside, like PyTorch's kernel: equal up to one bf16 rounding."""
    ref, tri = _ref_and_triton(64, True, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16)
    dy = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16)
    y1, dx1, gp1 = _fwd_bwd(ref, x, dy)
    y2, dx2, gp2 = _fwd_bwd(tri, x, dy)
    assert y2.dtype == dx2.dtype == gp2["weight"].dtype == torch.bfloat16
    torch.testing.assert_close(y2, y1, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(dx2, dx1, atol=2e-2, rtol=1.6e-2)
    for n in gp1:
        torch.testing.assert_close(gp2[n].float(), gp1[n].float(), atol=5e-2, rtol=2e-2, msg=n)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("bias", [True, False])
def test_gpt_with_triton_norm_keeps_the_math(interpret, bias):
    """model.norm='triton' vs 'native' in a whole GPT: same logits, loss and every gradient (fp32)."""
    assert_same_math(build(norm="native", bias=bias), build(norm="triton", bias=bias))


@needs_triton
@pytest.mark.slow
def test_compiled_gpt_keeps_the_triton_norm_in_one_graph(interpret):
    """The kernels are torch.library operators (triton_op on a GPU where torch has it, custom_op under the
    interpreter or on older torch, each with a fake): torch.compile traces a GPT with model.norm='triton' as ONE graph, 0 breaks (the
    autograd.Function it replaced broke the graph at every norm on a GPU, and under the interpreter dynamo
    failed inside the launch). Backend 'eager': the graph dynamo captures, which is where breaks happen
    (Inductor with the triton_op form: the GPU test below)."""
    ref, tri = build(norm="native"), build(norm="triton")
    tri.load_state_dict(ref.state_dict())
    x, y = batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(tri)(x, y)
    assert (explained.graph_break_count, explained.graph_count) == (0, 1), explained.break_reasons
    _, loss = torch.compile(tri, backend="eager", fullgraph=True)(x, y)
    loss.backward()
    _, loss_ref = ref(x, y)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    for (n, p), q in zip(tri.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)


@needs_triton
def test_on_cpu_without_the_interpreter_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = build(norm="triton")
    with pytest.raises(ConfigError, match=r"model\.norm='triton'.*CUDA GPU.*'cpu'.*--model\.norm native"):
        m(torch.zeros(1, 4, dtype=torch.long))


def test_without_triton_is_a_config_error(monkeypatch):
    monkeypatch.setattr(K, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs the triton package.*pip install triton"):
        build(norm="triton")


def test_too_wide_is_a_config_error():
    with pytest.raises(ConfigError, match=r"widths up to 16384"):
        K._block(20000)


@needs_triton
@pytest.mark.slow
def test_cli_reports_the_error_without_a_traceback(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = run_cli("train", "--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64",
                "--train.device", "cpu", "--train.max_steps", "1", "--model.norm", "triton",
                "--run-dir", tmp_path / "run", "--log.progress", "plain")
    assert r.returncode == 2, r.stderr
    assert "tokenmill: config error: model.norm='triton'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not K.triton_available(), reason="needs a CUDA GPU and triton")
def test_on_cuda_matches_native_bf16():
    ref, tri = _ref_and_triton(768, True, torch.bfloat16, "cuda")
    x = torch.randn(8, 1024, 768, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y1, dx1, gp1 = _fwd_bwd(ref, x, dy)
    y2, dx2, gp2 = _fwd_bwd(tri, x, dy)
    torch.testing.assert_close(y2, y1, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(dx2, dx1, atol=2e-2, rtol=1.6e-2)
    for n in gp1:  # summed over 8192 rows in another order: relative L2 error
        assert ((gp2[n].float() - gp1[n].float()).norm() / gp1[n].float().norm()).item() < 1e-2, n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not K.triton_available(), reason="needs a CUDA GPU and triton")
def test_on_cuda_inductor_compiles_the_triton_norm_without_breaks():
    """On a GPU, Inductor compiles the norm's kernels into the model's graph: 0 breaks, the native loss."""
    torch._dynamo.reset()
    ref, tri = build(norm="native").cuda(), build(norm="triton").cuda()
    tri.load_state_dict(ref.state_dict())
    x, y = (t.cuda() for t in batch())
    assert torch._dynamo.explain(tri)(x, y).graph_break_count == 0
    _, loss = torch.compile(tri, fullgraph=True)(x, y)
    loss.backward()
    _, loss_ref = ref(x, y)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, atol=1e-4, rtol=1e-4)
    for (n, p), q in zip(tri.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=n)
