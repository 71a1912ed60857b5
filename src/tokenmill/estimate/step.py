"""One rank's training steps as allocations and frees, in the trainer's order
(``tokenmill.train.trainer.Trainer.train_step``), from the traced pieces:

- before the first step: the parameters (this rank's share: FSDP shards them, TP splits the blocks,
  PP keeps one stage), the stored causal masks, DDP's gradient buckets, a cuBLAS workspace (CUDA);
- each micro-batch: its token ids and targets on the device; the embeddings, every block and the head
  forward (the trainer drops the logits at once: backward does not need them); backward in reverse (the
  first micro-batch creates the gradients, later ones add into them); FSDP gathers each block's
  parameters before its forward and backward (the next block's prefetched in backward), frees them
  after (so too an untied embedding's, and the final norm and head's from the end of forward to their
  backward: :func:`~tokenmill.model.gpt.edge_units_apart`; the root's, tied, all step), and reduce-scatters
  its gradients (after the last micro-batch, or every one with
  ``parallel.sync_every_microbatch``), its buffers and gradient shards on FSDP's own streams (:mod:`.fsdp`);
  the pipeline runs its micro-batches in the schedule's order;
- the optimizer step: its state is created on the first step (two moments per parameter, in the
  parameter's dtype, also for FSDP's shards), AdamW's temporaries (``foreach``: a square root per
  parameter of a group at once; ``for-loop``: two per parameter, one parameter at a time; ``fused``:
  none), then the gradients are freed (``zero_grad(set_to_none=True)``; with
  ``optim.zero_grad='after_forward'`` after the next step's first forward). The memory switches change
  this part: the step inside backward frees each gradient as soon as it is complete, CPU offload keeps
  state and step on the host (and frees gradients in backward with ``offload_gradients``), 8-bit AdamW
  keeps 1-byte moments with an fp32 scale per 256.

Two steps are replayed (the first creates the optimizer state), as the trainer's peak counts from
before the first step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill import config as C
from tokenmill.estimate.fsdp import FsdpComm
from tokenmill.estimate.techniques import docmask_bytes, muon_hidden, muon_temp_bytes, state_buffers
from tokenmill.estimate.timeline import Layout, Param, Timeline, _Inst, _size, play_backward, play_forward
from tokenmill.estimate.trace import Pieces, PieceTrace
from tokenmill.model.gpt import edge_units_apart
from tokenmill.model.nf4 import nf4_parts
from tokenmill.model.offload import IN_FLIGHT

CUBLAS_WORKSPACE = 8 * 1024 * 1024 + 128 * 1024  # cuBLAS's default before Hopper (4096 KiB x 2 + 16 KiB x 8)
INT8_BLOCK = 256  # torchao AdamW8bit: one fp32 scale per block of 256 values


@dataclass
class Plan:
    """Everything the step depends on, resolved from the config."""

    cfg: C.Config
    layout: Layout
    cuda: bool
    params: list[Param]  # this rank's model, unsharded
    stage_blocks: list[int]  # block indices this rank holds
    has_embed: bool = True
    has_head: bool = True
    workspace: int = CUBLAS_WORKSPACE  # cuBLAS workspace bytes of the GPU (Hopper: 32 MiB)


def _state_bytes(cfg: C.Config, p: Param, shard: float) -> tuple[int, int]:
    """(bytes of AdamW state for ``p`` on the device, host bytes) with ``shard`` = this rank's share."""
    mem = cfg.memory
    n = p.numel * shard
    if mem.optimizer_offload or cfg.parallel.fsdp_cpu_offload:
        return 0, int(4 * n * 4)  # fp32 master, two moments, gradient buffer
    if mem.optimizer_8bit and p.numel >= 4096 and p.numel % INT8_BLOCK == 0:
        return int(2 * (n + n / INT8_BLOCK * 4)), 0
    dt = torch.float32 if mem.optimizer_8bit else p.dtype  # FSDP's shards keep the parameter's dtype
    return int(state_buffers(cfg, p) * n * _size(dt)), 0  # AdamW's two moments, Muon's one momentum


