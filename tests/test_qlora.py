"""QLoRA (``lora.quantize_base = 'nf4'``, ``model/lora.py``): the frozen weight of every block projection
(adapted or not) is stored as torchao's NF4 and dequantised in the forward. Fresh adapters compute the NF4-dequantised base
exactly; only the adapters train; the stored base is about 4.1 bits per weight; state dicts hold the NF4 base
exactly (plain tensors); the config refuses what cannot work and a missing torchao is named. The command line
(a Llama folder fine-tuned, resumed exactly, exported merged into the dequantised base) is marked slow."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from conftest import block_import
from tokenmill import config as C
from tokenmill.errors import ConfigError
from tokenmill.model.build import apply_lora, apply_precision, build_gpt
from tokenmill.model.lora import LoRALinear, merge_lora, nf4_bytes, nf4_weights

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="QLoRA needs torchao (`pip install torchao`)")
V = 96
# measured (the presets' init, seeds 0-2; logits up to 0.4-0.7): the largest |logit| difference between the
# NF4 base and the unquantised one is 0.016-0.017 for tiny-llama and 0.018-0.026 for tiny (GPT-2)
QUANT_ATOL = 0.05


def cfg_of(preset: str = "tiny-llama", **over) -> C.Config:
    return C.resolve(preset, overrides={"model.vocab_size": V, "lora.rank": 8, "lora.quantize_base": "nf4", **over},
                     overrides_from_string=False)


def ids(T: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def logits(m, x):
    with torch.no_grad():
        return m.eval()(x)[0]


def qlora_and_base(cfg: C.Config):
    torch.manual_seed(0)
    base = build_gpt(cfg.model, V, "cpu")
    return apply_lora(copy.deepcopy(base), cfg.lora), base


def nf4_modules(model) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def dequantised_copy(qlora, base):
    """``base`` with every weight ``qlora`` holds as NF4 replaced by its dequantised copy."""
    deq = copy.deepcopy(base)
    names = {m: n for n, m in qlora.named_modules()}
    with torch.no_grad():
        for m in nf4_modules(qlora):
            deq.get_submodule(names[m]).weight.copy_(m.weight.get_original_weight())
    return deq


@needs_torchao
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
def test_fresh_adapters_give_the_dequantised_base(preset):
    """B = 0: the QLoRA model's logits equal (1e-5) those of the plain model whose adapted weights are
    replaced by their dequantised NF4 copies, and are within QUANT_ATOL of the unquantised model."""
    qlora, base = qlora_and_base(cfg_of(preset))
    mods = nf4_modules(qlora)
    assert len(mods) == 2 * (7 if preset == "tiny-llama" else 4)  # 2 blocks; GPT-2: fused q/k/v, o, up, down
    assert all(type(m.weight).__name__ == "NF4Tensor" and not m.weight.requires_grad for m in mods)
    deq = dequantised_copy(qlora, base)
    x = ids()
    got = logits(qlora, x)
    torch.testing.assert_close(got, logits(deq, x), atol=1e-5, rtol=0)
    diff = (got - logits(base, x)).abs().max().item()
    assert 1e-4 < diff < QUANT_ATOL  # quantised (not the base itself), but close to it


@needs_torchao
def test_every_block_projection_is_nf4_not_only_the_adapted_ones():
    """With adapters on q and v only, k, o, gate, up and down are NF4 too (QLoRA quantises every Linear of the
    blocks; the head and embeddings stay), without adapters; the logits equal the plain model holding the
    dequantised weights; nf4_weights (the estimator's list) names exactly the model's NF4 weights; a
    checkpoint holding k in bf16 (an unquantised base) loads into it quantised."""
    qlora, base = qlora_and_base(cfg_of(**{"lora.targets": "q,v"}))
    mods = nf4_modules(qlora)
    assert len(mods) == 2 * 7 and all(type(m.weight).__name__ == "NF4Tensor" for m in mods)
    assert sorted(r for m in mods for r in m.lora_A) == ["q", "q", "v", "v"]
    assert type(qlora.lm_head.weight) is torch.nn.Parameter and qlora.lm_head.weight.dtype == torch.float32
    assert nf4_weights(qlora) == [(m.weight.numel(), 4) for m in mods]
    deq = dequantised_copy(qlora, base)
    x = ids()
    torch.testing.assert_close(logits(qlora, x), logits(deq, x), atol=1e-5, rtol=0)
    sd = qlora.state_dict()
    assert sd["blocks.0.attn.k_proj.weight"].dtype == torch.uint8 and "blocks.0.attn.k_proj.weight_nf4_scales" in sd
    old = {k: v for k, v in sd.items() if not k.startswith("blocks.0.attn.k_proj.weight")}
    old["blocks.0.attn.k_proj.weight"] = base.blocks[0].attn.k_proj.weight.detach().clone()
    fresh = apply_lora(build_gpt(cfg_of().model, V, "cpu"), cfg_of(**{"lora.targets": "q,v"}).lora, init=False)
    fresh.load_state_dict(old)  # strict: the scales' keys may be absent beside a full-precision weight
    assert torch.equal(fresh.blocks[0].attn.k_proj.weight.quantized_data,
                       qlora.blocks[0].attn.k_proj.weight.quantized_data)


def _saved_and_grads(cfg: C.Config, compiled: bool, device: str = "cpu"):
    """The shapes a block's forward saves for backward beyond the model's own tensors (parameters, NF4 parts),
    and the gradients of the adapters and the input."""
    torch.manual_seed(0)
    m = apply_lora(build_gpt(cfg.model, V, device), cfg.lora)
    blk, rope = m.blocks[0], (m.rope_cos, m.rope_sin)
    own = {t.untyped_storage().data_ptr() for p in m.parameters() for t in
           ((p.quantized_data, p.quantized_scalers, p.quantization_factor, p.scaler_mean, p.nf4)
            if type(p).__name__ == "NF4Tensor" else (p,))}
    x = torch.randn(2, 32, cfg.model.n_embd, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    fn = torch.compile(lambda h: blk(h, rope)) if compiled else (lambda h: blk(h, rope))
    saved = []

    def pack(t):
        if type(t).__name__ != "NF4Tensor" and t.untyped_storage().data_ptr() not in own:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    y.square().sum().backward()
    return saved, [p.grad for p in blk.parameters() if p.requires_grad] + [x.grad]


def _compiled_keeps_no_weight(device: str, atol: float) -> None:
    over = {"lora.targets": "q,v", "model.n_embd": 128, "model.intermediate_size": 384, "model.n_head": 4,
            "model.n_kv_head": 4}
    _, want = _saved_and_grads(cfg_of(**over), compiled=False, device=device)
    saved, got = _saved_and_grads(cfg_of(**over), compiled=True, device=device)
    weights = {(128, 128), (384, 128), (128, 384)}  # q, k, v, o; gate, up; down (the activations: 64 rows)
    assert saved and not weights & set(saved), saved
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


@needs_torchao
@pytest.mark.slow
def test_compiled_qlora_keeps_no_dequantised_weight():
    """Compiled, the NF4 products dequantise again in backward (model/nf4.py nf4_linear): the block saves no
    tensor of a projection weight's shape (AOTAutograd's partitioner would otherwise keep each dequantised
    weight: the whole base at full width from forward to backward), and its gradients are the eager QLoRA
    block's (1e-5)."""
    _compiled_keeps_no_weight("cpu", 1e-5)


