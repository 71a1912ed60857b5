"""Doctor rules about the model's forms: hand-written layers, the attention kernel, fp32 matmuls without
tensor cores, and eager launches where torch.compile would fuse them (see :mod:`rules`). Each takes the typed
run (:class:`~tokenmill.profiling.facts.Run`)."""

from __future__ import annotations

from typing import Optional

from tokenmill import config as C
from tokenmill.config.memory_switches import getter
from tokenmill.model.gpus import gpu_facts
from tokenmill.profiling.facts import Run, as_config, typed
from tokenmill.profiling.findings import Finding, _clamp, pct, switch

LAYER_FORMS = {  # config field -> (slow value, fast value, what the slow form is)
    "model.norm": ("manual", "native", "hand-written LayerNorm (mean, variance, rsqrt, affine as separate ops)"),
    "model.gelu": ("manual", "native", "hand-written tanh-GELU (the formula as separate element-wise ops)"),
    "model.fused_qkv": (False, True, "separate q, k and v projections (three matrix products instead of one)"),
}
RMSNORM_FORM = "hand-written RMSNorm (square, mean, rsqrt and scale as separate ops)"


def slow_forms(config: C.Config | dict) -> list[str]:
    """The fields of :data:`LAYER_FORMS` a run's config (typed, or flat) has in their slow form and could
    switch: the GELU only where the MLP has one (SwiGLU's SiLU is always the native function), separate q/k/v
    only without tensor parallelism (which splits the three projections by heads)."""
    config = as_config(config)
    get = getter(config)
    slow = [k for k, (bad, _fast, _what) in LAYER_FORMS.items() if get(k) == bad]
    if config.model.mlp != "gelu" and "model.gelu" in slow:
        slow.remove("model.gelu")
    if config.parallel.tp > 1 and "model.fused_qkv" in slow:
        slow.remove("model.fused_qkv")
    return slow


def form_what(config: C.Config | dict, key: str) -> tuple[str, str]:
    """(what the slow form of ``key`` is, what its fast form does) for this run's model family."""
    config = as_config(config)
    if key == "model.norm":
        if config.model.norm_type == "rmsnorm":  # no Triton RMSNorm: native is the fast form
            return RMSNORM_FORM, "nn.RMSNorm: torch's fused rms_norm kernels on CUDA"
        return LAYER_FORMS[key][2], "the fused native kernel"
    if key == "model.gelu":
        return LAYER_FORMS[key][2], "the fused native kernel"
    heads, kv = config.model.n_head, config.model.kv_heads
    what = LAYER_FORMS[key][2]
    if kv < heads:  # grouped-query attention: k and v are narrower than q
        what += f"; {heads} query and {kv} key/value heads"
    return what, f"one [q; k; v] matrix product ({heads} + {kv} + {kv} heads)"


@typed
def layer_forms(run: Run) -> Optional[Finding]:
    """Hand-written norms / GELU and separate q/k/v: many small operators where one would do.
    Their cost: the extra operators' fraction of the model's operators other than matrix products
    (counted on the model's own layers, as the run's device runs them), times the time forward +
    backward spend outside matrix products (the matmul share measured by the profile: kernels on CUDA,
    host operators on CPU). A form that adds no operator on this device (a hand-written RMSNorm on a
    CPU, where nn.RMSNorm runs the same operators) is not named."""
    counts = run.layer_forms  # operators counted on the model (layer_ops.py), per field (facts.FormOps)
    slow = [k for k in slow_forms(run.config) if k not in counts or counts[k].extra > 0]
    if not slow:
        return None
    forms = {k: form_what(run.config, k) for k in slow}
    ev = [f"{k} = {str(getter(run.config)(k)).lower()}: {forms[k][0]}" for k in slow]
    fb = (run.timing.forward_share or 0.0) + (run.timing.backward_share or 0.0)
    mm = run.kernels.gemm_share if run.device == "cuda" else run.kernels.host_matmul_share
    share = None
    if fb and all(k in counts for k in slow):
        c = counts[slow[0]]
        extra, other = sum(counts[k].extra for k in slow), max(1, c.total - c.matmul)
        rest = fb * (1.0 - (mm or 0.0))
        share = extra / other * rest
        ev.append(f"{extra} of the {other} operators other than matrix products in a forward + backward "
                  f"({pct(extra / other)}) are these forms' extra ones (counted on the model's own layers)")
        ev.append(f"forward + backward outside matrix products: {pct(rest)} of the step"
                  + (f" (matrix products {pct(mm)} of the operators' time)" if mm is not None else
                     " (no profile: matrix products not told apart)") + f"; so about {pct(share)} of the step")
    else:
        ev.append("their share of the step is unknown (no forward/backward split, or the model could not be "
                  "built here to count its operators)")
    sug = [switch(k, LAYER_FORMS[k][1], forms[k][1]) for k in slow]
    score = 0.9 * share if share is not None else 0.05
    return Finding(_clamp(score), "hand-written layers: " + ", ".join(k.split(".")[1] for k in slow)
                   + " as many small operators", ev, sug)


LAUNCH_US = 5.0  # host time to launch one CUDA kernel (eager PyTorch), roughly


