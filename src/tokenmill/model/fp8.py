"""FP8 matmuls (``train.fp8``): torchao's float8 training applied to the blocks' linear layers.

:func:`apply_fp8` swaps each block ``nn.Linear`` whose two sizes are multiples of 16 (what FP8 tensor
cores take) for torchao's ``Float8Linear``: at every forward its input and weight, and in backward the
output gradient, are cast to float8 (e4m3; e5m2 for tensorwise gradients) with dynamic scales, one per
tensor (``'tensorwise'``) or one per row (``'rowwise'``), and multiplied by ``torch._scaled_mm`` with
fp32 accumulation. The parameters stay what they were (their dtype, names and state-dict layout), so
checkpoints are interchangeable with runs without FP8. Embeddings and the head stay in their precision
(torchtitan leaves the output projection out too: it is the most sensitive to rounding).

Where it pays: FP8 tensor cores (compute capability 8.9 and 9.0: Ada and Hopper, i.e. L4, L40S, RTX 4090,
H100, H200) multiply at twice their bf16 rate (datasheets, dense, fp32 accumulation: H100 SXM 1979 vs
989 TFLOPS, L4 242.5 vs 121, RTX 4090 330 vs 165); A100 and older have none, and torchao refuses. The
casts are extra memory traffic (an amax reduction and a cast of each input, weight and output gradient),
which ``torch.compile`` fuses into neighbouring kernels: eager FP8, and FP8 on small matmuls, is often
slower than bf16 (the doctor says so). Saved activations do not shrink: torchao keeps the
high-precision input and weight for backward and casts them again.

Under FSDP2, ``train.fp8_all_gather`` makes the sharded weights all-gather in float8 (torchao's
``enable_fsdp_float8_all_gather``; tensorwise only): half the bytes of bf16.

Off CUDA the switch is refused; the tests run torchao's emulation mode (``emulate=True``: the same
casts and scales, the product computed in high precision) on the CPU.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tokenmill import config as C
from tokenmill.config.matrices import Matrix, block_matrices
from tokenmill.errors import ConfigError
from tokenmill.model.flops import peak_flops
from tokenmill.model.gpus import gpu_facts
from tokenmill.model.nf4 import torchao_quietly

FP8_ALIGN = 16  # torch._scaled_mm needs both sizes of the weight to be multiples of 16
FP8_MIN_CAPABILITY = (8, 9)


def has_fp8(device_name: str) -> bool:
    """Whether the GPU named ``device_name`` (``torch.cuda.get_device_name()``) has FP8 tensor cores: its row
    of the one GPU table (``model/gpus.py``), the row MFU's peak and the estimator read."""
    row = gpu_facts(device_name)
    return row is not None and row.fp8


def fp8_peak_flops(device_name: str) -> float | None:
    """Dense FP8 tensor-core peak (fp32 accumulation) of ``device_name``: twice its bf16 peak on the GPUs
    that have FP8 (the datasheets' ratio on Ada and Hopper), None on the others (A100: no FP8) or when the
    bf16 peak is unknown."""
    bf16 = peak_flops(device_name, "bf16")
    return 2.0 * bf16 if bf16 and has_fp8(device_name) else None


# Cast traffic of a converted matmul, in bytes per (FLOPs / 2 / its smallest size), i.e. per element of its
# token-sized operand: each of a linear's three matmuls (forward, input gradient, weight gradient) casts
# about 4/3 such operands (the input, the output gradient, and for the weight gradient their transposes),
# each cast an amax read (2 bytes), a read (2) and an fp8 write (1) in eager PyTorch. Compiled, the amax and
# the cast fuse into the kernels that produce the operand: about half (COMPILED_CASTS).
CAST_BYTES = 5 * 4 / 3
COMPILED_CASTS = 0.5


def fp8_matmul_seconds(bf16_seconds: float, flops: float, min_dim: int, bytes_per_s: float, compiled: bool) -> float:
    """A block matmul's time with FP8: half its bf16 time (twice the tensor-core rate) plus its casts' memory
    traffic (:data:`CAST_BYTES` per element of its token-sized operand)."""
    cast = CAST_BYTES * flops / (2.0 * max(1, min_dim)) * (COMPILED_CASTS if compiled else 1.0)
    return bf16_seconds / 2.0 + cast / bytes_per_s


def fp8_matrix(x: Matrix) -> bool:
    """Whether ``apply_fp8`` converts this block matrix (:func:`fp8_linear` on the built module)."""
    return x.linear and x.shape[0] % FP8_ALIGN == 0 and x.shape[1] % FP8_ALIGN == 0


def block_linear_shapes(cfg: C.ModelConfig) -> list[tuple[int, int]]:
    """``(in, out)`` of one (dense) block's linears that FP8 converts, from the block's matrices
    (``config/matrices.py``): the estimator and the doctor predict FP8's speed-up from them."""
    return [(x.shape[1], x.shape[0]) for x in block_matrices(cfg) if fp8_matrix(x)]


def linear_shapes(n_embd: int, n_head: int, head_width: int, kv_heads: int, mlp: str, mlp_width: int,
                  fused_qkv: bool) -> list[tuple[int, int]]:
    """:func:`block_linear_shapes` of a model of these sizes."""
    return block_linear_shapes(C.ModelConfig(n_embd=n_embd, n_head=n_head, head_dim=head_width, n_kv_head=kv_heads,
                                             mlp=mlp, intermediate_size=mlp_width, fused_qkv=fused_qkv))


