"""FSDP's separate CUDA streams in the memory estimate: the caching allocator's per-stream pools
(estimate/allocator.py) and the all-gather / reduce-scatter buffers and gradient shards FSDP2 puts on its own
streams (estimate/fsdp.py), checked against sizes computed here from the model's parameter shapes."""

import math

import torch

from tokenmill import config as C
from tokenmill.estimate.allocator import CachingAllocator, MiB
from tokenmill.estimate.core import _plan, resolve_layout
from tokenmill.estimate.fsdp import AG_STREAM, RS_STREAM
from tokenmill.estimate.step import Step


def test_a_stream_reuses_only_its_own_cached_blocks():
    a = CachingAllocator()
    a.malloc("grad", 30 * MiB, stream=1)  # a 30 MiB segment of stream 1's pool
    a.free("grad")
    a.malloc("act", 30 * MiB)  # the default stream cannot take stream 1's cached block: a new segment
    assert (a.allocated, a.reserved) == (30 * MiB, 60 * MiB)
    a.free("act")
    a.malloc("grad2", 20 * MiB, stream=1)  # stream 1 takes its own block back (split: 10 MiB stay cached)
    a.malloc("act2", 30 * MiB)  # and the default stream its own
    assert a.reserved == 60 * MiB
    # before passing the capacity, the cached segments of every stream are released
    c = CachingAllocator(capacity=100 * MiB)
    c.malloc("grad", 60 * MiB, stream=1)
    c.free("grad")
    c.malloc("act", 60 * MiB)
    assert c.reserved == 60 * MiB and not c.out_of_memory
    # expandable segments: one segment per stream, each unmapped at its free end
    e = CachingAllocator(expandable_segments=True)
    e.malloc("grad", 30 * MiB, stream=1)
    e.malloc("act", 30 * MiB)
    e.free("grad")
    assert e.reserved == 30 * MiB
    e.malloc("act2", 10 * MiB)  # grows the default stream's segment, not stream 1's (gone)
    assert e.reserved == 40 * MiB


def _padded(shape: tuple, ranks: int) -> int:
    """Elements of a parameter in FSDP2's buffers: dim 0 rounded up to a multiple of the ranks."""
    return math.ceil(shape[0] / ranks) * ranks * math.prod(shape[1:]) if shape else 1


