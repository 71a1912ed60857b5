"""FSDP2's collectives in one rank's timeline (:class:`FsdpComm`, a part of :class:`.step.Step`), as
``torch.distributed.fsdp.fully_shard`` makes them (torch/distributed/fsdp/_fully_shard/, torch 2.6, December
2024, to 2.11: the same allocations in each):

- the all-gather (``foreach_all_gather``) runs on FSDP's all-gather copy-in stream: the shards' copies in the
  compute dtype (``_get_param_all_gather_inputs``, only where the mixed precision casts; in float8 for the weights
  ``train.fp8_all_gather`` gathers so: :func:`gathered_size`), then the flat output
  buffer, both from that stream's own pool (:data:`AG_STREAM`); the unsharded parameters are made on the current
  stream by the copy-out. One buffer at a time: forward frees it when the next group's all-gather starts
  (``comm_ctx.all_gather_state``), backward after its copy-out;
- the reduce-scatter (``foreach_reduce``, after ``FSDPParamGroup.post_backward`` has resharded the group) packs
  the unsharded gradients into an input on the current stream (fp32 with the bf16 mixed precision policy's fp32
  reduction) and writes into an output made on the reduce-scatter stream (:data:`RS_STREAM`) that the gradient
  shards then view, so the gradients live in that stream's pool: freed by ``zero_grad``, their blocks serve no
  request of the compute stream (:mod:`.allocator`). Under CPU offload (``parallel.fsdp_cpu_offload``) each
  gradient shard is copied to the host as the reduce-scatter ends and its device output dropped at once
  (``foreach_reduce``: ``offload_to_cpu``; the reduce-scatter stream's later work runs after the copy), so no
  gradient shard stays on the device. Not modelled: FSDP keeps the input until the next group's
  reduce-scatter (``comm_ctx.reduce_scatter_state(s)``); here it is freed at once;
- an NF4 weight (QLoRA: torchao's ``fsdp_pre_all_gather``) is gathered as stored, its codes, scales and factors
  (:func:`gathered_bytes`: about a quarter of its bf16 bytes), never cast by the mixed precision policy;
- the reduce-scatter pads each parameter's dim 0 to a multiple of the ranks (``_get_dim0_padded_size``; the
  all-gather too, not counted here: :class:`.moe._EPStep` gathers groups of different ranks in one call).
"""

from __future__ import annotations

import torch

from tokenmill import config as C
from tokenmill.estimate.timeline import Param, _size
from tokenmill.model.fp8 import fp8_weight

RS_STREAM = 1  # FSDP's reduce-scatter stream (0: the current, compute stream)
AG_STREAM = 2  # FSDP's all-gather copy-in stream


def fsdp_numel(p: Param, ranks: int) -> int:
    """``p``'s elements in FSDP2's all-gather and reduce-scatter buffers: dim 0 padded to a multiple of the
    ranks (torch/distributed/fsdp/_fully_shard/_fsdp_common.py, ``_get_dim0_padded_size``)."""
    if not p.shape:
        return 1
    return -(-p.shape[0] // ranks) * ranks * (p.numel // max(1, p.shape[0]))


def gathered_size(cfg: C.Config, p: Param) -> int:
    """Bytes per element of ``p`` in FSDP2's all-gather and in its unsharded copy: one for a weight that
    ``train.fp8_all_gather`` gathers in float8 (torchao's ``WeightWithDynamicFloat8CastTensor``: the shard cast to
    float8 before the all-gather, the unsharded weight a ``Float8Tensor`` over the gathered bytes, its scale one
    number; torchao/float8/fsdp_utils.py), else the compute dtype's with bf16 mixed precision, else its own."""
    t = cfg.train
    if t.fp8 == "tensorwise" and t.fp8_all_gather and p.name.endswith(".weight") and fp8_weight(p.name[:-7], p.shape):
        return 1
    return _size(torch.bfloat16 if cfg.parallel.fsdp_mixed_precision == "bf16" else p.dtype)


def gathered_bytes(cfg: C.Config, p: Param) -> int:
    """Bytes of ``p`` in FSDP2's all-gather and in its unsharded copy: an NF4 weight (QLoRA) as stored, its codes
    and scales (torchao's ``fsdp_pre_all_gather`` gathers them, never cast), else :func:`gathered_size` a value."""
    return p.nbytes if p.nf4 else p.numel * gathered_size(cfg, p)


class FsdpComm:
    """The all-gathers and reduce-scatters of :class:`.step.Step` (its ``tl``, ``cfg``, ``shard``, ``grads``,
    ``by_name``, ``sharded``, ``sharded_ids``)."""

    def _ranks(self) -> int:
        """The ranks the group is sharded over."""
        return max(1, round(1.0 / self.shard))

    def _unshard(self, params: list[Param]) -> list[int]:
        """All-gather (module doc): returns the unsharded parameters' storage (none for a unit without any)."""
        if not params:
            return []
        tl = self.tl
        total = sum(gathered_bytes(self.cfg, p) for p in params)  # unpadded: a subclass may mix groups (moe.py)
        cast = sum(p.numel * gathered_size(self.cfg, p) for p in params
                   if not p.nf4 and gathered_size(self.cfg, p) != _size(p.dtype))
        inp = tl.alloc(cast * self.shard, "communication buffers", stream=AG_STREAM) if cast else None
        buf = tl.alloc(total, "communication buffers", stream=AG_STREAM)
        tl.release(inp)  # copied into the output buffer
        out = [tl.alloc(total, "parameters")]
        tl.release(buf)
        return out

    def _reduce_scatter(self, names: list[str], sync: bool) -> None:
        """After a group's backward (module doc): its unsharded gradients through the reduce-scatter input into
        the gradient shards (kept unsharded while accumulating without synchronisation)."""
        if not sync:
            return
        tl = self.tl
        present = [n for n in names if n in self.grads]
        if not present:
            return
        mixed = self.cfg.parallel.fsdp_mixed_precision == "bf16"  # reduced in fp32; else in the gradients' dtype
        ranks = self._ranks()
        total = sum(fsdp_numel(self.by_name[n], ranks) * (4 if mixed else _size(self.by_name[n].dtype))
                    for n in present)
        buf = tl.alloc(total, "communication buffers")
        for n in present:
            tl.release(self.grads.pop(n))
        new = tl.alloc(total * self.shard, "gradients", stream=RS_STREAM)
        tl.release(buf)
        if self.cfg.parallel.fsdp_cpu_offload:  # copied to the host gradient and freed at once (module doc)
            tl.release(new)
            return
        if all(n in self.sharded for n in present):  # added into the sharded gradients, then freed
            tl.release(new)
            return
        for n in present:
            self.sharded[n] = new
        self.sharded_ids.add(new)
