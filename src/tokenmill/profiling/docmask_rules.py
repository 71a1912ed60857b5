"""Doctor rule for keeping documents apart (``data.document_mask``, or packed chat windows: ``data.chat_packing =
'pack'``): what the explicit mask costs a CUDA run.

On the explicit path the model hands SDPA a (B, 1, T, T) mask (:func:`tokenmill.model.layers.document_mask`),
which the flash kernel does not take: PyTorch runs the memory-efficient kernel instead, which knows nothing of
the causal structure, so it computes every tile of the T x T scores (twice the causal half flash computes) and
reads the mask in the forward and the backward; the mask itself is held through each step. That is the explicit
path (``model.document_attention='explicit'``, or 'auto' while training with dropout; a run recorded before the
field existed ran it too); FlexAttention's block mask keeps the causal skip and needs no T x T mask. Packed chat
windows are kept apart the same way (from the ids' sequence-start bits, positions restarting), so they pay the
same; their other way out is padding (``data.chat_packing='pad'``: no mask, but padded positions).

The rule reads the typed run (:class:`~tokenmill.profiling.facts.Run`), asks the estimator
(``estimate/techniques.py``'s term) for the run's config on the explicit path and with FlexAttention, on the run's
GPU (a packed chat run is estimated as ``data.document_mask`` with positions restarting: the same mask, so the
answer does not depend on the chat folder being on this machine), reports the difference when it is a visible
share of the step, and names the switch.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

from tokenmill import config as C
from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import Finding, _clamp, advice, pct, switch
from tokenmill.profiling.technique_rules import _estimate

VISIBLE = 0.02  # an estimated cost below this share of the step is not worth a finding


@functools.lru_cache(maxsize=8)
def _with_and_without(key: str) -> tuple:
    """The estimates of the run (``key``: its typed config, flat, its GPU, memory, processes and whether it packed
    chat, as JSON) on the explicit path and with FlexAttention; kept, as the doctor may ask about one run more
    than once."""
    config, gpu_name, total, world, packed = json.loads(key)
    run = Run.of({"config": config, "gpu_name": gpu_name, "device_total_mb": total, "world_size": world})
    same = {"data.document_mask": True, "data.document_positions": True, "data.chat_packing": "pad"} if packed else {}
    return (_estimate(run, {**same, "model.document_attention": "explicit"}),
            _estimate(run, {**same, "model.document_attention": "flex"}))


def packed_chat(run: Run) -> bool:
    """The run packed a chat folder's conversations: ``data.chat_packing='pack'`` with its loss mask, and the chat
    figures in its summary (``learned_frac``: a chat folder trained on)."""
    d = run.config.data
    return d.chat_packing == "pack" and d.loss_mask is not False and run.sft.learned_frac is not None


def explicit_on_cuda(run: Run) -> Optional[str]:
    """What kept documents apart ("data.document_mask" or "data.chat_packing='pack'") when the run did so with the
    explicit mask on a CUDA GPU (SDPA): 'explicit', or 'auto' with dropout; a config without the field predates
    FlexAttention's path and ran the explicit one. None otherwise."""
    m, packed = run.config.model, packed_chat(run)
    if not (run.config.data.document_mask or packed) or m.attention != "sdpa" or run.device != "cuda":
        return None
    recorded = "model.document_attention" in run.recorded
    impl = m.document_attention if recorded else "explicit"
    if impl == "explicit" or (impl == "auto" and m.dropout > 0):
        return "data.chat_packing='pack'" if packed else "data.document_mask"
    return None


@typed
def document_mask_cost(run: Run) -> Optional[Finding]:
    """Documents kept apart on the explicit path with SDPA on a CUDA GPU: the non-flash kernel over the whole
    T x T, and the mask; FlexAttention (``model.document_attention``) avoids both."""
    what = explicit_on_cuda(run)
    if what is None:
        return None
    key = json.dumps([C.flatten(run.config.to_dict()), run.gpu_name, run.memory.device_total_mb, run.world_size,
                      what.startswith("data.chat")], sort_keys=True, default=str)
    on, fx = _with_and_without(key)
    if on is None or fx is None:
        return None
    share = (on.step_ms - fx.step_ms) / on.step_ms if on.step_ms > 0 else 0.0
    if share < VISIBLE:
        return None
    c = run.config
    B, T = c.train.batch_size, c.model.block_size
    kept = "packed conversations" if what.startswith("data.chat") else "documents"
    ev = [f"{what} keeps {kept} apart with the explicit mask on a CUDA GPU: the (batch, 1, T, T) mask rules out the "
          "flash kernel; the memory-efficient kernel that takes it computes the whole T x T scores (twice the causal "
          "half) and reads the mask in the forward and the backward",
          f"estimated at batch {B}, T = {T}: {on.step_ms - fx.step_ms:.1f} ms of {on.step_ms:.1f} ms per step "
          f"({pct(share)}), and {on.peak_alloc_mb - fx.peak_alloc_mb:.0f} MB more at the peak (the mask, held "
          "through each step; with grouped key/value heads also their copies per query head, which that kernel "
          "needs)"]
    dropout = c.model.dropout > 0
    flex = "FlexAttention keeps them apart with a block mask: no T x T mask, the causal half only"
    sug = [switch("model.document_attention", "auto", flex + (" ('auto' needs no attention dropout)" if dropout else ""),
                  also={"model.dropout": 0.0} if dropout else None)]
    if what.startswith("data.chat"):
        sug += [switch("data.chat_packing", "pad", "one conversation per window: no mask, the flash kernel back, but "
                       "every window padded to T (summary.json padding_frac and `tokenmill estimate` give the shares)"),
                advice("the cost grows with T^2: a shorter model.block_size packs fewer conversations per window but "
                       "shrinks it")]
    else:
        sug += [switch("data.document_mask", False, "attention crosses document boundaries (as GPT-2 and nanoGPT "
                       "train) and the flash kernel comes back; compare the validation loss",
                       also={"data.document_positions": False} if c.data.document_positions else None),
                advice("documents much longer than model.block_size put a boundary in few windows, where the mask "
                       "changes little; the cost grows with T^2 (a shorter model.block_size shrinks it)")]
    return Finding(_clamp(share), "document masking runs attention without the flash kernel", ev, sug)