def optimizer_events(tl: Timeline, plan: Plan, grads: dict[str, int], state: dict[str, list[int]],
                     shard: float, first: bool, keep: bool = False) -> int:
    """The optimizer step (after backward): state on the first step, temporaries, zero_grad (not with
    ``keep``: the caller frees the gradients later). Returns the host bytes it uses."""
    cfg = plan.cfg
    mem = cfg.memory
    host = 0
    params = [p for p in plan.params if p.trainable]  # a frozen parameter (LoRA's base) has no state
    if mem.optimizer_in_backward:  # stepped inside backward; gradients already gone
        return 0
    if first:
        for p in params:
            dev, h = _state_bytes(cfg, p, shard)
            host += h
            if dev:
                k = state_buffers(cfg, p)
                state[p.name] = [tl.alloc(dev / k, "optimizer state") for _ in range(k)]
    else:
        host = sum(_state_bytes(cfg, p, shard)[1] for p in params)
    if not (mem.optimizer_offload or cfg.parallel.fsdp_cpu_offload):
        _optimizer_temps(tl, cfg, [p for p in params if not muon_hidden(cfg, p)], shard)
        tl.release(tl.alloc(muon_temp_bytes(cfg, params, shard < 1), "temporaries"))  # Muon: 0 without it
    if not keep:
        for gid in grads.values():  # zero_grad(set_to_none=True)
            tl.release(gid)
    return host


def _groups(cfg: C.Config, params: list[Param]) -> list[list[Param]]:
    """AdamW's parameter groups (GPT-2 decay groups: matrices, then vectors), each split by dtype."""
    groups = [params] if not cfg.optim.decay_groups else [[p for p in params if len(p.shape) >= 2],
                                                          [p for p in params if len(p.shape) < 2]]
    out = []
    for g in groups:
        by_dt: dict = defaultdict(list)
        for p in g:
            by_dt[p.dtype].append(p)
        out += list(by_dt.values())
    return out


def _optimizer_temps(tl: Timeline, cfg: C.Config, params: list[Param], shard: float) -> None:
    if cfg.memory.optimizer_8bit:  # torchao: one parameter at a time, both moments dequantised to fp32
        for p in params:
            ids = [tl.alloc(p.numel * shard * 4, "temporaries") for _ in range(2)]
            for i in ids:
                tl.release(i)
        return
    impl = cfg.optim.impl
    if impl == "foreach":  # exp_avg_sq.sqrt() for a whole group at once
        for g in _groups(cfg, params):
            ids = [tl.alloc(p.numel * shard * _size(p.dtype), "temporaries") for p in g]
            for i in ids:
                tl.release(i)
    elif impl == "for-loop":  # (exp_avg_sq.sqrt() / bias_correction).add_(eps): two temporaries
        for p in params:
            a = tl.alloc(p.numel * shard * _size(p.dtype), "temporaries")
            b = tl.alloc(p.numel * shard * _size(p.dtype), "temporaries")
            tl.release(a)
            tl.release(b)


def _rename(name: str, block: int) -> str:
    """A traced block's parameter name as block ``block``'s (no checkpoint-wrapper prefix)."""
    rest = name.replace("_checkpoint_wrapped_module.", "").split(".", 2)[2]
    return f"blocks.{block}.{rest}"


def rank_params(pieces: Pieces, blocks: list[int], has_embed: bool, has_head: bool) -> list[Param]:
    """This rank's parameters (unsharded), from the traced pieces."""
    out: dict[str, Param] = {}

    def add(tr: PieceTrace, piece: str, block: Optional[int] = None) -> None:
        for n, shape in tr.param_shape.items():
            name = _rename(n, block) if block is not None else n
            out.setdefault(name, Param(name, shape, tr.param_dtype[n], piece, block,
                                       tr.param_trainable.get(n, True), n in tr.param_nf4))

    if has_embed:
        add(pieces.embed, "embed")
    for i in blocks:
        add(pieces.blocks[pieces.kinds[i]], "block", i)
    if has_head:
        add(pieces.head, "head")
    return list(out.values())


