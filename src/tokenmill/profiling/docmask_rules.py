"""Doctor rule for document masking (``data.document_mask``): what keeping documents apart costs a CUDA run.

With the switch on, the model hands SDPA an explicit (B, 1, T, T) mask (:func:`tokenmill.model.layers.document_mask`),
which the flash kernel does not take: PyTorch runs the memory-efficient kernel instead, which knows nothing of
the causal structure, so it computes every tile of the T x T scores (twice the causal half flash computes) and
reads the mask in the forward and the backward; the mask itself is held through each step. That is the explicit
path (``model.document_attention='explicit'``, or 'auto' while training with dropout; a run recorded before the
field existed ran it too); FlexAttention's block mask keeps the causal skip and needs no mask. The rule asks the
estimator (``estimate/techniques.py``'s term) for the run's config on the explicit path and with FlexAttention, on
the run's GPU, reports the difference when it is a visible share of the step, and names the switch.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

from tokenmill.profiling.facts import Run
from tokenmill.profiling.findings import Finding, _clamp, advice, cfg, pct, switch
from tokenmill.profiling.technique_rules import _estimate

VISIBLE = 0.02  # an estimated cost below this share of the step is not worth a finding


@functools.lru_cache(maxsize=8)
def _with_and_without(key: str) -> tuple:
    """The estimates of the run (``key``: its config, GPU, memory and processes, as JSON) on the explicit path and
    with FlexAttention; kept, as the doctor may ask about one run more than once."""
    config, gpu_name, total, world = json.loads(key)
    run = Run.of({"config": config, "gpu_name": gpu_name, "device_total_mb": total, "world_size": world})
    return (_estimate(run, {"model.document_attention": "explicit"}),
            _estimate(run, {"model.document_attention": "flex"}))


def _explicit_on_cuda(f: dict) -> bool:
    """The run kept documents apart with the explicit mask on a CUDA GPU (SDPA): 'explicit', or 'auto' with
    dropout; a config without the field predates FlexAttention's path and ran the explicit one."""
    if not cfg(f, "data.document_mask") or cfg(f, "model.attention") != "sdpa" or f.get("device") != "cuda":
        return False
    impl = f["config"].get("model.document_attention", "explicit")
    return impl == "explicit" or (impl == "auto" and (cfg(f, "model.dropout") or 0) > 0)


def document_mask_cost(f: dict) -> Optional[Finding]:
    """``data.document_mask`` on the explicit path with SDPA on a CUDA GPU: the non-flash kernel over the whole
    T x T, and the mask; FlexAttention (``model.document_attention``) avoids both."""
    if not _explicit_on_cuda(f):
        return None
    on, fx = _with_and_without(json.dumps([f["config"], f.get("gpu_name"), f.get("device_total_mb"),
                                            f.get("world_size")], sort_keys=True, default=str))
    if on is None or fx is None:
        return None
    share = (on.step_ms - fx.step_ms) / on.step_ms if on.step_ms > 0 else 0.0
    if share < VISIBLE:
        return None
    B, T = cfg(f, "train.batch_size"), cfg(f, "model.block_size")
    mask_mb = on.peak_alloc_mb - fx.peak_alloc_mb
    ev = ["data.document_mask = true with the explicit mask on a CUDA GPU: the (batch, 1, T, T) mask rules out the flash "
          "kernel; the memory-efficient kernel that takes it computes the whole T x T scores (twice the causal half) "
          "and reads the mask in the forward and the backward",
          f"estimated at batch {B}, T = {T}: {on.step_ms - fx.step_ms:.1f} ms of {on.step_ms:.1f} ms per step "
          f"({pct(share)}), and {mask_mb:.0f} MB more at the peak (the mask, held through each step; with grouped "
          "key/value heads also their copies per query head, which that kernel needs)"]
    dropout = (cfg(f, "model.dropout") or 0) > 0
    flex = "FlexAttention keeps the documents apart with a block mask: no T x T mask, the causal half only"
    sug = [switch("model.document_attention", "auto", flex + (" ('auto' needs no attention dropout)" if dropout else ""),
                  also={"model.dropout": 0.0} if dropout else None),
           switch("data.document_mask", False, "attention crosses document boundaries (as GPT-2 and nanoGPT "
                  "train) and the flash kernel comes back; compare the validation loss",
                  also={"data.document_positions": False} if cfg(f, "data.document_positions") else None),
           advice("documents much longer than model.block_size put a boundary in few windows, where the mask "
                  "changes little; the cost grows with T^2 (a shorter model.block_size shrinks it)")]
    return Finding(_clamp(share), "document masking runs attention without the flash kernel", ev, sug)