@typed
def compile_off(run: Run) -> Optional[Finding]:
    """CUDA, torch.compile off, the GPU idle between short kernels and the launches alone filling a
    good part of the step: fusing them (fewer kernels) is the fix, more than a larger batch."""
    k = run.kernels
    if run.device != "cuda" or run.config.compile.enabled or k.device_busy_fraction is None:
        return None
    idle = max(0.0, k.idle_not_data(run.data) - (k.logging_share or 0.0))
    kernels, mean_us, step = k.kernels_per_step or 0.0, k.mean_kernel_us or 0.0, run.timing.step_ms
    launch_ms = kernels * LAUNCH_US / 1000
    if idle < 0.3 or mean_us >= 50.0 or not step or launch_ms < 0.3 * step:
        return None
    ev = [f"torch.compile is off; the GPU is idle {pct(idle)} of the step while the host is not waiting for data",
          f"{kernels:,.0f} kernels per step of {mean_us:.1f} us on average: launching them alone takes about "
          f"{launch_ms:.1f} ms of the {step:.1f} ms step (~{LAUNCH_US:g} us each)"]
    sug = [switch("compile.enabled", True, "fuse the element-wise operators: fewer, longer kernels"),
           switch("compile.enabled", True, "and CUDA graphs: one launch for the whole step",
                  also={"compile.mode": "reduce-overhead"})]
    return Finding(_clamp(0.85 * idle), "launch-bound with torch.compile off", ev, sug)


def has_tensor_cores(capability: Optional[tuple[int, ...]], gpu_name: str) -> bool:
    """bf16/TF32 tensor cores: compute capability 8.0 or newer, or, with no capability recorded, the GPU's row of
    the one GPU table (:func:`tokenmill.model.gpus.gpu_facts`; a MIG slice has its GPU's tensor cores)."""
    if capability:
        return capability[0] >= 8
    row = gpu_facts(gpu_name, mig=True)
    return row is not None and row.tensor_cores


@typed
def fp32_math(run: Run) -> Optional[Finding]:
    t = run.config.train
    if run.device != "cuda" or t.precision != "fp32" or t.tf32:
        return None
    if not has_tensor_cores(run.gpu_capability, run.gpu_name):
        return None
    gemm = run.kernels.gemm_share
    ev = [f"train.precision = fp32 with train.tf32 = false on {run.gpu_name or 'a tensor-core GPU'}"]
    if gemm is not None:
        ev.append(f"matmul kernels take {pct(gemm)} of device time, on the slow non-tensor-core fp32 path")
    if run.work.mfu is not None:
        ev.append(f"MFU {pct(run.work.mfu)}")
    score = 0.5 * gemm if gemm is not None else 0.35
    sug = [switch("train.precision", "bf16-autocast", "bf16 tensor cores, half-size activations"),
           switch("train.tf32", True, "TF32 tensor cores for fp32 matmuls (about 2x on A100 in the README ladder)")]
    return Finding(_clamp(score), "fp32 math on a tensor-core GPU", ev, sug)


@typed
def attention(run: Run) -> Optional[Finding]:
    m, k = run.config.model, run.kernels
    kind, backend = m.attention, m.sdpa_backend
    if kind != "manual" and backend != "math":
        return None
    # the larger of the measured attention regions' share (forward; they include the projections, which
    # roughly offsets the backward they miss) and twice the FLOP share (the T x T matrix costs traffic)
    share = max(k.attn_share or 0.0, 2.0 * (k.attention_flop_share or 0.0))
    what = "model.attention = manual" if kind == "manual" else "model.sdpa_backend = math"
    ev = [f"{what}: the T x T attention matrix is materialised (memory traffic and memory)"]
    if k.attn_share is not None:
        ev.append(f"attention regions take {pct(k.attn_share)} of the step (forward only)")
    elif k.attention_flop_share:
        ev.append(f"attention is {pct(k.attention_flop_share)} of the model FLOPs at block_size {m.block_size}")
    heads, kv = m.n_head, m.kv_heads
    if kind == "manual" and kv < heads:
        ev.append(f"grouped-query attention: the {kv} key/value heads are copied to all {heads} query heads in "
                  "every block's forward (repeat_interleave), which SDPA's enable_gqa does not do")
    sug = [switch("model.attention", "sdpa", "scaled_dot_product_attention: flash / memory-efficient kernels"
                  + (", grouped heads without copies" if kv < heads else ""))
           if kind == "manual" else switch("model.sdpa_backend", "auto", "let PyTorch pick a fused kernel")]
    if kind == "manual" and m.causal_mask == "on_the_fly":
        n_layer = m.n_layer
        ev.append(f"model.causal_mask = on_the_fly: a T x T mask is built in each of the {n_layer} blocks' "
                  "forward (and recompute)")
        sug.append(switch("model.causal_mask", "buffer", "if attention stays manual: build the mask once, as a "
                          "buffer"))
    if run.device == "cuda" and run.config.train.precision == "fp32":
        sug.append(switch("train.precision", "bf16-autocast", "flash attention needs bf16/fp16"))
    return Finding(_clamp(share, lo=0.08, hi=0.6), "attention not on a fused kernel", ev, sug)
