"""DeepSeek-V3's auxiliary-loss-free load balancing (``model.moe_bias_update_rate``, model/moe.py): the routing
bias chooses experts only, the update after each step, its effect on a skewed router, checkpoints and resume.

transformers' DeepseekV3TopkRouter adds its ``e_score_correction_bias`` to sigmoid scores (with group-limited
routing); tokenmill's routers score with a softmax, so the biased routing decision is checked against a
hand-written reference here rather than against that class."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.config import ModelConfig
from tokenmill.model import GPT, balance_experts
from tokenmill.model.moe import MoE

BASE = dict(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, mlp="swiglu", pos_emb="rope",
            norm_type="rmsnorm", bias=False, qkv_bias=False, moe_experts=8, moe_top_k=2, moe_intermediate_size=16,
            moe_impl="loop")


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(ModelConfig(**{**BASE, **kw}))
    torch.nn.init.normal_(m.router.weight, std=0.3)
    return m


def _reference(logits: torch.Tensor, bias: torch.Tensor, kind: str, k: int):
    """Per token: the k experts of largest score + bias; their weights from the unbiased scores."""
    probs = torch.softmax(logits.double(), -1)
    scores = logits.double() if kind == "topk-softmax" else probs
    idx, weights = [], []
    for row, p, s in zip(logits.double(), probs, scores):
        chosen = sorted(range(len(s)), key=lambda e: -(float(s[e]) + float(bias[e])))[:k]
        if kind == "topk-softmax":
            w = torch.softmax(row[chosen], -1)
        else:
            w = p[chosen] / (p[chosen].sum() if kind == "softmax-topk-renorm" else 1.0)
        idx.append(chosen)
        weights.append(w.tolist())
    return idx, weights


@pytest.mark.parametrize("kind", ["softmax-topk", "softmax-topk-renorm", "topk-softmax"])
def test_biased_routing_matches_a_hand_written_reference(kind):
    m = _moe(moe_router=kind, moe_bias_update_rate=0.001)
    torch.manual_seed(1)
    logits = torch.randn(64, 8)
    bias = torch.randn(8) * (0.1 if kind != "topk-softmax" else 1.0)
    m.router_bias.copy_(bias)
    _, weights, idx = m.route(logits)
    ref_idx, ref_w = _reference(logits, bias, kind, 2)
    ours = [sorted(zip(i.tolist(), w.tolist())) for i, w in zip(idx, weights)]
    want = [sorted(zip(i, w)) for i, w in zip(ref_idx, ref_w)]
    assert [[e for e, _ in r] for r in ours] == [[e for e, _ in r] for r in want]
    assert max(abs(a - b) for r, s in zip(ours, want) for (_, a), (_, b) in zip(r, s)) < 1e-6
    plain = _reference(logits, torch.zeros(8), kind, 2)[0]  # the bias changed decisions: the test can fail
    assert sum(sorted(a) != sorted(b) for a, b in zip(ref_idx, plain)) > 5
    m.router_bias.zero_()  # a zero bias routes exactly as the unbiased router does
    assert torch.equal(m.route(logits)[2], _moe(moe_router=kind).route(logits)[2])


def test_bias_is_a_checkpointed_buffer_updated_by_the_step_load():
    m = _moe(moe_bias_update_rate=0.01)
    assert "router_bias" in m.state_dict() and all(n != "router_bias" for n, _ in m.named_parameters())
    assert "router_bias" not in _moe().state_dict()  # off: nothing new in the state dict
    m.train()
    xs = [torch.randn(2, 16, 32) for _ in range(2)]
    counts = []
    for x in xs:  # two micro-batches: the update sees both
        m(x)
        counts.append(m.stats["counts"])
    m.eval()
    m(torch.randn(2, 16, 32))  # evaluation does not count
    total = counts[0] + counts[1]
    assert torch.equal(m.step_load, total)
    balance_experts(m)
    assert torch.equal(m.router_bias, 0.01 * torch.sign(total.mean() - total)) and m.router_bias.abs().sum() > 0
    assert m.step_load is None
    before = m.router_bias.clone()
    balance_experts(m)  # nothing routed since: unchanged
    assert torch.equal(m.router_bias, before)


def _load(m: MoE, x: torch.Tensor) -> float:
    with torch.no_grad():
        idx = m.route(m.router(x))[2]
    c = torch.bincount(idx.reshape(-1), minlength=8).float()
    return float(c.max() / c.mean())


@torch.no_grad()
def test_bias_balancing_evens_a_skewed_router():
    """Tokens share a mean direction that the router rows of experts 0 and 1 point along: they take most
    slots (busiest expert's load over the mean about 3.5 of at most 4). With rate 0.01, 30 steps of routing (each
    followed by the update) bring it under 2.2; with rate 0 it stays."""
    torch.manual_seed(2)
    mu = torch.randn(32)
    loads = {}
    for rate in (0.0, 0.01):
        m = _moe(moe_bias_update_rate=rate)
        m.router.weight[:2] += 0.5 * mu / mu.norm()
        m.train()
        gen = torch.Generator().manual_seed(3)
        start = _load(m, torch.randn(256, 32, generator=gen) + mu)
        for _ in range(30):
            m(torch.randn(1, 64, 32, generator=gen) + mu)
            balance_experts(m)
        loads[rate] = (start, _load(m, torch.randn(256, 32, generator=gen) + mu))
    (s0, e0), (s1, e1) = loads[0.0], loads[0.01]
    assert s0 == s1 > 2.5 and abs(e0 - s0) < 0.5  # skewed, and without the bias it stays skewed
    assert e1 < 2.2 and e1 < e0 - 1.0, loads  # measured: 3.30 at rate 0, 1.94 at rate 0.01


def test_gpt_initialises_the_bias_to_zero_on_meta_builds():
    from tokenmill.model.build import build_gpt

    cfg = ModelConfig(**{**BASE, "moe_bias_update_rate": 0.001})
    model = build_gpt(cfg, 64, "cpu", dtype=torch.float32)  # meta, to_empty, init_weights
    biases = [m.router_bias for m in model.modules() if isinstance(m, MoE)]
    assert biases and all(torch.equal(b, torch.zeros(8)) for b in biases)
    assert isinstance(model, GPT)


@pytest.mark.slow
def test_bias_is_in_the_checkpoint_and_resume_equals_the_uninterrupted_run(tmp_path):
    from test_parallel import preset_cfg
    from tokenmill import checkpoint as ckpt
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.trainer import train

    over = {"log.every_steps": 1, "optim.decay_steps": 6, "train.eval_every_steps": 100, "train.grad_accum_steps": 2,
            "model.moe_bias_update_rate": 0.01, "model.moe_aux_loss_coef": 0.0}
    train(preset_cfg("tiny-moe", **over, **{"train.max_steps": 6}), tmp_path / "full", quiet=True)
    train(preset_cfg("tiny-moe", **over, **{"train.max_steps": 3}), tmp_path / "cut", quiet=True)
    cut_bias = ckpt.read_latest(tmp_path / "cut")[1]["model"]["blocks.0.mlp.router_bias"]
    assert cut_bias.abs().max() > 0  # the trainer updated it, and it was saved
    train(preset_cfg("tiny-moe", **over, **{"train.max_steps": 6}), tmp_path / "cut", resume=True, quiet=True)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    for key in ("loss", "moe_load_max"):
        want = [(r["step"], r[key]) for r in full if key in r]
        assert [(r["step"], r[key]) for r in cut if key in r] == want and len(want) == 6, key
    a, b = ckpt.read_latest(tmp_path / "full")[1]["model"], ckpt.read_latest(tmp_path / "cut")[1]["model"]
    assert a.keys() == b.keys() and "blocks.1.mlp.router_bias" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow  # the compiled estimate traces the model through dynamo and AOTAutograd
@pytest.mark.parametrize("precision", ["bf16-autocast", "fp32"])
def test_compiled_moe_estimate_prints_a_result(capsys, precision):
    """The compiled pieces are traced on fake tensors: the experts take their shape-only product there (the
    loop cannot read fake group sizes; the grouped product's fake kernel takes bf16 only), no traceback."""
    from tokenmill.cli import main

    args = ["estimate", "--preset", "tiny-moe", "--model.vocab_size", "64", "--gpu", "h100-sxm",
            "--train.precision", precision, "--model.moe_bias_update_rate", "0.001"]
    assert main(args + ["--compile.enabled", "true"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "note: torch.compile: the compiled pieces" in out
    assert "time per optimizer step:" in out and "mixture of experts: 4 experts, 2 per token" in out
    impl = "grouped expert matmuls" if precision == "bf16-autocast" else "one per expert (model.moe_impl loop)"
    assert impl in out


def test_doctor_names_the_bias_switch_for_unbalanced_routing():
    from test_doctor import facts
    from test_moe_rules import MOE
    from tokenmill.profiling.moe_rules import routing_imbalance

    hot = routing_imbalance(facts(config=MOE, moe_load_max=2.5, moe_load_layer=1, world_size=1))
    switches = [s["switch"] for s in hot.suggestions]
    assert "--model.moe_bias_update_rate 0.001" in switches
    on = routing_imbalance(facts(config={**MOE, "model.moe_bias_update_rate": 0.002}, moe_load_max=2.5))
    assert not any("moe_bias_update_rate" in str(s["switch"]) for s in on.suggestions)
    assert any("model.moe_bias_update_rate = 0.002: the routing bias is on" in e for e in on.evidence)


def test_hf_folder_in_with_the_bias_and_out_only_while_it_is_zero(tmp_path):
    """A Mixtral folder goes in with model.moe_bias_update_rate set (the bias starts at zero, the logits equal
    transformers'); it goes out again while the bias is zero and is refused, naming the field, once it is not."""
    import transformers

    from test_moe_hf import FOLDERS, hf_moe, ids, logits
    from tokenmill import config as C
    from tokenmill.errors import CheckpointError
    from tokenmill.model import hf

    arch, kw, _ = FOLDERS["mixtral"]
    src = hf_moe(arch, **kw)
    src.save_pretrained(tmp_path / "src")
    cfg, sd = hf.load_hf(tmp_path / "src", base=C.ModelConfig(moe_bias_update_rate=0.001))
    assert cfg.moe_bias_update_rate == 0.001 and "blocks.2.mlp.router_bias" not in sd
    model = GPT(cfg, cfg.vocab_size)
    model.blocks[2].mlp.router_bias.fill_(1.0)
    model.load_state_dict(sd)  # strict: a source without the bias loads with it at zero
    assert all(torch.equal(b.mlp.router_bias, torch.zeros(4)) for b in model.blocks)
    model.eval()
    x = ids()
    torch.testing.assert_close(logits(model, x), logits(src, x), atol=1e-5, rtol=0)
    hf.save_hf(model.state_dict(), cfg, tmp_path / "out")
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(out, x), logits(src, x), atol=1e-5, rtol=0)
    model.blocks[1].mlp.router_bias[0] = 0.01
    with pytest.raises(CheckpointError, match=r"blocks\.1\.mlp\.router_bias \(model\.moe_bias_update_rate\) is non-zero"):
        hf.save_hf(model.state_dict(), cfg, tmp_path / "out2")
    plain = GPT(dataclasses.replace(cfg, moe_bias_update_rate=0.0), cfg.vocab_size)  # a model without the bias
    with pytest.raises(CheckpointError, match=r"'blocks\.1\.mlp\.router_bias' is non-zero: .* --model\.moe_bias_update_rate"):
        plain.load_state_dict(model.state_dict())
    model.blocks[1].mlp.router_bias.zero_()
    plain.load_state_dict(model.state_dict())  # a zero bias routes as no bias: dropped


def test_the_rate_is_checked_and_inert_without_experts():
    from tokenmill import config as C
    from tokenmill.config.inert import inert_warnings
    from tokenmill.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.moe_bias_update_rate"):
        C.resolve("tiny-moe", overrides={"model.moe_bias_update_rate": "-0.001"})
    dense = C.resolve("tiny", overrides={"model.moe_bias_update_rate": "0.001"})
    assert any("model.moe_bias_update_rate" in w and "--model.moe_experts > 0" in w for w in inert_warnings(dense))
    assert not inert_warnings(C.resolve("tiny-moe", overrides={"model.moe_bias_update_rate": "0.001"}),
                              C.resolve("tiny-moe", overrides={}))
