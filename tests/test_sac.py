"""Selective activation checkpointing (``memory.activation_checkpointing_policy``): the op-level policy of
``model/build.py`` keeps the math bit for bit, keeps for backward more than whole-block checkpointing and
less than none, and the estimator and the trainer apply the same policy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

from conftest import tiny_cfg
from tokenmill import config as C
from tokenmill.errors import ConfigError
from tokenmill.model.build import apply_activation_checkpointing, build_gpt, save_matmuls_policy

V = 96
FAMILIES = {
    "gpt2": ("tiny", {}),
    "gpt2-manual-dropout": ("tiny", {"model.attention": "manual", "model.dropout": 0.1}),
    "llama": ("tiny-llama", {}),
    "llama-fused-dropout": ("tiny-llama", {"model.fused_qkv": True, "model.dropout": 0.1}),
}


def model_cfg(name: str) -> C.ModelConfig:
    preset, over = FAMILIES[name]
    return C.resolve(preset, overrides={"model.vocab_size": V, **over}, overrides_from_string=False).model


class Alive(TorchDispatchMode):
    """Every storage an operator returns (but those of ``outside``: parameters, the input), to count those
    still alive (kept for backward) after a forward."""

    def __init__(self, outside: list[torch.Tensor]):
        super().__init__()
        self.outside = {t.untyped_storage()._cdata for t in outside}
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.outside:
                st = t.untyped_storage()
                self.refs[st._cdata] = (StorageWeakRef(st), st.nbytes())
        return out

    def alive(self) -> int:
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def grads_and_loss(model, idx, seed: int = 3):
    torch.manual_seed(seed)  # the dropout masks: the same draws for every form
    loss = model(idx, idx)[1]
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("policy,every", [("full", 1), ("save-matmuls", 1), ("save-matmuls", 2)])
def test_selective_checkpointing_gives_bit_identical_gradients(family, policy, every):
    """On CPU in fp32 the loss and every gradient equal those without checkpointing exactly (dropout on:
    the recomputation draws the forward's masks), for GPT-2 and the Llama family."""
    cfg = model_cfg(family)
    torch.manual_seed(0)
    base = build_gpt(cfg, V, "cpu")
    idx = torch.randint(0, V, (2, cfg.block_size), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = grads_and_loss(copy.deepcopy(base), idx)
    loss, got = grads_and_loss(apply_activation_checkpointing(copy.deepcopy(base), every, policy), idx)
    assert torch.equal(loss, ref_loss)
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(got[k], ref[k])]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_saved_bytes_lie_between_full_checkpointing_and_none(family):
    """The bytes a block keeps for backward (storages alive after its forward, its output aside): 'full'
    keeps its input only, 'save-matmuls' also the outputs of its matrix products and attention (the
    element-wise intermediates are recomputed), no checkpointing keeps everything autograd saves."""
    cfg = model_cfg(family)
    torch.manual_seed(0)
    model = build_gpt(cfg, V, "cpu")
    x = torch.randn(4, cfg.block_size, cfg.n_embd, requires_grad=True)
    kept = {}
    for policy in (None, "save-matmuls", "full"):
        m = copy.deepcopy(model)
        rope = (m.rope_cos, m.rope_sin) if cfg.pos_emb == "rope" else None
        if policy:
            apply_activation_checkpointing(m, 1, policy)
        mode = Alive([x, *m.parameters(), *m.buffers()])
        with mode:
            y = m.blocks[0](x, rope)
        kept[policy] = mode.alive() - y.untyped_storage().nbytes()
        y.sum().backward()
    B, T, E = x.shape
    act = B * T * E * 4  # one (B, T, n_embd) fp32 activation
    assert kept["full"] == 0  # only the input, which is the caller's
    # the matmul outputs are at least q, k, v, the attention output, o, the MLP's hidden units and down
    assert kept["save-matmuls"] >= act * (2 + 1 + 1 + 1) + B * T * cfg.mlp_width * 4
    assert kept["full"] < kept["save-matmuls"] < kept[None]


def test_policy_saves_matmuls_and_attention_but_recomputes_random_attention():
    """Matrix products and fused attention are kept, element-wise ops recomputed; a fused attention with
    dropout is recomputed too (skipping its draws would shift every later dropout mask)."""
    aten = torch.ops.aten
    q = torch.zeros(1, 2, 4, 8)
    assert save_matmuls_policy(None, aten.mm.default, q[0, 0], q[0, 0].T) == CheckpointPolicy.MUST_SAVE
    assert save_matmuls_policy(None, aten.addmm.default, q, q, q) == CheckpointPolicy.MUST_SAVE
    assert save_matmuls_policy(None, aten._scaled_mm.default, q, q, q, q) == CheckpointPolicy.MUST_SAVE  # FP8
    assert save_matmuls_policy(None, aten.gelu.default, q) == CheckpointPolicy.PREFER_RECOMPUTE
    assert save_matmuls_policy(None, aten.native_dropout.default, q, 0.1, True) == CheckpointPolicy.PREFER_RECOMPUTE
    flash = aten._scaled_dot_product_flash_attention.default
    assert save_matmuls_policy(None, flash, q, q, q, 0.0, True) == CheckpointPolicy.MUST_SAVE
    assert save_matmuls_policy(None, flash, q, q, q, 0.1, True) == CheckpointPolicy.PREFER_RECOMPUTE
    eff = aten._scaled_dot_product_efficient_attention.default
    assert save_matmuls_policy(None, eff, q, q, q, None, True, dropout_p=0.2) == CheckpointPolicy.PREFER_RECOMPUTE
    cpu = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert save_matmuls_policy(None, cpu, q, q, q) == CheckpointPolicy.MUST_SAVE


@pytest.mark.slow
def test_the_trainer_applies_the_policy_and_keeps_the_losses(tmp_path):
    """Through the trainer (``train/parallelize.py``): the blocks are wrapped with the selective policy and
    the loss trajectory equals the run without checkpointing, exactly."""
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.trainer import Callbacks, train

    wrapped = []

    def seen(model):
        wrapped.append([getattr(b, "checkpoint_fn", None) for b in model.blocks])

    runs = {}
    for name, over in (("none", {}), ("sac", {"memory.activation_checkpointing": 1,
                                               "memory.activation_checkpointing_policy": "save-matmuls"})):
        cfg = tiny_cfg(**{"train.max_steps": 3, "log.every_steps": 1, "train.eval_batches": 0, **over})
        train(cfg, tmp_path / name, quiet=True, callbacks=Callbacks(on_model_built=seen))
        runs[name] = [r["loss"] for r in read_metrics(tmp_path / name) if r.get("loss") is not None]
    assert runs["sac"] == runs["none"] and len(runs["none"]) == 3
    assert wrapped[0] == [None, None]
    contexts = [fn.keywords.get("context_fn") for fn in wrapped[1]]  # functools.partial(checkpoint, ...)
    assert all(c is not None and c.args[0] is save_matmuls_policy for c in contexts)


def test_estimator_sees_the_policy_in_memory_and_recompute_time():
    """The estimator traces the policy (``estimate/trace.py`` applies ``apply_activation_checkpointing``):
    per-block activations and step time both lie between whole-block checkpointing and none."""
    from tokenmill.estimate import estimate

    def est(**over):
        cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic", "model.vocab_size": 50257,
                                                "train.batch_size": 8, **over}, overrides_from_string=False)
        return estimate(cfg, "h100-sxm")

    none = est()
    full = est(**{"memory.activation_checkpointing": 1})
    sel = est(**{"memory.activation_checkpointing": 1, "memory.activation_checkpointing_policy": "save-matmuls"})
    act = {k: list(e.activations_per_block_mb.values())[0] for k, e in (("none", none), ("full", full), ("sel", sel))}
    assert act["full"] < 0.1 * act["sel"] and act["sel"] < 0.8 * act["none"], act
    assert none.step_ms < sel.step_ms < full.step_ms
    assert none.peak_alloc_mb > sel.peak_alloc_mb > full.peak_alloc_mb


