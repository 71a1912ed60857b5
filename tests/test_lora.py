"""LoRA (``lora.*``, ``model/lora.py``): fresh adapters compute the base model exactly, only the adapters
train (no gradients or optimizer state for the base), the merge equals the adapter forward, checkpoints
resume exactly, the config refuses what cannot work, and the estimator, the pre-flight memory check and
the doctor count a frozen base. The command-line path (a Hugging Face Llama folder fine-tuned, sampled,
evaluated and exported) and DDP/FSDP are in ``tests/test_lora_cli.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_cfg
from tokenmill import config as C
from tokenmill.errors import ConfigError, TrainingError
from tokenmill.model.build import apply_lora, build_gpt, count_params, trainable_params
from tokenmill.model.gpt import adapt_state_dict
from tokenmill.model.lora import LoRALinear, merge_lora

V = 96
FAMILIES = {"gpt2": "tiny", "llama": "tiny-llama"}


def cfg_of(family: str, **over) -> C.Config:
    return C.resolve(FAMILIES[family], overrides={"model.vocab_size": V, "lora.rank": 4, **over},
                     overrides_from_string=False)


def ids(T: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def with_random_b(model):
    """Adapters moved off their zero start, as training would: B ~ N(0, 0.05), drawn from a seed of its
    block and role (the same values whatever module holds the role)."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, LoRALinear):
                for role, b in m.lora_B.items():
                    g = torch.Generator().manual_seed(100 * int(name.split(".")[1]) + C.LORA_ROLES.index(role))
                    b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("targets", ["all", "q,v", "o,down"])
def test_fresh_adapters_give_the_base_models_logits(family, fused, targets):
    """B = 0: the adapted model's logits are the base model's, bit for bit (the adapters add exact zeros)."""
    cfg = cfg_of(family, **{"model.fused_qkv": fused, "lora.targets": targets})
    torch.manual_seed(0)
    base = build_gpt(cfg.model, V, "cpu").eval()
    adapted = apply_lora(copy.deepcopy(base), cfg.lora)
    with torch.no_grad():
        assert torch.equal(adapted(ids())[0], base(ids())[0])
    roles = C.lora_roles(targets, cfg.model.mlp)
    got = {n.rsplit(".", 1)[-1] for n, p in adapted.named_parameters() if ".lora_A." in n}
    assert got == set(roles)
    assert all(p.abs().sum() > 0 for n, p in adapted.named_parameters() if ".lora_A." in n)  # A is drawn
    assert all(not p.any() for n, p in adapted.named_parameters() if ".lora_B." in n)  # B starts at 0
    # the base keeps its parameter names (checkpoints, init_from, export read them)
    assert set(base.state_dict()) < set(adapted.state_dict())