@needs_torchao
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_compiled_qlora_keeps_no_dequantised_weight_on_cuda():
    """The same on CUDA (Inductor's Triton kernels, torchao's NF4 on the GPU): no dequantised weight saved, the
    eager gradients within 1e-4 (fp32; Inductor reorders sums)."""
    _compiled_keeps_no_weight("cuda", 1e-4)


@needs_torchao
def test_only_the_adapters_train_and_the_base_stays_nf4():
    """A training step (AdamW over the parameters that require gradients) changes the adapters only: the
    NF4 codes and scales, norms and embeddings are bit-identical afterwards; a bf16 cast keeps the base NF4."""
    qlora, _ = qlora_and_base(cfg_of())
    before = copy.deepcopy(qlora.state_dict())
    params = [p for p in qlora.parameters() if p.requires_grad]
    assert params and all(".lora_" in n for n, p in qlora.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=1e-2)
    x = ids()
    _, loss = qlora.train()(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    after = qlora.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert {k for k in before if ".lora_B." in k} <= changed  # every B moved off zero
    apply_precision(qlora, C.TrainConfig(precision="bf16"))
    assert all(type(m.weight).__name__ == "NF4Tensor" for m in nf4_modules(qlora))
    assert qlora.blocks[0].attn.q_proj.lora_A["q"].dtype == torch.bfloat16


@needs_torchao
def test_nf4_base_is_about_4_bits_per_weight():
    """The stored bytes of an NF4 weight (codes, int8 block scales, fp32 group factors, mean and code table)
    equal nf4_bytes (the estimator's term); a 1024 x 1024 matrix takes 4.13 bits per weight, and the tiny
    model's adapted matrices, small as they are, under 4.7."""
    from tokenmill.model.lora import to_nf4

    def stored(w) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4))

    big = to_nf4(torch.randn(1024, 1024) * 0.02)
    assert stored(big) == nf4_bytes(big.numel())
    assert 4.12 < 8 * stored(big) / big.numel() < 4.14
    qlora, _ = qlora_and_base(cfg_of())
    ws = [m.weight for m in nf4_modules(qlora)]
    assert all(stored(w) == nf4_bytes(w.numel()) for w in ws)
    assert 4.0 < 8 * sum(map(stored, ws)) / sum(w.numel() for w in ws) < 4.7


