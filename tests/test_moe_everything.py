"""The rest of tokenmill on a mixture of experts (model/moe.py), each against a reference: Muon (the router
to AdamW, every expert's matrix orthogonalised on its own), selective activation checkpointing, evaluation,
and fine-tuning on chat data with a loss mask (padded and packed windows). Tiny models: 2 layers, width 32,
4 experts, top-2, T 16 (32 for chat windows)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenmill import config as C
from tokenmill.model import GPT
from tokenmill.model.moe import MoE, router_loss

V = 64
NS = (3.4445, -4.7750, 2.0315)


def moe_cfg(**kw) -> C.ModelConfig:
    return C.ModelConfig(**{"vocab_size": V, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, "pos_emb": "rope",
                            "norm_type": "rmsnorm", "mlp": "swiglu", "bias": False, "qkv_bias": False,
                            "tie_embeddings": False, "fused_qkv": False, "dropout": 0.0, "moe_experts": 4,
                            "moe_top_k": 2, "moe_intermediate_size": 16, "moe_aux_loss_coef": 0.01,
                            "moe_z_loss_coef": 0.001, **kw})


def moe_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(moe_cfg(**kw), V)


def ids(seed: int = 1, T: int = 16) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# Muon


def muon_reference(w: torch.Tensor, g: torch.Tensor, lr: float, mu: float, wd: float) -> torch.Tensor:
    """One Muon step of the single matrix ``w`` from a zero momentum buffer, in float64, from the published
    rule: B = (1 - mu) G, U = (1 - mu) G + mu B, five quintic Newton-Schulz steps on U / ||U|| (transposed
    if tall), W (1 - lr wd) - lr sqrt(max(1, rows / cols)) O."""
    a, b, c = NS
    x = (1 - mu) * g + mu * (1 - mu) * g
    tall = x.size(0) > x.size(1)
    x = (x.T if tall else x) / x.norm()  # (no epsilon: the gradients here are small but never zero)
    for _ in range(5):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    x = x.T if tall else x
    return w * (1 - lr * wd) - lr * math.sqrt(max(1.0, w.size(0) / w.size(1))) * x


def test_muon_router_to_adamw_and_each_expert_on_its_own():
    """optim.name='muon' on a MoE: the routers go to AdamW (gates, like the head), the expert stacks to Muon;
    after one step each expert's gate, up and down matrix moved exactly as Muon moves that matrix alone
    (float64 Newton-Schulz against the float64 reference, 1e-10), not as one flattened stack."""
    from tokenmill.optim import build_optimizer

    model = moe_gpt().double()  # float64 throughout: Newton-Schulz magnifies fp32 rounding of its input
    cfg = C.Config()
    cfg.optim = C.OptimConfig(name="muon", muon_lr=0.05, muon_momentum=0.9, muon_weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert {"blocks.0.mlp.router.weight", "blocks.1.mlp.router.weight", "wte.weight", "lm_head.weight"} <= adamw
    assert {"blocks.0.mlp.experts.gate_up", "blocks.1.mlp.experts.down", "blocks.0.attn.q_proj.weight"} <= muon
    assert not muon & adamw and muon | adamw == set(names.values())
    opt.muon.ns_dtype = torch.float64
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    model(ids(), ids(2))[1].backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    opt.step()
    width = 16
    for layer in (0, 1):
        for name, splits in (("gate_up", (slice(0, width), slice(width, 2 * width))), ("down", (slice(None),))):
            key = f"blocks.{layer}.mlp.experts.{name}"
            got = model.get_parameter(key).detach().double()
            for e in range(4):
                for rows in splits:
                    want = muon_reference(before[key][e, rows], grads[key][e, rows], 0.05, 0.9, 0.1)
                    torch.testing.assert_close(got[e, rows], want, atol=1e-10, rtol=0)
    # and the flattened stack would have moved differently: the per-expert rule is what ran
    key = "blocks.0.mlp.experts.down"
    flat = muon_reference(before[key].reshape(-1, width), grads[key].reshape(-1, width), 0.05, 0.9, 0.1).reshape(4, 32, width)
    assert (model.get_parameter(key).detach().double() - flat).abs().max() > 1e-3


def test_muon_stack_equals_torch_muon_per_expert_in_bf16():
    """The default bf16 Newton-Schulz on a stack (batched over experts) against torch.optim.Muon stepping
    each expert's matrix alone (bf16 too): equal within bf16 rounding of the update (lr x 1e-2)."""
    from tokenmill.optim.muon import Muon

    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is PyTorch >= 2.9")
    torch.manual_seed(3)
    stack = torch.nn.Parameter(torch.randn(4, 24, 40))
    alone = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(4)]
    ours = Muon([stack], lr=0.05, momentum=0.9, weight_decay=0.05)
    ref = torch.optim.Muon(alone, lr=0.05, momentum=0.9, weight_decay=0.05)
    for _ in range(2):
        g = torch.randn(4, 24, 40)
        stack.grad = g.clone()
        for e, p in enumerate(alone):
            p.grad = g[e].clone()
        ours.step()
        ref.step()
    for e, p in enumerate(alone):
        torch.testing.assert_close(stack.detach()[e], p.detach(), atol=0.05 * 1e-2, rtol=0)