def fp8_speedup(shapes: list[tuple[int, int]], bf16_flops_per_s: float, bytes_per_s: float, compiled: bool) -> float:
    """Modelled speed-up with FP8 over bf16 of the matmuls of linears of ``shapes`` (``(in, out)``; many
    tokens) on a GPU of that bf16 rate and memory bandwidth: below 1, the casts cost more than the faster
    products save. Per token, a linear's three matmuls take ``6 in out / rate`` in bf16, half that in FP8,
    plus its casts: ``2 (in + out)`` elements (input and output gradient, and their transposes for the
    weight gradient) of :data:`CAST_BYTES` x 3/4 bytes each. A square ``d`` x ``d`` linear breaks even at
    ``d = 20/3 x rate / bandwidth`` (x 0.5 compiled): about 2000 on an H100 eager, 1000 compiled;
    torchtitan's 28% on Llama 3.1 8B (width 4096, compiled) is well above it."""
    bf16 = sum(6.0 * i * o for i, o in shapes) / bf16_flops_per_s
    casts = sum(2.0 * (i + o) * CAST_BYTES * 0.75 for i, o in shapes) * (COMPILED_CASTS if compiled else 1.0)
    return bf16 / (bf16 / 2.0 + casts / bytes_per_s)


def fp8_weight(fqn: str, shape: tuple) -> bool:
    """Whether a Linear named ``fqn`` whose weight has this ``(out, in)`` shape is one ``apply_fp8`` converts:
    inside the blocks, both sizes multiples of 16, not a mixture of experts' router or shared-expert gate
    (routing stays in high precision, as do the routed experts: stacked 3-D weights, not Linears). The estimator
    reads it by parameter name (:func:`tokenmill.estimate.fsdp.gathered_size`)."""
    return (fqn.startswith("blocks.") and not fqn.endswith((".router", ".shared_gate")) and len(shape) == 2
            and shape[0] % FP8_ALIGN == 0 and shape[1] % FP8_ALIGN == 0)


def fp8_linear(fqn: str, module: nn.Module) -> bool:
    """Whether ``apply_fp8`` converts this module: a Linear whose name and weight pass :func:`fp8_weight`."""
    return type(module) is nn.Linear and fp8_weight(fqn, tuple(module.weight.shape))


def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers ``train.fp8`` converts, by name (the estimator and the doctor count them)."""
    return [(n, m) for n, m in model.named_modules() if fp8_linear(n, m)]


def check_fp8(cfg: C.TrainConfig, parallel: C.ParallelConfig, device: torch.device) -> None:
    """Refuse ``train.fp8`` where it cannot run, with the reason and the fix."""
    if cfg.fp8 == "off":
        if cfg.fp8_all_gather:
            raise ConfigError("train.fp8_all_gather needs train.fp8 = 'tensorwise'.")
        return
    if cfg.fp8_all_gather and (cfg.fp8 != "tensorwise" or parallel.dp_shard == 1):
        raise ConfigError("train.fp8_all_gather is an FSDP2 option of train.fp8 = 'tensorwise': it needs "
                          "--train.fp8 tensorwise and --parallel.dp_shard > 1.")
    if parallel.tp > 1:
        raise ConfigError("train.fp8 with parallel.tp > 1 is not supported (the tensor-parallel plan would need "
                          "torchao's float8 parallel styles); use FSDP (parallel.dp_shard) or --train.fp8 off.")
    if device.type != "cuda":
        raise ConfigError(f"train.fp8 = '{cfg.fp8}' needs a CUDA GPU with FP8 tensor cores (compute capability "
                          f"8.9 or newer: H100, H200, L4, L40S, RTX 4090); this run is on {device.type}. "
                          "Use --train.fp8 off.")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        raise ConfigError(f"train.fp8 needs FP8 tensor cores (compute capability 8.9 or newer); "
                          f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]} (an A100 has none: FP8 "
                          "cannot speed it up). Use --train.fp8 off.")


def fp8_config(cfg: C.TrainConfig, emulate: bool = False):
    """torchao's ``Float8LinearConfig`` for ``train.fp8`` (and ``train.fp8_all_gather``)."""
    try:
        with torchao_quietly():
            from torchao.float8 import Float8LinearConfig
    except ImportError as e:
        raise ConfigError(f"train.fp8 needs torchao's float8 training, which could not be imported ({e}): "
                          "`pip install torchao`, or use --train.fp8 off.") from None
    config = Float8LinearConfig.from_recipe_name(cfg.fp8)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=cfg.fp8_all_gather)


def apply_fp8(model: nn.Module, cfg: C.TrainConfig, parallel: C.ParallelConfig, device: torch.device,
              emulate: bool = False) -> nn.Module:
    """``train.fp8``: convert the block linears (:func:`fp8_linear`) to ``Float8Linear`` in place; off:
    nothing. ``emulate`` (tests, any device): torchao's emulation, the same casts computed without FP8
    hardware. Refusals: :func:`check_fp8`."""
    if cfg.fp8 == "off" or not emulate:
        check_fp8(cfg, parallel, device)
    if cfg.fp8 == "off":
        return model
    config = fp8_config(cfg, emulate)
    from torchao.float8 import convert_to_float8_training

    if not fp8_linears(model):
        raise ConfigError("train.fp8: no linear layer of this model has sizes that are multiples of 16 "
                          "(FP8 tensor cores need them); use --train.fp8 off.")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fp8_linear(fqn, m))
    return model