def test_fsdp_buffers_and_gradient_shards_on_their_streams():
    ranks = 4
    cfg = C.resolve(None, overrides={
        "data.source": "synthetic", "model.vocab_size": 510, "model.n_layer": 2, "model.n_embd": 64,
        "model.n_head": 4, "model.block_size": 32, "train.batch_size": 2, "train.precision": "bf16-autocast",
        "parallel.dp_shard": ranks, "parallel.fsdp_mixed_precision": "bf16"}, overrides_from_string=False)
    cfg = C.concrete(cfg, "cuda", True)
    plan, pieces = _plan(cfg, resolve_layout(cfg, ranks), 510, True, 0)
    tl = Step(pieces, plan).run(steps=1)
    on = {s: [e[2] for e in tl.ev if e[0] == "a" and e[4] == s] for s in (RS_STREAM, AG_STREAM)}
    groups = [[p for p in plan.params if p.block == i] for i in range(2)]
    groups.append([p for p in plan.params if p.piece != "block"])  # the root: embeddings, final norm, head
    assert any(p.shape[0] % ranks for p in groups[-1])  # the 510-row embedding is padded to 512 rows
    fp32 = [sum(_padded(p.shape, ranks) for p in g) * 4 for g in groups]  # reduced in fp32
    bf16 = [sum(math.prod(p.shape) for p in g) * 2 for g in groups]  # gathered in bf16 (the gather's padding not counted)
    # the gradient shards: the reduce-scatter outputs of the blocks in reverse, then the root's
    assert on[RS_STREAM] == [fp32[1] // ranks, fp32[0] // ranks, fp32[2] // ranks]
    # all-gathers: each group's bf16 copy of its shard, then its output buffer; forward (root, blocks) then
    # backward (blocks in reverse, the next one prefetched)
    order = [2, 0, 1, 1, 0]
    assert on[AG_STREAM] == [n for g in order for n in (int(bf16[g] / ranks), bf16[g])]
    assert all(p.dtype == torch.float32 for p in plan.params)  # the casts exist because the shards are fp32


def test_fsdp_bf16_parameters_are_not_copied_by_autocast():
    """parallel.fsdp_mixed_precision 'bf16': FSDP hands the forward bf16 parameters, so autocast's cast of one is
    no copy. The trace's DeviceModel returns the tensor gather_params made before recording (its storage among
    the ones the recorder leaves out), in every autocast region, and the gradient still reaches the fp32
    parameter; without it each region casts anew (a copy the recorder counts)."""
    import torch
    from torch import nn

    from tokenmill.estimate.device import DeviceModel

    lin = nn.Linear(8, 16, bias=False, device="meta")
    plain, fsdp = DeviceModel("cuda", torch.bfloat16), DeviceModel("cuda", torch.bfloat16)
    fsdp.gather_params(lin, torch.bfloat16)
    (gathered,) = [t for _, t in fsdp._gathered.values()]
    assert fsdp.gathered_ids == {gathered.untyped_storage()._cdata} and gathered.dtype == torch.bfloat16
    for mode, same in ((fsdp, True), (plain, False)):
        seen = []
        with mode:
            for _ in range(2):
                with mode.autocast_region():
                    seen.append(mode._cast(lin.weight, torch.bfloat16, True))
        assert (seen[0] is gathered and seen[1] is gathered) == same
        assert all(s.grad_fn is not None for s in seen)  # the gradient flows back to the parameter


def test_fsdp_gathers_and_shards_nf4_weights_as_stored():
    """QLoRA under FSDP (``lora.quantize_base = 'nf4'``, ``parallel.dp_shard`` 2): each block projection's weight is
    a Param marked NF4 (estimate/trace.py, from model/lora.py nf4_params), its shard allocated as torchao's tensors
    (codes, scales, factors halved; mean and code table whole: model/nf4.py nf4_parts), and each all-gather moves a
    block's NF4 bytes as stored (no cast input: the mixed precision does not cast them) beside its norms' and
    adapters' bf16 bytes. Sizes computed here from the block's shapes."""
    from tokenmill.model.nf4 import nf4_parts

    ranks = 2
    cfg = C.resolve("tiny-llama", overrides={
        "data.source": "synthetic", "model.vocab_size": 512, "model.n_embd": 256, "model.intermediate_size": 512,
        "train.batch_size": 2, "train.precision": "bf16", "lora.rank": 8, "lora.quantize_base": "nf4",
        "parallel.dp_shard": ranks}, overrides_from_string=False)
    cfg = C.concrete(cfg, "cuda", True)
    plan, pieces = _plan(cfg, resolve_layout(cfg, ranks), 512, True, 0)
    nf4 = [p for p in plan.params if p.nf4]
    # q, k, v, o, gate, up, down of both blocks; frozen, and nothing else is NF4
    assert sorted(p.shape for p in nf4 if p.block == 0) == sorted([(256, 256), (128, 256), (128, 256), (256, 256),
                                                                  (512, 256), (512, 256), (256, 512)])
    assert len(nf4) == 14 and not any(p.trainable for p in nf4) and all(p.piece == "block" for p in nf4)
    assert all(p.nbytes == sum(nf4_parts(p.numel)) for p in nf4)
    tl = Step(pieces, plan).run(steps=1)
    setup = [e[2] for e in tl.ev if e[0] == "a" and e[3] == "parameters" and e[4] == 0][:len(plan.params) * 5]
    for p in nf4[:3]:  # each shard's tensors, in order, among the first allocations
        parts = [n // ranks for n in nf4_parts(p.numel)[:3]] + list(nf4_parts(p.numel)[3:])
        assert any(setup[i:i + 5] == parts for i in range(len(setup))), p.name
    block = [p for p in plan.params if p.block == 0]
    gathered = sum(p.nbytes for p in block)  # NF4 as stored, the rest (norms, adapters: bf16) at their width
    assert gathered == sum(sum(nf4_parts(p.numel)) for p in block if p.nf4) + sum(
        math.prod(p.shape) * 2 for p in block if not p.nf4)
    on_ag = [e[2] for e in tl.ev if e[0] == "a" and e[4] == AG_STREAM]
    assert on_ag.count(gathered) >= 2  # block 0 gathered in forward and again in backward, one buffer each
    assert all(p.dtype == torch.bfloat16 for p in block)  # pure bf16: no cast input for any gather


def _gradients_alive_at(tl, mark: str) -> int:
    """Bytes of the timeline's 'gradients' allocations still alive when ``mark`` is reached."""
    alive: dict[int, int] = {}
    for e in tl.ev:
        if e[0] == "a" and e[3] == "gradients":
            alive[e[1]] = e[2]
        elif e[0] == "f":
            alive.pop(e[1], None)
        elif e[0] == "m" and e[1] == mark:
            return sum(alive.values())
    raise AssertionError(f"no mark {mark!r}")


def test_untied_embeddings_and_head_are_fsdp_units_of_their_own():
    """With an untied head (model/gpt.py edge_units_apart, as the trainer's apply_fsdp shards it) the embeddings
    are gathered for their forward and again for their backward, the final norm and head at the end of forward
    and freed after their backward, each unit reduce-scattered on its own; the root holds nothing more."""
    ranks = 4
    cfg = C.resolve(None, overrides={
        "data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 64,
        "model.n_head": 4, "model.block_size": 32, "train.batch_size": 2, "train.precision": "bf16-autocast",
        "model.tie_embeddings": False, "parallel.dp_shard": ranks, "parallel.fsdp_mixed_precision": "bf16"},
        overrides_from_string=False)
    cfg = C.concrete(cfg, "cuda", True)
    plan, pieces = _plan(cfg, resolve_layout(cfg, ranks), 512, True, 0)
    tl = Step(pieces, plan).run(steps=1)
    on = {s: [e[2] for e in tl.ev if e[0] == "a" and e[4] == s] for s in (RS_STREAM, AG_STREAM)}
    units = {"b0": [p for p in plan.params if p.block == 0], "b1": [p for p in plan.params if p.block == 1],
             "embed": [p for p in plan.params if p.piece == "embed"],
             "head": [p for p in plan.params if p.piece == "head"]}
    assert sum(map(len, units.values())) == len(plan.params) and units["head"]  # no parameter left to the root
    bf16 = {k: sum(math.prod(p.shape) for p in g) * 2 for k, g in units.items()}
    fp32 = {k: sum(_padded(p.shape, ranks) for p in g) * 4 for k, g in units.items()}
    order = ["embed", "b0", "b1", "head", "b1", "b0", "embed"]
    assert on[AG_STREAM] == [n for k in order for n in (int(bf16[k] / ranks), bf16[k])]
    assert on[RS_STREAM] == [fp32[k] // ranks for k in ("head", "b1", "b0", "embed")]


def test_fsdp_cpu_offload_keeps_no_gradient_shard_on_the_device():
    """FSDP2's CPU offload copies each reduce-scattered gradient shard to the host and drops its device output at
    once (torch's foreach_reduce, offload_to_cpu); without offload the shards live on the device until zero_grad.
    The 70B torchtune full fine-tune with CPU offload was estimated with 18.8 GB of them held (+94%)."""
    ranks = 4
    base = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 64,
            "model.n_head": 4, "model.block_size": 32, "train.batch_size": 2, "train.precision": "bf16",
            "parallel.dp_shard": ranks}
    alive, outputs = {}, {}
    for offload in (False, True):
        cfg = C.resolve(None, overrides={**base, "parallel.fsdp_cpu_offload": offload}, overrides_from_string=False)
        cfg = C.concrete(cfg, "cuda", True)
        plan, pieces = _plan(cfg, resolve_layout(cfg, ranks), 512, True, 0)
        tl = Step(pieces, plan).run(steps=1)
        alive[offload] = _gradients_alive_at(tl, "optimizer step")
        outputs[offload] = [e[2] for e in tl.ev if e[0] == "a" and e[4] == RS_STREAM]
    sharded = sum(_padded(p.shape, ranks) for p in plan.params) * 2 // ranks  # bf16 gradient shards, every group
    assert outputs[True] == outputs[False] and sum(outputs[False]) == sharded  # the same reduce-scatters
    assert alive[False] == sharded and alive[True] == 0