# ----------------------------------------------------------------------------------------------
# selective activation checkpointing


@pytest.mark.parametrize("policy", ["save-matmuls"])
def test_selective_checkpointing_keeps_loss_and_gradients(policy):
    """Blocks checkpointed with the selective policy (the grouped expert products and router statistics
    recomputed in backward) give the uncheckpointed loss (router losses included) and gradients, 1e-6."""
    from tokenmill.model.build import apply_activation_checkpointing

    x, y = ids(), ids(2)
    out = []
    for every in (0, 1):
        model = apply_activation_checkpointing(moe_gpt(moe_impl="grouped"), every, policy)
        _, loss = model(x, y)
        loss.backward()
        out.append((loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                                    for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = out
    torch.testing.assert_close(l1, l0, atol=1e-6, rtol=0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=0, msg=n)


# ----------------------------------------------------------------------------------------------
# evaluation


def test_eval_is_the_cross_entropy_without_router_losses():
    """evaluate_model on a MoE (router loss coefficients on): the mean cross-entropy of the logits by hand,
    masked or not (1e-6); training mode adds the router losses on top, evaluation does not."""
    from tokenmill.train.evaluate import evaluate_model

    model = moe_gpt()
    batches = [(ids(s), ids(s + 10)) for s in range(3)]
    masked = [(x, y.masked_fill(torch.arange(16) % 3 == 0, -100)) for x, y in batches]
    with torch.no_grad():
        model.eval()
        nats = [F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="sum", ignore_index=-100)
                for x, y in masked]
        plain = sum(F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="sum") for x, y in batches)
        model.train()
        x, y = batches[0]
        train_loss = model(x, y)[1]
        ce = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
        extra = router_loss(model, y)
    assert float(extra) > 0 and float(train_loss) == pytest.approx(float(ce + extra), abs=1e-6)
    got = evaluate_model(model, batches)
    assert got["val_loss"] == pytest.approx(float(plain) / (3 * 32), abs=1e-6)
    got = evaluate_model(model, masked, masked=True)
    learned = sum(int((y != -100).sum()) for _, y in masked)
    assert got["tokens"] == learned and got["val_loss"] == pytest.approx(float(sum(nats)) / learned, abs=1e-6)
    assert model.training  # left as it was
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)


# ----------------------------------------------------------------------------------------------
# fine-tuning on chat data (data.loss_mask), padded and packed windows

T_CHAT = 32


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A chat folder prepared with the small Llama 3 tokenizer of tests/test_chat_prepare.py (as
    tests/test_sft_train.py prepares it)."""
    pytest.importorskip("transformers")
    from test_chat_prepare import TEMPLATES, _build
    from test_sft_train import conversations, write_jsonl
    from tokenmill.data.chat import ChatTemplate
    from tokenmill.data.chat_prepare import prepare_chat

    d = tmp_path_factory.mktemp("moe-sft")
    tok = _build("llama3", d / "model", (TEMPLATES / "llama3.jinja").read_text())
    return prepare_chat(write_jsonl(d / "chats.jsonl", conversations(24)), d / "data", ChatTemplate(tok), workers=1,
                        progress=False, val_fraction=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["pad", "pack"])
def test_chat_fine_tuning_loss_is_the_learned_token_mean_plus_router_losses(chat_folder, tmp_path, packing):
    """One step of a tiny MoE on chat windows (2 micro-batches of 2): the logged loss is, by hand on the
    model before its step, (sum over micro-batches of the learned targets' summed cross-entropy plus that
    micro-batch's router losses x its learned-token count) / the global batch's learned tokens (1e-6), and
    the optimizer gets that objective's gradients (1e-6)."""
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.trainer import Callbacks, train

    seen: dict = {}

    def reference(trainer):
        model, ds = trainer.model, trainer.data.train
        x, y = (torch.stack(v).long() for v in zip(*(ds[k] for k in range(4))))
        params = [p for p in model.parameters() if p.requires_grad]
        total, learned = 0.0, (y != -100).sum()
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            logits = model(xm)[0]  # training mode: the routing statistics of this micro-batch
            ce = F.cross_entropy(logits.flatten(0, 1), ym.flatten(), ignore_index=-100, reduction="sum")
            total = total + ce + router_loss(model, ym) * (ym != -100).sum()
        loss = total / learned
        seen.update(loss=loss.item(), params=params, grads=torch.autograd.grad(loss, params),
                    partial=bool(((y == -100).sum(1) > 0).all()))

    def on_optimizer(opt):
        opt.register_step_pre_hook(lambda *_: seen.update(got=[p.grad.detach().clone() for p in seen["params"]]))

    cfg = C.resolve("tiny-moe", overrides_from_string=False, overrides={
        "data.source": "tokens", "data.path": str(chat_folder), "data.chat_packing": packing, "model.vocab_size": None,
        "model.block_size": T_CHAT, "model.dropout": 0.0, "model.moe_aux_loss_coef": 0.01,
        "model.moe_z_loss_coef": 0.001, "train.device": "cpu", "train.precision": "fp32", "train.tf32": False,
        "train.max_steps": 1, "train.batch_size": 2, "train.grad_accum_steps": 2, "train.eval_batches": 0,
        "optim.grad_clip": 0.0, "checkpoint.save_final": False, "log.progress": "plain", "log.tensorboard": False,
        "log.every_steps": 1})
    train(cfg, tmp_path / "run", quiet=True,
          callbacks=Callbacks(on_optimizer_built=on_optimizer, on_train_start=reference))
    row = [r for r in read_metrics(tmp_path / "run") if "loss" in r][0]
    assert seen["partial"] and row["moe_aux_loss"] > 0  # learned and masked targets in every window; routed
    assert row["loss"] == pytest.approx(seen["loss"], rel=1e-6, abs=0)
    for g, r in zip(seen["got"], seen["grads"]):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# tensor parallelism: attention split by heads, the experts replicated

TP_CFG = {"data.source": "synthetic", "model.vocab_size": V, "train.device": "cpu", "train.precision": "fp32",
          "train.tf32": False, "log.progress": "plain", "log.tensorboard": False, "train.max_steps": 4,
          "log.every_steps": 1, "train.eval_batches": 0, "model.moe_z_loss_coef": 0.001, "checkpoint.save_final": False}
TP_FLAGS = ["--preset", "tiny-moe", *(a for k, v in TP_CFG.items()
                                      for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)))]