class Step(FsdpComm):
    """Builds the timeline of ``steps`` training steps of one rank (module doc)."""

    def __init__(self, pieces: Pieces, plan: Plan):
        self.pieces, self.plan, self.cfg = pieces, plan, plan.cfg
        self.tl = Timeline()
        lay = plan.layout
        self.fsdp = lay.dp_shard > 1
        # the pieces FSDP shards as units of their own, apart from the root (the trainer's rule: model/gpt.py)
        self.apart = {"embed", "head"} if self.fsdp and edge_units_apart(self.cfg.model) else set()
        self.shard = 1.0 / lay.dp_shard if self.fsdp else 1.0
        self.ddp = lay.dp_replicate > 1 and not self.fsdp and lay.tp == 1 and lay.pp == 1
        self.zero1 = self.cfg.parallel.zero1 and self.ddp
        self.grads: dict[str, int] = {}
        self.state: dict[str, list[int]] = {}
        self.host = 0
        self.by_name = {p.name: p for p in plan.params}
        self.by_block: dict[Optional[int], list[Param]] = defaultdict(list)  # each block's, in the plan's order
        for p in plan.params:
            self.by_block[p.block].append(p)
        self.first_step = True
        # optim.zero_grad='after_forward': the last step's gradients live on into the next forward
        self.late_zero = self.cfg.optim.zero_grad == "after_forward"
        self.sync_every = self.cfg.parallel.sync_every_microbatch
        self.stale: list[int] = []
        self.kept: Optional[int] = None  # memory.offload_activations: the tensors still going down (offload_kept_bytes)

    # set-up -----------------------------------------------------------------------------------
    def setup(self) -> None:
        tl, cfg, plan = self.tl, self.cfg, self.plan
        offload = self.fsdp and cfg.parallel.fsdp_cpu_offload
        for p in plan.params:
            if offload:
                continue
            if p.nf4:  # each of its tensors, split evenly by FSDP (config/lora.py) but the mean and the table
                for i, n in enumerate(nf4_parts(p.numel)):
                    tl.alloc(math.ceil(n * self.shard) if i < 3 else n, "parameters")
            else:  # FSDP's shard: dim 0 split
                tl.alloc(math.ceil(p.shape[0] * self.shard) * (p.numel // max(1, p.shape[0])) * _size(p.dtype)
                         if p.shape else p.nbytes, "parameters")
        for nbytes in self.pieces.buffers:  # the model's own buffers (RoPE's cos/sin tables), on every rank and stage
            tl.alloc(nbytes, "parameters")
        for i in plan.stage_blocks:
            buf = self.pieces.blocks[self.pieces.kinds[i]].buffer_bytes
            if buf:
                tl.alloc(buf, "parameters")  # the stored causal mask (model.causal_mask='buffer')
        if self.ddp:  # DDP's flat gradient buckets (of the parameters that get gradients), made when it wraps
            tl.alloc(sum(p.nbytes for p in plan.params if p.trainable), "communication buffers")
        if plan.cuda:
            tl.alloc(plan.workspace, "temporaries")
            if cfg.data.cuda_prefetch:  # the next batch is already on the device
                B, T = self.pieces.batch, self.pieces.seq
                tl.alloc(2 * B * T * 8, "batch")

    # hooks ------------------------------------------------------------------------------------
    def _on_grad(self, name: str, gid: int) -> None:
        mem, tl = self.cfg.memory, self.tl
        if self.ddp and self.cfg.parallel.ddp_grad_as_bucket_view:
            tl.release(gid)  # copied into its bucket, which the gradient then views
            return
        if mem.optimizer_in_backward:
            p = self.by_name[name]
            if self.first_step:
                dev, _ = _state_bytes(self.cfg, p, 1.0)
                self.state[name] = [tl.alloc(dev / 2, "optimizer state"), tl.alloc(dev / 2, "optimizer state")]
            if self.cfg.optim.impl != "fused":
                tmp = [tl.alloc(p.nbytes, "temporaries") for _ in range(2 if self.cfg.optim.impl == "for-loop" else 1)]
                for t in tmp:
                    tl.release(t)
            tl.release(gid)
            return
        if mem.offload_gradients:
            tl.release(gid)  # copied to its pinned host buffer and freed at once
            return
        self.grads[name] = gid

    # the step ---------------------------------------------------------------------------------
    def run(self, steps: int = 2) -> Timeline:
        self.setup()
        for _ in range(steps):
            self.sharded: dict[str, int] = {}
            self.sharded_ids: set[int] = set()
            self.one_step()
            self.first_step = False
        return self.tl

    def one_step(self) -> None:
        tl, cfg, pieces, plan = self.tl, self.cfg, self.pieces, self.plan
        A = cfg.train.grad_accum_steps
        B, T = pieces.batch, pieces.seq
        batch: list[int] = []
        for micro in range(A):
            sync = micro == A - 1 or self.sync_every
            # the first micro-batch creates the gradients; later ones add into them (FSDP reduce-scatters
            # after every micro-batch with sync_every_microbatch: its unsharded gradients are new each time)
            r = 0 if micro == 0 or (self.fsdp and self.sync_every) else 1
            new = [tl.alloc(B * T * 8, "batch"), tl.alloc(B * T * 8, "batch")]  # ids, targets (int64)
            for gid in batch:
                tl.release(gid)
            batch = new
            tl.mark(f"micro-batch {micro}: forward")
            fwd = self._micro_forward(r)
            if micro == 0:
                for gid in self.stale:  # optim.zero_grad='after_forward' frees them now
                    tl.release(gid)
                self.stale = []
            tl.mark(f"micro-batch {micro}: backward")
            self._micro_backward(*fwd, sync)
        tl.mark("optimizer step")
        grads = dict(self.grads)
        for gid in self.sharded_ids:
            grads[f"sharded-{gid}"] = gid
        self.grads = {}
        shard = self.shard if self.fsdp else (1.0 / plan.layout.dp_replicate if self.zero1 else 1.0)
        self.host = optimizer_events(tl, plan, grads, self.state, shard, self.first_step, keep=self.late_zero)
        self.host += self._activation_host_bytes()
        if self.late_zero:
            self.stale = list(grads.values())
        for gid in batch:
            tl.release(gid)
        tl.mark("step end")

    def _micro_forward(self, r: int) -> tuple:
        """One micro-batch's forward: (embedding, head, [(block, instance, gathered params)], (the gathered root
        params, the edge units' still gathered), the document mask) for :meth:`_micro_backward`."""
        tl, cfg, pieces, plan = self.tl, self.cfg, self.pieces, self.plan
        root = self._unshard(self._root_params()) if self.fsdp else []
        edges = {"embed": self._unshard(self._piece_params("embed"))} if "embed" in self.apart else {}
        emb = _Inst(pieces.embed, r)
        play_forward(tl, emb)
        if edges and cfg.parallel.fsdp_reshard_after_forward:  # the embeddings' unit: freed after its forward
            for g in edges.pop("embed"):
                tl.release(g)
        dm = docmask_bytes(cfg, pieces.batch, pieces.seq, plan.cuda)  # data.document_mask's mask (techniques.py)
        docmask = tl.alloc(dm, "activations") if dm else None  # kept until the first block's backward
        x, insts = emb.y, []
        for i in plan.stage_blocks:
            tr = pieces.blocks[pieces.kinds[i]]
            inst = _Inst(tr, r, x=x)
            held = self._unshard(self._block_params(i)) if self.fsdp else []
            play_forward(tl, inst)
            if held and cfg.parallel.fsdp_reshard_after_forward:
                for g in held:
                    tl.release(g)
                held = []
            insts.append((i, inst, held))
            x = inst.y
        if "head" in self.apart:  # the final norm and the head's unit, kept for their backward
            edges["head"] = self._unshard(self._piece_params("head"))
        head = _Inst(pieces.head, r, x=x)
        play_forward(tl, head)
        tl.release(head.y)  # the trainer keeps only the loss
        kept = offload_kept_bytes(plan, pieces)  # memory.offload_activations: still going down, kept till backward
        self.kept = tl.alloc(kept, "activations") if kept else None
        return emb, head, insts, (root, edges), docmask

    def _micro_backward(self, emb: _Inst, head: _Inst, insts: list, gathered: tuple[list[int], dict],
                        docmask: Optional[int], sync: bool) -> None:
        """One micro-batch's backward, blocks in reverse; under FSDP each unit's parameters are gathered
        again (the next block's prefetched) and its gradients reduce-scattered."""
        tl, cfg = self.tl, self.cfg
        root, edges = gathered
        play_backward(tl, head, self._on_grad_renamed(None))
        self._edge_done(edges, "head", sync)
        tl.release(self.kept)
        gy = head.gx
        prefetched: dict[int, list[int]] = {}
        for k in range(len(insts) - 1, -1, -1):
            i, inst, held = insts[k]
            if self.fsdp and not held:
                held = prefetched.pop(i, None) or self._unshard(self._block_params(i))
                if k > 0 and cfg.parallel.fsdp_reshard_after_forward:  # backward prefetch
                    j = insts[k - 1][0]
                    prefetched[j] = self._unshard(self._block_params(j))
            inst.gy = gy
            play_backward(tl, inst, self._on_grad_renamed(i))
            gy = inst.gx
            if self.fsdp:  # post_backward: reshard (the unsharded parameters freed), then reduce-scatter
                for g in held:
                    tl.release(g)
                self._reduce_scatter([p.name for p in self._block_params(i)], sync)
        tl.release(docmask)
        if "embed" in self.apart and "embed" not in edges:  # gathered again for its backward
            edges["embed"] = self._unshard(self._piece_params("embed"))
        emb.gy = gy
        play_backward(tl, emb, self._on_grad_renamed(None))
        tl.release(gy)
        self._edge_done(edges, "embed", sync)
        if self.fsdp:
            for g in root:
                tl.release(g)
            self._reduce_scatter([p.name for p in self._root_params()], sync)

    def _root_params(self) -> list[Param]:
        """The root unit's parameters: all but the blocks' and the edge units' (:attr:`apart`)."""
        return [p for p in self.plan.params if p.piece != "block" and p.piece not in self.apart]

    def _piece_params(self, piece: str) -> list[Param]:
        return [p for p in self.plan.params if p.piece == piece]

    def _edge_done(self, edges: dict, piece: str, sync: bool) -> None:
        """An edge unit's post-backward: its unsharded parameters freed, its gradients reduce-scattered."""
        if piece not in self.apart:
            return
        for g in edges.pop(piece, []):
            self.tl.release(g)
        self._reduce_scatter([p.name for p in self._piece_params(piece)], sync)

    def _activation_host_bytes(self) -> int:
        return offloaded_bytes(self.plan, self.pieces)

    def _block_params(self, i: int) -> list[Param]:
        return self.by_block.get(i, [])

    def _on_grad_renamed(self, block: Optional[int]):
        def hook(name: str, gid: int) -> None:
            self._on_grad(_rename(name, block) if block is not None else name, gid)
        return hook


def pipeline_order(schedule: str, n_mb: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """The forwards ('F', j) and backwards ('B', j) of one stage in one schedule step: GPipe runs all
    forwards then all backwards; 1F1B (torch's Schedule1F1B) runs ``min(n_mb, pp - stage)`` forwards,
    then alternates one backward and one forward, then the remaining backwards."""
    if schedule == "gpipe":
        return [("F", j) for j in range(n_mb)] + [("B", j) for j in range(n_mb)]
    warm = min(n_mb, pp - stage)
    order = [("F", j) for j in range(warm)]
    f, b = warm, 0
    while b < n_mb:
        order.append(("B", b))
        b += 1
        if f < n_mb:
            order.append(("F", f))
            f += 1
    return order


class PipelineStep(Step):
    """One pipeline stage's step: ``parallel.pp_microbatches`` micro-batches through its blocks under
    the schedule, activations of the micro-batches in flight kept at once (module doc of
    :mod:`tokenmill.parallel.pipeline`). Receive buffers hold a micro-batch's input (later stages) and
    its output's gradient; the stage keeps each micro-batch's output until that micro-batch's backward."""

    def one_step(self) -> None:
        tl, cfg, pieces, plan = self.tl, self.cfg, self.pieces, self.plan
        lay, p = plan.layout, cfg.parallel
        n_mb = p.pp_microbatches or lay.pp
        stage = 0 if plan.has_embed else (lay.pp - 1 if plan.has_head else 1)
        order = pipeline_order(p.pp_schedule, n_mb, lay.pp, stage)
        B, T, C = pieces.batch, pieces.seq, cfg.model.n_embd
        act = B * T * C * _size(torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32)
        for micro in range(cfg.train.grad_accum_steps):
            batch = [tl.alloc(B * n_mb * T * 8, "batch"), tl.alloc(B * n_mb * T * 8, "batch")]
            live: dict[int, dict] = {}
            first = micro == 0
            for kind, j in order:
                r = 0 if (first and j == 0) else 1
                if kind == "F":
                    tl.mark(f"micro-batch {j}: forward")
                    live[j] = self._stage_forward(r, act)
                else:
                    tl.mark(f"micro-batch {j}: backward")
                    self._stage_backward(live.pop(j), act)
            for gid in batch:
                tl.release(gid)
        tl.mark("optimizer step")
        grads = dict(self.grads)
        self.grads = {}
        shard = self.shard if self.fsdp else 1.0
        self.host = optimizer_events(tl, plan, grads, self.state, shard, self.first_step)
        tl.mark("step end")

    def _stage_forward(self, r: int, act: int) -> dict:
        tl, pieces, plan = self.tl, self.pieces, self.plan
        st: dict = {"r": r, "insts": []}
        if plan.has_embed:
            emb = _Inst(pieces.embed, r)
            play_forward(tl, emb)
            st["emb"], x = emb, emb.y
        else:  # received from the previous stage; the schedule keeps it for this micro-batch's backward
            x = st["recv"] = tl.alloc(act, "communication buffers", holders=2)
        for i in plan.stage_blocks:
            inst = _Inst(pieces.blocks[pieces.kinds[i]], r, x=x)
            play_forward(tl, inst)
            st["insts"].append((i, inst))
            x = inst.y
        if plan.has_head:
            head = _Inst(pieces.head, r, x=x)
            play_forward(tl, head)
            tl.release(head.y)  # the loss function drops the logits at once
            st["head"] = head
        else:
            tl.hold(x)  # kept (and sent) until the backward of this micro-batch
            st["out"] = x
        return st

    def _stage_backward(self, st: dict, act: int) -> None:
        tl = self.tl
        if "head" in st:
            play_backward(tl, st["head"], self._on_grad_renamed(None))
            gy = st["head"].gx
        else:
            tl.release(st["out"])
            gy = tl.alloc(act, "communication buffers")  # the gradient received from the next stage
        for i, inst in reversed(st["insts"]):
            inst.gy = gy
            play_backward(tl, inst, self._on_grad_renamed(i))
            gy = inst.gx
        if "emb" in st:
            st["emb"].gy = gy
            play_backward(tl, st["emb"], self._on_grad_renamed(None))
        tl.release(gy)  # sent to the previous stage (or consumed by the embeddings)
        if "recv" in st:
            tl.release(st["recv"])


def offloaded_sizes(plan: Plan, pieces) -> list[list[int]]:
    """memory.offload_activations: the bytes of each tensor each piece of the stage moves to the host in one
    micro-batch's forward, pieces in forward order (read by the memory here and the copies' replay in roofline)."""
    blocks = [pieces.blocks[pieces.kinds[i]].host_sizes for i in plan.stage_blocks]
    return ([pieces.embed.host_sizes] if plan.has_embed else []) + blocks + \
        ([pieces.head.host_sizes] if plan.has_head else [])


def offload_kept_bytes(plan: Plan, pieces) -> int:
    """Device memory memory.offload_activations keeps at the forward's end: the last ``IN_FLIGHT`` tensors saved,
    whose copies are still running then (at most; counted till the head's backward has read them)."""
    sizes = [b for piece in offloaded_sizes(plan, pieces) for b in piece]
    return sum(sizes[-IN_FLIGHT:])


def offloaded_bytes(plan: Plan, pieces) -> int:
    """Host memory of memory.offload_activations: every saved tensor of one micro-batch's forward of the stage."""
    return sum(sum(piece) for piece in offloaded_sizes(plan, pieces))
