"""A compiled block checkpointed with an op policy (``memory.activation_checkpointing_policy='save-matmuls'`` under
``compile.enabled``): the estimator captures it as torch.compile does (``estimate/compiled.py selective``: the
checkpoint's policy tags the joint graph, the min-cut partitioner saves what it must save), so what it keeps for
backward is what a real compiled block keeps, measured on the CPU, and less than the same block run eagerly."""

import copy

import pytest
import torch

from tokenmill import config as C
from tokenmill.estimate import trace as T
from tokenmill.estimate.timeline import _saved
from tokenmill.model.build import apply_activation_checkpointing, build_gpt

V = 256
OVER = {"data.source": "synthetic", "model.vocab_size": V, "model.n_layer": 1, "model.n_embd": 64, "model.n_head": 2,
        "model.block_size": 32, "train.batch_size": 2, "train.device": "cpu", "train.precision": "fp32",
        "memory.activation_checkpointing": 1, "memory.activation_checkpointing_policy": "save-matmuls"}


def _estimated_saved(cfg: C.Config) -> int:
    """Bytes the traced block holds from its forward to its backward (not its input: the harness's)."""
    p = T.trace_pieces(cfg, V, "cpu")
    tr = p.blocks["checkpointed"]
    rnd = tr.rounds[0]
    return sum(tr.sizes[s] for s in _saved(rnd.fwd, {rnd.x, rnd.y}))


def _measured_saved(cfg: C.Config, compiled: bool) -> int:
    """Bytes a real block (the trainer's checkpoint wrapper, compiled as ``compile.scope='block'`` compiles it)
    still holds at the end of its forward on the CPU, from the profiler's allocation events, less its output."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = build_gpt(cfg.model, V, "cpu")
    apply_activation_checkpointing(model, 1, cfg.memory.activation_checkpointing_policy)
    model.train()
    block = model.blocks[0]
    if compiled:
        block.compile()
    x = torch.randn(2, 32, 64, requires_grad=True)
    try:
        block(x, None).sum().backward()  # compiles (once)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = block(x, None)
    finally:
        torch._dynamo.reset()  # no compiled code left for later tests
    net = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    if net == 0:
        pytest.skip("this PyTorch's profiler reports no CPU memory events")
    y.sum().backward()  # the saved tensors were real: backward runs
    return net - y.numel() * y.element_size()


@pytest.mark.slow
def test_compiled_selective_checkpoint_keeps_what_torch_compile_keeps():
    T.CACHE_SIZE, size = 0, T.CACHE_SIZE
    try:
        cfg = C.resolve(None, overrides={**OVER, "compile.enabled": True, "compile.scope": "block"},
                        overrides_from_string=False)
        eager_cfg = C.apply_overrides(copy.deepcopy(cfg), {"compile.enabled": False})
        assert "block" in T.compiled_pieces(cfg)
        compiled_est, eager_est = _estimated_saved(cfg), _estimated_saved(eager_cfg)
    finally:
        T.CACHE_SIZE = size
    measured = _measured_saved(cfg, compiled=True)
    # tolerance 1%: below the smallest activation the block saves but its (B, H, T) log-sum-exp (512 bytes here)
    assert abs(compiled_est / measured - 1) <= 0.01, (compiled_est, measured)
    # eagerly the policy's cache keeps every product's output until the recomputation reads it, compiled the
    # partitioner keeps only what backward reads: torch's compiled block keeps less, so does the estimate
    measured_eager = _measured_saved(eager_cfg, compiled=False)
    assert measured < measured_eager and compiled_est < eager_est, (measured, measured_eager, compiled_est, eager_est)