def two_rank_jobs(tmp) -> list[dict]:
    """The tensor-parallel tiny-moe run on 2 gloo processes, trained in the shared 2-rank launch
    (conftest.two_rank_launch: one launch's imports for several files)."""
    return [{"preset": "tiny-moe", "cfg": {**TP_CFG, "parallel.tp": 2}, "run_dir": str(tmp / "tp")}]


@pytest.mark.slow
def test_tensor_parallel_moe_equals_one_process_through_the_cli(two_rank_launch, tmp_path):
    """``parallel.tp=2`` on tiny-moe, 2 gloo processes (the shared torchrun launch): the attention splits by heads,
    the router and experts are replicated; 4 steps give the losses of one process run through the command line
    (``tokenmill train``, the same config but tp; router losses included) within 1e-5 relative, and the same
    expert-load numbers."""
    from tokenmill.cli import main
    from tokenmill.train.metrics import read_metrics

    runs = {"tp": two_rank_launch / "moe" / "tp", "one": tmp_path / "one"}
    assert main(["train", *TP_FLAGS, "--run-dir", str(runs["one"])]) == 0
    saved = {k: C.load_toml(r / "config.toml") for k, r in runs.items()}
    assert (saved["tp"]["parallel"].pop("tp"), saved["one"]["parallel"].pop("tp")) == (2, 1)
    assert saved["tp"] == saved["one"]  # the same run but tp
    rows = {k: [x for x in read_metrics(r) if "loss" in x] for k, r in runs.items()}
    assert len(rows["tp"]) == len(rows["one"]) == 4
    for a, b in zip(rows["tp"], rows["one"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=0)
        assert a["moe_load_max"] == pytest.approx(b["moe_load_max"], abs=1e-4) and a["moe_aux_loss"] > 0


# ----------------------------------------------------------------------------------------------
# FP8: the dense linears in FP8, routing and the routed experts in high precision


def test_fp8_converts_the_dense_linears_and_leaves_routing_and_experts():
    """train.fp8 (torchao, emulated on CPU) on a MoE with shared experts: attention and the shared experts'
    Linears become Float8Linear, the router and the routed experts' stacks are untouched; loss within 1% of
    the bf16 model's, every converted linear's gradient within 15% (relative Frobenius: e4m3's 3 mantissa bits,
    as tests/test_fp8.py), the experts' too."""
    import copy
    import dataclasses

    pytest.importorskip("torchao", reason="torchao is not installed")
    from tokenmill.model.fp8 import apply_fp8

    torch.manual_seed(0)
    ref = GPT(moe_cfg(moe_shared_experts=1), V).to(torch.bfloat16)
    f8 = apply_fp8(copy.deepcopy(ref), dataclasses.replace(C.TrainConfig(), fp8="tensorwise"), C.ParallelConfig(),
                   torch.device("cpu"), emulate=True)
    kinds = {n: type(m).__name__ for n, m in f8.named_modules()}
    assert kinds["blocks.0.attn.q_proj"] == kinds["blocks.1.mlp.shared.c_proj"] == "Float8Linear"
    assert kinds["blocks.0.mlp.router"] == "Linear" and kinds["blocks.0.mlp.experts"] == "Experts"
    x = torch.randint(0, V, (4, 32))
    losses = []
    for m in (ref, f8):
        loss = m(x, x)[1]
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-2 * losses[0] and losses[0] != losses[1]
    grads = dict(ref.named_parameters())
    for n, q in f8.named_parameters():
        if n.startswith("blocks.") and ("experts" in n or kinds.get(n.rsplit(".", 1)[0]) == "Float8Linear"):
            p = grads[n].grad.float()
            assert ((p - q.grad.float()).norm() / p.norm()).item() < 0.15, n