@needs_torchao
def test_state_dict_holds_the_nf4_base_exactly():
    """The state dict is plain tensors (uint8 codes in the weight's shape, int8 scales, factors, mean): a
    weights-only load without torchao's classes, loaded into a fresh QLoRA model, gives the same NF4 base
    and logits; a full-precision weight loaded into it is quantised (as to_nf4 does); a shape mismatch is an
    error; the merge equals the QLoRA forward."""
    qlora, base = qlora_and_base(cfg_of())
    with torch.no_grad():
        for m in nf4_modules(qlora):
            for b in m.lora_B.values():
                b.normal_(0, 0.05)
    sd = qlora.state_dict()
    assert sd["blocks.0.attn.q_proj.weight"].dtype == torch.uint8
    assert int(sd["blocks.0.attn.q_proj.weight"].max()) <= 15
    assert all(type(v) is torch.Tensor for v in sd.values())
    fresh = apply_lora(build_gpt(cfg_of().model, V, "cpu"), cfg_of().lora, init=False)
    fresh.load_state_dict(sd)
    for a, b in zip(nf4_modules(qlora), nf4_modules(fresh)):
        for t in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(getattr(a.weight, t), getattr(b.weight, t))
    x = ids()
    torch.testing.assert_close(logits(fresh, x), logits(qlora, x), atol=0, rtol=0)
    full = {**sd, **{k: v for k, v in base.state_dict().items()}}  # the unquantised base weights
    fresh.load_state_dict(full, strict=False)
    want = qlora.blocks[0].mlp.c_fc.weight
    assert torch.equal(fresh.blocks[0].mlp.c_fc.weight.quantized_data, want.quantized_data)
    bad = dict(sd)
    bad["blocks.0.mlp.c_fc.weight"] = sd["blocks.0.mlp.c_fc.weight"][:, :16]
    with pytest.raises(RuntimeError, match="size mismatch for blocks.0.mlp.c_fc.weight"):
        fresh.load_state_dict(bad)
    want = logits(qlora, x)
    merged = merge_lora(qlora)  # in place (deepcopy would re-quantise: torchao's NF4 clone)
    assert not nf4_modules(merged)
    torch.testing.assert_close(logits(merged, x), want, atol=1e-5, rtol=0)


