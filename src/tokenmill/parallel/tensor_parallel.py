"""Tensor parallelism (``parallel.tp``): each block's matrices split over the ranks of the ``tp`` mesh.

Megatron-style, with DTensor's ``parallelize_module``:

- attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each rank computes ``n_head / tp`` whole
  heads), ``c_proj`` row-wise (each rank multiplies its heads' slice; one all-reduce sums them);
- MLP: ``c_fc`` column-wise (a slice of the 4C hidden units, GELU is element-wise), ``c_proj`` row-wise.

So a block costs two all-reduces in forward and two in backward, and its activations inside attention
and the MLP are 1/tp of the full size. The block input and output stay whole (replicated) tensors;
embeddings, LayerNorms and the head are replicated (every TP rank computes them, with identical
gradients). Not done here: sequence parallelism of the norms and a vocabulary-parallel head and loss.

The fused ``[q; k; v]`` matrix is refused (a column split would cut across q, k and v), which is why
``model.fused_qkv=false`` is required; the attention module views its projections as ``(-1, head_dim)``
so that it runs on the local heads.
"""

from __future__ import annotations

from torch import nn

from tokenmill.parallel.world import ParallelError, World


def block_plan() -> dict:
    """``parallelize_module`` plan of one transformer block (module path -> style)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, world: World) -> nn.Module:
    """Split every block of ``model`` over the ``tp`` mesh dimension (in place; tp == 1: unchanged)."""
    if world.tp == 1:
        return model
    cfg = model.cfg
    if cfg.fused_qkv:
        raise ParallelError("parallel.tp > 1 needs --model.fused_qkv false (q, k, v are split by heads).")
    if cfg.n_head % world.tp:
        raise ParallelError(f"model.n_head ({cfg.n_head}) must be divisible by parallel.tp ({world.tp}).")
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = world.mesh["tp"]
    for _, block in model.present_blocks():
        parallelize_module(block, tp_mesh, block_plan())
    return model
