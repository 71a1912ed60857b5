"""Doctor rule for FP8 matmuls (``train.fp8``): enabled where it cannot pay (see :mod:`tokenmill.model.fp8`).

FP8 pays where the matmuls are large enough that running them at twice the bf16 rate saves more than the
casts cost (an amax and a cast of each input, weight and output gradient, extra memory traffic), on a GPU
with FP8 tensor cores, with torch.compile fusing the casts. The rule models the speed-up of the block's
converted linears from the GPU's datasheet bf16 rate and memory bandwidth
(:func:`~tokenmill.model.fp8.fp8_speedup`) and names what stands in the way.
"""

from __future__ import annotations

from typing import Optional

from tokenmill.errors import ConfigError
from tokenmill.model.flops import peak_flops
from tokenmill.model.fp8 import block_linear_shapes, fp8_speedup, has_fp8
from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import Finding, _clamp, switch

# a modelled speed-up of the matmuls below this does not pay: the model leaves out the amax reductions'
# synchronisation and the scales' bookkeeping, and matmuls are only part of the step
PAYS = 1.1


@typed
def block_shapes(run: Run) -> list[tuple[int, int]]:
    """``(in, out)`` of the block linears FP8 converts, from the run's config (its own derived sizes)."""
    m = run.config.model
    return block_linear_shapes(m)


@typed
def fp8_cannot_pay(run: Run) -> Optional[Finding]:
    recipe = run.config.train.fp8
    if recipe == "off":
        return None
    name, cap = run.gpu_name, run.gpu_capability
    compiled = bool(run.config.compile.enabled)
    ev, sug = [f"train.fp8 = {recipe}: the block linears run their matmuls in float8 (torchao)"], []
    no_fp8 = run.device != "cuda" or (cap and cap < (8, 9)) or (name and not has_fp8(name))
    if no_fp8:
        ev.append(f"{name or run.device or 'this device'} has no FP8 tensor cores (compute capability 8.9 or "
                  "newer: H100, H200, L4, L40S, RTX 4090): FP8 cannot speed it up")
        return Finding(0.6, "FP8 matmuls on a GPU without FP8", ev,
                       [switch("train.fp8", "off", "bf16 matmuls: what this GPU runs fastest")])
    shapes = block_shapes(run)
    speed = _modelled_speedup(name, shapes, compiled) if shapes else None
    if speed is not None:
        ev.append(f"block linears of {min(min(s) for s in shapes)} to {max(max(s) for s in shapes)} features: "
                  f"modelled matmul speed-up with FP8 {speed:.2f}x ({'compiled' if compiled else 'eager'}; from "
                  f"{name}'s bf16 rate and memory bandwidth: twice the rate, less the casts' memory traffic)")
    if not compiled:
        ev.append("torch.compile is off: every amax and cast is its own kernel reading and writing whole tensors")
        sug.append(switch("compile.enabled", True, "fuse the FP8 casts into the neighbouring kernels"))
    if speed is not None and speed >= PAYS and compiled:
        return None
    small = speed is not None and speed < PAYS
    sug.append(switch("train.fp8", "off", f"bf16 matmuls: at these sizes FP8 gains little or loses (modelled "
                      f"{speed:.2f}x)" if small else "bf16 matmuls"))
    score = 0.15 + 0.5 * max(0.0, 1.0 - speed) if speed is not None else 0.2
    return Finding(_clamp(score + (0.1 if not compiled else 0.0)),
                   "FP8 matmuls that cannot pay: " + ("matrices too small" if speed is not None and speed < PAYS
                                                     else "eager casts"), ev, sug)


def _modelled_speedup(name: str, shapes: list[tuple[int, int]], compiled: bool) -> Optional[float]:
    from tokenmill.estimate.bandwidth import streaming_bandwidth
    from tokenmill.estimate.gpus import gpu_spec

    flops = peak_flops(name, "bf16") if name else None
    try:  # the casts stream: the bandwidth the estimator prices them at
        bandwidth = streaming_bandwidth(gpu_spec(name)) if name else None
    except ConfigError:  # a GPU the estimator does not know: no model, only the other reasons
        bandwidth = None
    return fp8_speedup(shapes, flops, bandwidth, compiled) if flops and bandwidth else None