def test_config_refuses_what_cannot_work(monkeypatch):
    with pytest.raises(ConfigError, match="needs --lora.rank > 0"):
        cfg_of(**{"lora.rank": 0})
    with pytest.raises(ConfigError, match="multiple of 64"):
        apply_lora(build_gpt(cfg_of(**{"model.n_embd": 24}).model, V, "cpu"), cfg_of(**{"model.n_embd": 24}).lora)
    block_import(monkeypatch, "torchao")
    with pytest.raises(ConfigError, match=r"needs torchao's NF4 tensor.*`pip install torchao`.*--lora.quantize_base "
                                          r"none"):
        qlora_and_base(cfg_of())


def test_nf4_pieces_by_hand():
    """nf4_pieces(shape): blocks = numel / 64, group = gcd(blocks, 256) scales, pieces = gcd(rows, blocks / group)
    (the most equal row shards holding whole rows and whole double-quantisation groups); nf4_groups gives
    (blocks, group)."""
    from tokenmill.config.lora import nf4_groups, nf4_pieces

    # Llama 3.1 8B's q: 4096 * 4096 / 64 = 262144 blocks, gcd(262144 = 2^18, 256) = 256, 1024 groups;
    # gcd(4096, 1024) = 1024
    assert nf4_groups(4096 * 4096) == (262144, 256) and nf4_pieces((4096, 4096)) == 1024
    # Llama 2 7B's gate/up: 11008 * 4096 / 64 = 704512 = 2^14 * 43 blocks, gcd(., 256) = 256, 2752 = 2^6 * 43
    # groups; 11008 = 2^8 * 43, so gcd(11008, 2752) = 2^6 * 43 = 2752
    assert nf4_groups(11008 * 4096) == (704512, 256) and nf4_pieces((11008, 4096)) == 2752
    # Llama 3.1 8B's down (4096, 14336): 917504 = 2^17 * 7 blocks, 3584 = 2^9 * 7 groups; gcd(4096, 3584) = 512
    # (its gate/up, 14336 = 2^11 * 7 rows: gcd(14336, 3584) = 3584)
    assert nf4_pieces((4096, 14336)) == 512 and nf4_pieces((14336, 4096)) == 3584
    # tiny-llama's q (32, 32): 16 blocks, gcd(16, 256) = 16, one group: 1 piece (FSDP cannot split it)
    assert nf4_groups(32 * 32) == (16, 16) and nf4_pieces((32, 32)) == 1
    # (96, 64): 96 blocks, gcd(96, 256) = 32, 3 groups; gcd(96, 3) = 3 (not a power of two)
    assert nf4_groups(96 * 64) == (96, 32) and nf4_pieces((96, 64)) == 3
    # tiny-llama at width 256 (n_kv_head 2 of 4 heads): k (128, 256): 512 blocks, group 256, 2 groups;
    # gcd(128, 2) = 2; q (256, 256): 4 groups, gcd(256, 4) = 4
    assert nf4_pieces((128, 256)) == 2 and nf4_pieces((256, 256)) == 4