OPTIMIZERS = {"adamw": {}, "in-backward": {"memory.optimizer_in_backward": True, "optim.grad_clip": 0.0},
              "offload": {"memory.optimizer_offload": True}}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_only_the_adapters_train(family, kind):
    """One step of the run's own optimizer (AdamW, the step in backward, CPU offload): the base weights
    (embeddings, norms, head, biases, projections) are unchanged, have no gradient and no optimizer state;
    every adapter has state and has moved."""
    from tokenmill.optim import build_optimizer

    cfg = cfg_of(family, **OPTIMIZERS[kind])
    torch.manual_seed(0)
    base = build_gpt(cfg.model, V, "cpu")
    model = apply_lora(copy.deepcopy(base), cfg.lora)
    opt = build_optimizer(model, cfg)
    loss = model(ids(), ids(seed=2))[1]
    loss.backward()
    opt.step()
    before = dict(base.named_parameters())
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}  # (offload: the CPU masters)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad, name
        else:
            assert not p.requires_grad and p.grad is None and id(p) not in stepped, name
            assert torch.equal(p, before[name]), name
    assert all(p.any() for n, p in model.named_parameters() if ".lora_B." in n)  # B moved off 0
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == trainable_params(cfg.model, V, cfg.lora) < 0.3 * count_params(cfg.model, V)
    assert len(opt.state_dict()["per_parameter" if kind == "in-backward" else "state"]) == sum(
        ".lora_" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fused", [True, False])
def test_merged_weights_equal_the_adapter_forward(family, fused):
    """``merge_lora`` folds W + (alpha / r) B A into plain Linears: the same logits within 1e-5, a state
    dict with exactly the plain GPT's names and shapes, every parameter trainable again."""
    cfg = cfg_of(family, **{"model.fused_qkv": fused, "lora.targets": "q,v,o,up", "lora.alpha": 8.0})
    torch.manual_seed(0)
    plain = build_gpt(cfg.model, V, "cpu")
    model = with_random_b(apply_lora(copy.deepcopy(plain), cfg.lora)).eval()
    with torch.no_grad():
        want = model(ids())[0]
        merged = merge_lora(copy.deepcopy(model))
        got = merged(ids())[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert {k: v.shape for k, v in merged.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    assert all(p.requires_grad for p in merged.parameters())
    # the merge is W + (alpha / r) B A on the adapted rows only
    blk, pblk = model.blocks[0], plain.blocks[0]
    lin = blk.attn.c_attn if fused else blk.attn.q_proj
    q_rows = cfg.model.n_head * cfg.model.head_width
    delta = (merged.blocks[0].get_submodule("attn.c_attn" if fused else "attn.q_proj").weight
             - (pblk.attn.c_attn if fused else pblk.attn.q_proj).weight)
    want_q = (8.0 / 4) * lin.lora_B["q"] @ lin.lora_A["q"]
    torch.testing.assert_close(delta[:q_rows], want_q, atol=1e-6, rtol=0)
    if fused:  # k has no adapter (targets q,v,o,up): its rows are the base's exactly
        assert not delta[q_rows: q_rows + cfg.model.kv_heads * cfg.model.head_width].any()


def test_adapters_are_the_same_for_fused_and_separate_qkv():
    """The adapters are drawn in block and role order, so fused and separate q/k/v get the same A's from
    the same seed; with the same B's both layouts compute the same logits."""
    models = {}
    for fused in (True, False):
        cfg = cfg_of("llama", **{"model.fused_qkv": fused})
        torch.manual_seed(0)
        models[fused] = with_random_b(apply_lora(build_gpt(cfg.model, V, "cpu"), cfg.lora)).eval()
    for i in range(2):
        fa, fb = models[True].blocks[i].attn.c_attn, models[False].blocks[i].attn
        for role, lin in (("q", fb.q_proj), ("k", fb.k_proj), ("v", fb.v_proj)):
            assert torch.equal(fa.lora_A[role], lin.lora_A[role]) and torch.equal(fa.lora_B[role], lin.lora_B[role])
    with torch.no_grad():
        torch.testing.assert_close(models[True](ids())[0], models[False](ids())[0], atol=1e-6, rtol=0)
    merged = {f: merge_lora(copy.deepcopy(m)) for f, m in models.items()}
    sep = adapt_state_dict(merged[True].state_dict(), merged[False])  # fused -> separate q/k/v
    assert all(torch.equal(sep[k], v) for k, v in merged[False].state_dict().items())


def test_config_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="'qv' is not a projection.*Did you mean"):
        tiny_cfg(**{"lora.rank": 4, "lora.targets": "q,qv"})
    with pytest.raises(ConfigError, match="GELU MLP.*no gate"):
        tiny_cfg(**{"lora.rank": 4, "lora.targets": "q,gate"})
    with pytest.raises(ConfigError, match="not with parallel.tp or parallel.pp"):
        tiny_cfg(**{"lora.rank": 4, "parallel.tp": 2, "model.fused_qkv": False})
    with pytest.raises(ConfigError, match="not with parallel.tp or parallel.pp"):
        tiny_cfg(**{"lora.rank": 4, "parallel.pp": 2, "model.tie_embeddings": False})
    with pytest.raises(ConfigError, match="lora.rank must be >= 0"):
        tiny_cfg(**{"lora.rank": -1})
    if "train.fp8" in C.field_specs():
        with pytest.raises(ConfigError, match="does not combine with train.fp8"):
            tiny_cfg(**{"lora.rank": 4, "train.fp8": "tensorwise"})
    assert C.lora_roles("all", "gelu") == ("q", "k", "v", "o", "up", "down")
    assert C.lora_roles("all", "swiglu", experts=True) == C.LORA_ROLES  # a mixture of experts: 'experts' too
    assert C.lora_roles("all", "swiglu") == tuple(r for r in C.LORA_ROLES if r != "experts")
    assert C.lora_roles(" v , q ", "gelu") == ("q", "v")


def _losses(run) -> list[float]:
    from tokenmill.train.metrics import read_metrics

    return [r["loss"] for r in read_metrics(run) if r.get("loss") is not None]


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_loads_merged(tmp_path):
    """A LoRA run's checkpoints hold base and adapters: a resume from the step-3 checkpoint continues
    bit-exactly; a different rank is refused naming the flags; load_model (sample, eval, export) gives the
    merged plain GPT, with the adapter forward's logits."""
    import shutil

    from tokenmill import checkpoint
    from tokenmill.train.trainer import train

    over = {"lora.rank": 4, "lora.alpha": 8.0, "train.max_steps": 6, "checkpoint.every_steps": 3,
            "checkpoint.keep_last": 3, "log.every_steps": 1, "train.eval_batches": 0, "optim.lr": 1e-2}
    summary = train(tiny_cfg(**over), tmp_path / "run", quiet=True)
    assert summary["trainable_params"] == trainable_params(tiny_cfg().model, 64, tiny_cfg(**over).lora)
    state = checkpoint.read_state(tmp_path / "run" / "checkpoints" / "step_00000006.pt")
    assert any(".lora_B." in k for k in state["model"]) and state["config"]["lora"]["rank"] == 4
    assert len(state["optimizer"]["state"]) == sum(".lora_" in k for k in state["model"])  # adapters only

    shutil.copytree(tmp_path / "run", tmp_path / "cut")
    (tmp_path / "cut" / "checkpoints" / "step_00000006.pt").unlink()
    train(tiny_cfg(**over), tmp_path / "cut", resume=True, quiet=True)
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "run")
    with pytest.raises(TrainingError, match="LoRA rank 4 on q,k,v,o,up,down, this config rank 8.*--lora.rank 4"):
        train(tiny_cfg(**{**over, "lora.rank": 8, "train.max_steps": 9}), tmp_path / "run", resume=True, quiet=True)
    with pytest.raises(TrainingError, match="this config no adapters"):
        train(tiny_cfg(**{**over, "lora.rank": 0, "train.max_steps": 9}), tmp_path / "run", resume=True, quiet=True)

    model, cfg, _ = checkpoint.load_model(tmp_path / "run")
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    adapted = apply_lora(build_gpt(cfg.model, 64, "cpu"), cfg.lora, init=False)
    adapted.load_state_dict(state["model"])
    with torch.no_grad():
        x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(model.eval()(x)[0], adapted.eval()(x)[0], atol=1e-5, rtol=0)


def test_preflight_memory_check_counts_a_frozen_base():
    """check_fits' lower bound of the training state: gradients and AdamW moments of the adapters only."""
    from tokenmill.parallel.world import World
    from tokenmill.train.advice import oom_message, state_bytes

    cfg = C.resolve("llama3.2-1b", overrides={"lora.rank": 16, "train.precision": "bf16"})
    n, t = count_params(cfg.model, 128256), trainable_params(cfg.model, 128256, cfg.lora)
    world = World(device=torch.device("cuda"))
    full, _ = state_bytes(cfg, n, world)
    lora, _ = state_bytes(cfg, n, world, t)
    assert full == n * (2 + 2 + 4) and lora == n * 2 + t * (2 + 4)
    ft = C.resolve("tiny", overrides={"train.init_from": "models/x"})
    assert "--lora.rank 16" in oom_message(ft, torch.device("cpu"), RuntimeError("CUDA out of memory"))
    assert "--lora.rank" not in oom_message(tiny_cfg(), torch.device("cpu"), RuntimeError("CUDA out of memory"))


def test_estimator_counts_no_gradients_or_state_for_the_frozen_base():
    """``estimate`` traces the adapted model: gradients and AdamW state of the adapters only (2 x fp32 per
    trainable parameter), the base's weights in full, and no weight-gradient matmuls for the base."""
    from tokenmill.estimate import estimate

    def est(**over):
        cfg = C.resolve("llama3.2-1b", overrides={"model.block_size": 1024, "train.batch_size": 1,
                                                  "model.loss_impl": "chunked", "data.source": "synthetic",
                                                  "model.vocab_size": 128256, **over}, overrides_from_string=False)
        return estimate(cfg, "h100-sxm"), cfg

    (full, _), (lora, cfg) = est(), est(**{"lora.rank": 16})
    t = trainable_params(cfg.model, 128256, cfg.lora)
    mb = 1024 * 1024
    assert lora.breakdown_mb["optimizer state"] == pytest.approx(2 * 4 * t / mb, rel=0.02)
    assert full.breakdown_mb["optimizer state"] == pytest.approx(2 * 4 * full.params / mb, rel=0.02)
    assert lora.breakdown_mb["parameters"] == pytest.approx((full.params + t) * 4 / mb, rel=0.02)
    assert lora.peak_reserved_mb < 0.7 * full.peak_reserved_mb
    assert any(f"LoRA rank 16: {t:,} trainable parameters" in n for n in lora.notes)
    # backward computes no weight gradients for the base: a block's backward matmuls are its input gradients
    # (plus the adapters' small ones), about half of a full backward; the chunked head's, two thirds
    from tokenmill.estimate.trace import trace_pieces

    def flops(c, piece):
        p = trace_pieces(c, 128256, "cuda")
        rnd = (p.blocks["plain"] if piece == "block" else p.head).rounds[0]
        return sum(x.flops for x in rnd.fwd_costs + rnd.bwd_costs)

    full_cfg = est()[1]
    assert 0.6 < flops(cfg, "block") / flops(full_cfg, "block") < 0.72  # (1 + 1) / (1 + 2), adapters aside
    assert flops(cfg, "head") / flops(full_cfg, "head") == pytest.approx(2 / 3, rel=1e-3)


def test_memory_advice_offers_lora_to_a_full_finetune():
    """The estimator's advice (out-of-memory messages, the doctor) names LoRA for a fine-tune that does not fit."""
    from tokenmill.estimate import memory_advice

    over = {"model.block_size": 1024, "train.batch_size": 2, "model.loss_impl": "chunked", "data.source": "synthetic",
            "model.vocab_size": 128256, "memory.activation_checkpointing": 1}
    ft = C.resolve("llama3.2-1b", overrides={**over, "train.init_from": "models/llama-3.2-1b"},
                   overrides_from_string=False)
    assert "--lora.rank 16" in memory_advice(ft, "l4")
    scratch = C.resolve("llama3.2-1b", overrides=over, overrides_from_string=False)
    assert "--lora.rank" not in memory_advice(scratch, "l4")


@pytest.mark.slow
def test_estimate_finetune_says_which_gpu_fits_with_lora_and_without(capsys):
    """``tokenmill estimate --finetune``: a line per GPU; Llama 3.2 1B at 2 x 2048 without the fine-tuning recipe's
    bf16 base and checkpointing needs about 27 GB as a full fine-tune (not a 24 GB GPU), about 16 GB with LoRA (it
    fits one)."""
    from tokenmill.cli import main

    assert main(["estimate", "--preset", "llama3.2-1b", "--model.block_size", "2048", "--train.batch_size", "2",
                 "--model.loss_impl", "chunked", "--train.precision", "bf16-autocast",
                 "--memory.activation_checkpointing", "0", "--finetune"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ") and "GB" in line}
    assert set(rows) == {"l4", "rtx-4090", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200"}
    assert rows["rtx-4090"][5] == "no" and rows["rtx-4090"][8] == "fits"  # 24 GB: LoRA only
    assert rows["a100-40gb"][5] == "fits"
    assert "LoRA: rank 16, alpha 16 on q,k,v,o,gate,up,down" in out
    assert "a full fine-tune: the smallest GPU that fits is a100-40gb" in out
    assert "LoRA: the smallest GPU that fits is l4" in out


def _facts(**config) -> dict:
    return {"config": {"train.precision": "bf16-autocast", "model.vocab_size": 50257, "train.batch_size": 8,
                       **config},
            "device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "device_total_mb": 24_000.0,
            "peak_reserved_mb": 22_000.0, "step_ms": 400.0}


def test_doctor_names_lora_where_a_full_finetune_fills_the_gpu():
    from tokenmill.profiling import rules

    f = _facts(**{"train.init_from": "models/gpt2-medium", "model.n_layer": 24, "model.n_head": 16,
                  "model.n_embd": 1024})
    found = rules.lora_finetune(f)
    assert found is not None and found.measure == "memory"
    assert found.suggestions[0]["switch"] == "--lora.rank 16"
    assert "fills 92% of the GPU" in found.evidence[0] and "GB peak reserved of 23.4 GB" in found.evidence[1]
    assert rules.lora_finetune({**f, "peak_reserved_mb": 10_000.0}) is None  # memory not tight
    assert rules.lora_finetune(_facts(**{"model.n_layer": 24})) is None  # not a fine-tune
    assert rules.lora_finetune({**f, "config": {**f["config"], "lora.rank": 8}}) is None  # already LoRA
    assert rules.lora_finetune({**f, "device": "cpu"}) is None


def test_doctor_names_selective_checkpointing_where_it_fits():
    from tokenmill.profiling import rules

    f = {**_facts(**{"memory.activation_checkpointing": 1}), "device_total_mb": 16_000.0,
         "peak_reserved_mb": 13_000.0, "recompute_ms": 100.0, "recompute_share": 0.25}
    found = rules.selective_recompute(f)
    assert found is not None and found.suggestions[0]["switch"] == "--memory.activation_checkpointing_policy save-matmuls"
    assert found.score > 0.05 and "selective policy is" in found.evidence[1]
    assert rules.selective_recompute({**f, "device_total_mb": 7_000.0, "peak_reserved_mb": 6_500.0}) is None  # no room
    on = {**f, "config": {**f["config"], "memory.activation_checkpointing_policy": "save-matmuls"}}
    assert rules.selective_recompute(on) is None
    assert rules.selective_recompute({**f, "peak_reserved_mb": 8_000.0}) is None  # not tight: activation_recompute's
