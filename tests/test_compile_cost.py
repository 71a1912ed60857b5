"""What compiling costs, and that the run records it: the chunked loss compiles in a time that does not
grow with its number of chunks (one operator, not a loop unrolled per chunk), and summary.json keeps
``compile_s`` and the whole run's memory peaks (``peak_alloc_mb_run``, ``peak_reserved_mb_run``) beside
the steady ones (a real compiled run's summary.json is checked by tests/test_train.py's compile test, on
the one compiled tiny run, the same config, that both files trained).

Timings are judged as ratios within one process (the same machine load for both), after a first compile
that pays the one-time costs (imports, Dynamo's caches); the compile caches are off for the measured ones.
"""

from __future__ import annotations

import time
from typing import Optional

import pytest
import torch

from test_model import build
from tokenmill.train.metrics import StepMetrics

B, T = 4, 64  # 256 tokens a step


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 50, (B, T), generator=g), torch.randint(0, 50, (B, T), generator=g)


def _compile_seconds(chunks: int, backend: str, count: bool = True) -> tuple[float, float, Optional[int]]:
    """A fresh compile of a tiny GPT with the chunked loss in ``chunks`` chunks: the seconds of its first
    forward + backward (the compile), its loss, and the nodes of the graphs Dynamo captures (None unless
    ``count``: the same graph every time, counted once per chunk count)."""
    torch._dynamo.reset()
    model = build(block_size=T, loss_impl="chunked", loss_chunk_size=B * T // chunks)
    x, y = _batch()
    t0 = time.perf_counter()
    _, loss = torch.compile(model, backend=backend)(x, y)
    loss.backward()
    seconds = time.perf_counter() - t0
    if not count:
        return seconds, loss.item(), None
    torch._dynamo.reset()
    graphs = torch._dynamo.explain(model)(x, y).graphs  # and their subgraphs (an autograd.Function's)
    nodes = sum(len(m.graph.nodes) for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule))
    return seconds, loss.item(), nodes


@pytest.mark.slow
def test_chunked_loss_compile_time_does_not_grow_with_chunks(monkeypatch):
    """64 chunks compile within 2x of 1 chunk (the faster of two alternated tries each) and capture the same graph (the unrolled loop took 4.5x at
    64 chunks here, and grew linearly: 109 s against 24 s at 8 chunks with aot_eager on a loaded CPU).
    aot_eager: Dynamo and AOTAutograd, where the unrolled loop's cost was; Inductor's codegen follows the
    graph's size, which is now the same."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True, raising=False)
    monkeypatch.setattr(torch.compiler.config, "force_disable_caches", True, raising=False)
    _compile_seconds(8, "aot_eager", count=False)  # one-time costs
    runs = {1: [], 64: []}
    for chunks in (1, 64, 1, 64):  # A/B alternated; the faster of two of each (a shared machine's noise)
        runs[chunks].append(_compile_seconds(chunks, "aot_eager", count=not runs[chunks]))
    nodes_one, nodes_many = runs[1][0][2], runs[64][0][2]
    (one, loss_one, _), (many, loss_many, _) = (min(runs[c], key=lambda r: r[0]) for c in (1, 64))
    assert nodes_many == nodes_one  # the deterministic half: the same graph at any chunk count
    assert loss_many == pytest.approx(loss_one, rel=1e-5)
    assert many < 2.0 * one, (runs[1], runs[64])


@pytest.mark.slow
def test_chunked_loss_compiled_keeps_the_gradients():
    """Compiled (one operator with its registered backward) against eager (the autograd.Function): the
    same loss and every gradient, with the head's gradient summed over 8 chunks."""
    x, y = _batch()
    eager = build(block_size=T, loss_impl="chunked", loss_chunk_size=32)
    compiled = build(block_size=T, loss_impl="chunked", loss_chunk_size=32)
    full = build(block_size=T)  # the full cross-entropy: the reference
    for m in (eager, compiled):
        m.load_state_dict(full.state_dict())
    torch._dynamo.reset()
    losses = []
    for m in (full, eager, torch.compile(compiled, backend="aot_eager", fullgraph=True)):
        _, loss = m(x, y)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(losses[2], losses[0], atol=1e-5, rtol=1e-5)
    for (n, p), q, r in zip(full.named_parameters(), eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=n)
        torch.testing.assert_close(r.grad, p.grad, atol=1e-5, rtol=1e-4, msg=n)
    with torch.no_grad():  # evaluation: the operator without gradients, no recompiled loop
        torch.testing.assert_close(torch.compile(compiled, backend="aot_eager")(x, y)[1], losses[0],
                                   atol=1e-5, rtol=1e-5)


def test_summary_keys_without_compile_or_cuda():
    """On a CPU and uncompiled: the whole-run peaks and compile_s are present and None."""
    m = StepMetrics(torch.device("cpu"), 256, 1, 0, 1.0, None)
    out = m.summary({})
    assert out["compile_s"] is None
    assert out["peak_alloc_mb_run"] is None and out["peak_reserved_mb_run"] is None


def test_run_peaks_keep_the_warm_up_peak(monkeypatch):
    """The peaks noted before the reset at the first timed step count in the whole run's, beside the
    steady ones after it; compile_s is the difference of torch's counter over the run."""
    clock = iter([10.0, 12.5])
    monkeypatch.setattr("tokenmill.train.metrics.compile_seconds", lambda: next(clock))
    m = StepMetrics(torch.device("cpu"), 256, 1, 0, 1.0, None, compiled=True)
    m.note_peaks({"peak_alloc_mb": 900.0, "peak_reserved_mb": 1000.0})  # warm-up: compile workspaces
    out = m.summary({"peak_alloc_mb": 700.0, "peak_reserved_mb": 1200.0})  # steady, since the reset
    assert out["peak_alloc_mb_run"] == 900.0 and out["peak_reserved_mb_run"] == 1200.0
    assert out["compile_s"] == 2.5


def test_warm_up_time_leaves_out_the_checkpoints_within_it(monkeypatch):
    """A checkpoint saved during the warm-up steps counts once in the summary: in ``checkpoint_s``, not in
    ``warmup_s`` too (the doctor adds them up against ``wall_s``). A fake clock: 1 s of steps, 3 s of saving."""
    from tokenmill.train import metrics as M

    now = [100.0]
    monkeypatch.setattr(M.time, "perf_counter", lambda: now[0])
    m = StepMetrics(torch.device("cpu"), 256, 2, 0, 1.0, None)
    now[0] += 0.5  # step 1
    with m.outside("checkpoint"):
        now[0] += 3.0
    now[0] += 0.5  # step 2: the first timed step starts here
    m.restart_window(2)
    now[0] += 1.0
    s = m.summary()
    assert s["warmup_s"] == pytest.approx(1.0) and s["checkpoint_s"] == pytest.approx(3.0)
    assert s["wall_s"] == pytest.approx(5.0) and s["warmup_s"] + s["checkpoint_s"] <= s["wall_s"]