def test_config_checks_that_fsdp_can_shard_every_nf4_weight():
    """lora.quantize_base='nf4' with parallel.dp_shard > 1 (config/lora.py check_nf4_shards, at resolve): the
    32-wide tiny-llama is refused for dp_shard 2 (its q (32, 32) is one double-quantisation group), naming the
    projection and DDP; at width 256 it is accepted for dp_shard 2 and refused for 4 (k (128, 256) splits into
    2, and the message offers dp_shard 2); a mixture of experts (tiny-moe, which resolves with nf4 on one
    process) is refused for dp_shard 2; Llama 3.1 8B is accepted for dp_shard 8."""
    with pytest.raises(ConfigError) as e:
        cfg_of(**{"parallel.dp_shard": 2})
    msg = str(e.value)
    assert msg.startswith("lora.quantize_base='nf4' under FSDP splits every NF4 weight into parallel.dp_shard=2 "
                          "equal shards")
    assert "the q projection (32, 32) has 32 rows and 1 double-quantisation group of 16 scales" in msg
    assert "splits into at most 1 equal part." in msg
    assert "Use DDP (--parallel.dp_shard 1 --parallel.dp_replicate N" in msg and "--lora.quantize_base none" in msg
    wide = {"model.n_embd": 256, "model.intermediate_size": 512}
    assert cfg_of(**wide, **{"parallel.dp_shard": 2}).parallel.dp_shard == 2
    with pytest.raises(ConfigError, match=r"the k projection \(128, 256\) has 128 rows and 2 double-quantisation "
                                          r"groups of 256 scales: it splits into at most 2 equal parts\. Use "
                                          r"--parallel\.dp_shard 2, or DDP \(--parallel\.dp_shard 1"):
        cfg_of(**wide, **{"parallel.dp_shard": 4})
    assert cfg_of("tiny-moe").model.moe_experts == 4  # resolves with nf4 on one process (or DDP)
    with pytest.raises(ConfigError, match=r"with parallel\.dp_shard > 1 cannot shard a mixture of experts.*Use DDP "
                                          r"\(--parallel\.dp_shard 1 --parallel\.dp_replicate N\)"):
        cfg_of("tiny-moe", **{"parallel.dp_shard": 2})
    assert cfg_of("llama3.1-8b", **{"parallel.dp_shard": 8}).parallel.dp_shard == 8
    # parallel.dp_shard -1 (every process): checked once the count is known, here by the estimator's layout
    from tokenmill.estimate import estimate

    every = cfg_of(**{"parallel.dp_shard": -1, "parallel.dp_replicate": 1})
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=2 equal shards .* the q projection \(32, 32\)"):
        estimate(every, "a100", 2)
    assert estimate(every, "a100", 1).layout  # one process: nothing to shard
    assert cfg_of("tiny-moe", **{"parallel.dp_shard": -1, "parallel.dp_replicate": 1}).model.moe_experts


def test_without_torchao_the_cli_says_what_to_install(monkeypatch, tmp_path, capsys):
    from tokenmill.cli import main

    block_import(monkeypatch, "torchao")
    rc = main(["train", "--preset", "tiny-llama", "--data.source", "synthetic", "--model.vocab_size", "64",
               "--train.device", "cpu", "--train.max_steps", "1", "--lora.rank", "4", "--lora.quantize_base", "nf4",
               "--run-dir", str(tmp_path / "run"), "--log.tensorboard", "false"])
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("tokenmill: warning:")]
    assert rc != 0 and len(err) == 1  # (the warning: LoRA on a random base, no train.init_from)
    assert err[0].startswith("tokenmill: config error: lora.quantize_base='nf4' needs torchao's NF4 tensor")


def _losses(run) -> list[float]:
    from tokenmill.train.metrics import read_metrics

    return [r["loss"] for r in read_metrics(run) if r.get("loss") is not None]