def test_policy_is_a_validated_choice():
    assert C.MemoryConfig().activation_checkpointing_policy == "full"
    with pytest.raises(ConfigError, match="save-matmuls"):
        C.resolve("tiny", overrides={"memory.activation_checkpointing_policy": "save-matmul"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("policy", ["full", "save-matmuls"])
def test_dropout_masks_survive_selective_checkpointing_on_cuda(policy):
    """On CUDA the fused attention kernels draw their dropout from the Philox stream: the policy recomputes a
    fused attention with dropout, so every mask of the recomputation is the forward's and the gradients equal
    those without checkpointing (bf16 autocast; the kernels' own summation order aside). A skipped attention
    would shift the residual dropouts' masks: an O(1) difference."""
    cfg = model_cfg("llama-fused-dropout")
    torch.manual_seed(0)
    base = build_gpt(cfg, V, "cuda")
    idx = torch.randint(0, V, (4, cfg.block_size), device="cuda")

    def run(model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return grads_and_loss(model, idx)

    ref_loss, ref = run(copy.deepcopy(base))
    loss, got = run(apply_activation_checkpointing(copy.deepcopy(base), 1, policy))
    assert torch.allclose(loss, ref_loss, rtol=1e-3)
    for k in ref:
        assert (got[k] - ref[k]).norm() <= 1e-2 * ref[k].norm() + 1e-6, k


@pytest.mark.slow
def test_selective_checkpointing_under_torch_compile():
    """Compiled per block (``apply_compile``, Inductor on the CPU) over the selective wrappers: the policy
    reaches the partitioner and the gradients stay those of the eager model without checkpointing."""
    from tokenmill.model.build import apply_compile

    cfg = model_cfg("llama")
    torch.manual_seed(0)
    base = build_gpt(cfg, V, "cpu")
    idx = torch.randint(0, V, (2, cfg.block_size), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = grads_and_loss(copy.deepcopy(base), idx)
    model = apply_activation_checkpointing(copy.deepcopy(base), 1, "save-matmuls")
    apply_compile(model, C.CompileConfig(enabled=True, scope="block"))
    loss, got = grads_and_loss(model, idx)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert got.keys() == ref.keys()  # compiled in place: the same parameter names
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=1e-5)


def test_the_compile_note_about_context_fn_is_dropped_and_nothing_else():
    """torch.compile logs a note for every checkpoint with a context_fn (save-matmuls, QLoRA's compiled product)
    that a user cannot act on: model/recompute.py drops that one record; the logger's other records still show."""
    import logging

    from tokenmill.model.recompute import quiet_context_fn_note

    quiet_context_fn_note()
    quiet_context_fn_note()  # idempotent: one filter
    log = logging.getLogger("torch._higher_order_ops.wrap")
    assert sum(type(f).__name__ == "_DropNote" for f in log.filters) == 1
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    try:
        log.warning("\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\nPlease ...")
        log.warning("something else")
    finally:
        log.removeHandler(handler)
    assert seen == ["something else"]