@needs_torchao
@pytest.mark.slow
def test_qlora_finetune_of_a_llama_folder_through_the_cli(tmp_path, capsys):
    """prepare -> train 6 steps with --lora.rank 8 --lora.quantize_base nf4 (loss falls; checkpoints hold the
    NF4 codes) -> --resume from the step-3 checkpoint continues bit-exactly (another lora.quantize_base is
    refused) -> export (merged into the dequantised base) -> transformers loads it with the QLoRA forward's
    logits within 1e-5."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from test_hf_families import TRAIN, source_and_data
    from test_hf_families import ids as hf_ids
    from test_hf_families import logits as hf_logits
    from tokenmill import checkpoint
    from tokenmill.cli import main
    from tokenmill.model import hf

    src, tok = source_and_data(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--train.init_from", str(src), "--data.path", str(tmp_path / "data"), "--run-dir", str(run),
                 "--train.max_steps", "6", "--log.every_steps", "1", "--optim.lr", "5e-2", "--lora.rank", "8",
                 "--lora.quantize_base", "nf4", "--checkpoint.every_steps", "3", "--checkpoint.keep_last", "3",
                 *TRAIN]) == 0
    capsys.readouterr()
    losses = _losses(run)
    assert len(losses) == 6 and losses[-1] < losses[0]
    shutil.copytree(run, tmp_path / "cut")
    (tmp_path / "cut" / "checkpoints" / "step_00000006.pt").unlink()
    assert main(["train", "--resume", "--run-dir", str(tmp_path / "cut"), "--lora.quantize_base", "none"]) != 0
    assert "lora.quantize_base='nf4', this config 'none'" in capsys.readouterr().err
    assert main(["train", "--resume", "--run-dir", str(tmp_path / "cut")]) == 0
    assert _losses(tmp_path / "cut") == losses
    _, state = checkpoint.read_latest(run)
    cfg = state["config"]
    assert cfg["lora"]["quantize_base"] == "nf4"
    coded = [k[:-len("_nf4_scales")] for k in state["model"] if k.endswith(".weight_nf4_scales")]
    assert len(coded) == 2 * 5 and all(state["model"][k].dtype == torch.uint8 for k in coded)  # fused q/k/v, o, MLP
    model_cfg, _ = hf.load_hf(src, base=C.ModelConfig(**cfg["model"]), block_size=32)
    qlora = apply_lora(build_gpt(model_cfg, model_cfg.vocab_size, "cpu"), C.LoraConfig(**cfg["lora"]), init=False)
    qlora.load_state_dict(state["model"])

    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = hf_ids(T=32, vocab=tok.get_vocab_size())
    torch.testing.assert_close(hf_logits(exported, x), hf_logits(qlora.eval(), x), atol=1e-5, rtol=0)
    assert not any("lora" in k or "nf4" in k for k in exported.state_dict())


def test_estimate_finetune_has_a_qlora_column(monkeypatch):
    """``estimate --finetune``'s QLoRA column is the plain estimate of the LoRA config over an NF4 base (the
    same number ``tokenmill estimate --lora.quantize_base nf4`` gives), about the LoRA peak less the adapted
    weights' bf16 bytes plus their NF4 bytes (half a byte, an int8 scale per 64, an fp32 factor per 256 scales)
    and one dequantised transient: within 0.7 GB, the caching allocator's slack of the two runs differing.
    Llama 3.1 8B at 4 x 1024: about 18.5 GB with LoRA, 9 GB with QLoRA (on the L4 only, to keep it short)."""
    from tokenmill.estimate import estimate, finetune

    monkeypatch.setattr(finetune, "GPUS", {"l4": finetune.GPUS["l4"]})
    cfg = C.resolve("llama3.1-8b", overrides={"model.block_size": 1024, "train.batch_size": 4, "lora.rank": 16,
                                              "train.precision": "bf16", "model.loss_impl": "chunked",
                                              "memory.activation_checkpointing": 1}, overrides_from_string=False)
    out = finetune.format_finetune(cfg, chosen={"train.batch_size"})  # the micro-batch as set, not the recipe's
    row = next(line.split() for line in out.splitlines() if line.startswith("  l4 "))
    lora, qlora = float(row[6]), float(row[9])  # GB, one decimal
    n = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)  # every projection of the 32 blocks
    nf4 = n / 2 + n / 64 + 4 * n / 64 / 256
    saved = 2 * n - nf4 - (2 + 2) * 14336 * 4096
    plain = estimate(finetune.with_qlora(finetune.with_lora(cfg, 16)), "l4")
    assert qlora == round(plain.peak_reserved_mb / 1024, 1)
    assert qlora == pytest.approx(lora - saved / 2**30, abs=0.7)
    assert 18 < lora < 20 and 8.5 < qlora < 10 and row[11] == "fits"
    assert "QLoRA: the same adapters over the blocks' projection weights stored as NF4" in out
    assert "QLoRA: the smallest GPU that fits is l4" in out


def test_plain_estimate_counts_the_base_as_nf4():
    """``tokenmill estimate`` of a QLoRA config (not only ``--finetune``): the step's timeline holds the adapted
    weights as NF4, each as torchao's tensors (codes, scales, factors, mean, table: ``nf4_parts``) counted by
    hand (every projection of the 32 blocks), in the caching allocator's blocks (512-byte multiples; a cached
    block up to 511 bytes larger may serve a request: within 1 MiB over the 1,120 tensors). Each product's
    dequantisation is in the block's trace where it runs (its int32 index, 2 bytes a weight, then the bf16
    values: estimate/device.py _NF4Product), so at this config's peak (the loss's backward) none is alive;
    the rest of the estimate is the LoRA one, and the NF4 blocks (never freed) add no allocator slack beyond
    the LoRA run's."""
    from tokenmill.estimate import estimate
    from tokenmill.estimate.allocator import round_size
    from tokenmill.estimate.core import _plan, resolve_layout
    from tokenmill.model.nf4 import nf4_parts

    over = {"model.block_size": 1024, "train.batch_size": 4, "lora.rank": 16, "lora.targets": "all",
            "train.precision": "bf16", "model.loss_impl": "chunked", "memory.activation_checkpointing": 1}
    lora, qlora = (estimate(C.resolve("llama3.1-8b", overrides={**over, "lora.quantize_base": q},
                                      overrides_from_string=False), "l4") for q in ("none", "nf4"))
    shapes = 2 * [4096 * 4096] + 2 * [1024 * 4096] + 3 * [14336 * 4096]  # q, o; k, v; gate, up, down
    n = 32 * sum(shapes)
    nf4 = 32 * sum(round_size(b) for k in shapes for b in nf4_parts(k))
    assert nf4_parts(4096 * 4096) == (4096 * 4096 // 2, 4096 * 4096 // 64, 4 * 4096 * 4096 // 64 // 256, 4, 64)
    mib = 2**20
    assert qlora.breakdown_mb["parameters"] == pytest.approx(lora.breakdown_mb["parameters"] - (2 * n - nf4) / mib,
                                                             abs=1.0)
    assert qlora.peak_alloc_mb == pytest.approx(lora.peak_alloc_mb - (2 * n - nf4) / mib, abs=1.0)
    counts = {}
    for q in ("none", "nf4"):  # the block's storages of each size, with and without the NF4 base
        cfg = C.concrete(C.resolve("llama3.1-8b", overrides={**over, "lora.quantize_base": q},
                                   overrides_from_string=False), "cuda", True)
        (block,) = _plan(cfg, resolve_layout(cfg, 1), cfg.model.vocab_size, True, 0)[1].blocks.values()
        counts[q] = [list(block.sizes.values()).count(2 * k) for k in (14336 * 4096, 6144 * 4096, 4096 * 4096)]
        assert block.nf4_traced and len(block.rounds) == 1  # (vacuously without NF4 weights)
    # each NF4 product: its index and its values (2 bytes a weight each) in the forward, the checkpointed
    # recompute and the backward: gate, up, down (3); the fused q/k/v (6144 rows); o
    assert [a - b for a, b in zip(counts["nf4"], counts["none"])] == [3 * 2 * 3, 2 * 3, 2 * 3]
    assert qlora.peak_alloc_mb <= qlora.peak_reserved_mb <= qlora.peak_alloc_mb + lora.allocator_slack_mb + 1
    assert qlora.fits == (qlora.peak_reserved_mb <= qlora.capacity_mb) and any("QLoRA" in n for n in qlora.notes)


def test_doctor_names_qlora_where_a_lora_finetune_fills_the_gpu():
    from tokenmill.profiling import rules

    f = {"config": {"train.precision": "bf16", "model.vocab_size": 50257, "train.batch_size": 8,
                    "train.init_from": "models/gpt2-medium", "model.n_layer": 24, "model.n_head": 16,
                    "model.n_embd": 1024, "lora.rank": 16},
         "device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "device_total_mb": 24_000.0,
         "peak_reserved_mb": 22_000.0, "step_ms": 400.0}
    found = rules.qlora_finetune(f)
    assert found is not None and found.measure == "memory"
    assert found.suggestions[0]["switch"] == "--lora.quantize_base nf4"
    assert "fills 92% of the GPU" in found.evidence[0] and "GB peak reserved of 23.4 GB" in found.evidence[1]
    assert rules.qlora_finetune({**f, "peak_reserved_mb": 10_000.0}) is None  # memory not tight
    assert rules.qlora_finetune({**f, "config": {**f["config"], "lora.rank": 0}}) is None  # no LoRA
    assert rules.qlora_finetune({**f, "config": {**f["config"], "lora.quantize_base": "nf4"}}) is None  # already
