"""The estimator and the doctor on packed chat windows (``data.chat_packing='pack'``): the mask that keeps the
conversations apart is counted where it is used (FlexAttention's block mask: block tables only; the explicit
(B, 1, T, T) mask and its slower kernel: only on the explicit path), ``estimate --finetune`` gives tokens/s and
learned tokens/s for padded and packed windows, and the doctor's rule on the explicit mask advises packed chat.

The chat folder is tests/test_sft_packing.py's (the small Llama 3 tokenizer; windows of 256 tokens)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from test_sft_packing import T, chat  # noqa: E402, F401  (chat: the chat folder fixture)
from tokenmill import config as C  # noqa: E402
from tokenmill.estimate import GPUS, estimate  # noqa: E402
from tokenmill.estimate.techniques import block_mask_bytes  # noqa: E402

B, MB = 4, 2**20


def cfg_of(folder, packing: str, **over) -> C.Config:
    base = {"data.source": "tokens", "data.path": str(folder), "data.chat_packing": packing, "model.vocab_size": None,
            "model.block_size": T, "train.batch_size": B, "model.dropout": 0.0, "train.device": "cpu", **over}
    return C.resolve("tiny-llama", overrides=base, overrides_from_string=False)


def test_packed_windows_count_the_mask_only_where_it_is_used(chat):  # noqa: F811 (the fixture)
    """Packed over padded, the same model and batch: on the CPU (explicit path, fp32) the (B, 1, T, T) mask's
    B x T x T x 4 bytes plus the restarted positions' RoPE angles (2 x B x T x head width x 4); on an H100 ('auto':
    FlexAttention, bf16) the angles and the block mask's tables only, and no attention time; with attention dropout
    on the H100 (the explicit path again) the bf16 mask, the grouped keys and values repeated per query head
    (4 query heads on 2), and more attention time."""
    def pair(device, **over):
        return [estimate(cfg_of(chat, p, **over), device) for p in ("pad", "pack")]

    cfg = cfg_of(chat, "pack")
    angles = 2 * B * T * cfg.model.head_width * 4
    pad, pack = pair("cpu", **{"train.precision": "fp32"})
    assert pack.peak_alloc_mb - pad.peak_alloc_mb == pytest.approx((B * T * T * 4 + angles) / MB)
    pad, pack = pair("h100-sxm", **{"train.precision": "bf16-autocast"})
    assert pack.peak_alloc_mb - pad.peak_alloc_mb == pytest.approx((angles + block_mask_bytes(B, T)) / MB,
                                                                   abs=512 / MB)  # allocations rounded to 512 B
    assert block_mask_bytes(1, 8192) < 8192 * 8192 * 2 / 500  # at T = 8192, 0.1% of a bf16 T x T mask
    # FlexAttention computes the tiles of the causal triangle that the packed conversations keep, at its published
    # speed over FlashAttention-2's (estimate/attention.py): less attention time than the padded windows' full one
    from tokenmill.estimate import attention as A
    from tokenmill.estimate import sft

    share = sft.packed_tile_share(cfg_of(chat, "pack", **{"train.precision": "bf16-autocast"}))
    assert 0 < share <= 1  # windows of two 128-token tiles: few tiles to skip
    assert pack.time_breakdown_ms["matmul_ms"] < pad.time_breakdown_ms["matmul_ms"]  # on the H100 flex is the faster
    with pytest.MonkeyPatch.context() as mp:  # with every tile and FlashAttention-2's speed: the padded windows' time
        mp.setattr(sft, "packed_tile_share", lambda cfg: 1.0)
        mp.setattr(A, "FLEX_VS_FA2", {"a100": (1.0, 1.0), "h100": (1.0, 1.0)})
        full = estimate(cfg_of(chat, "pack", **{"train.precision": "bf16-autocast"}), "h100-sxm")
    assert full.time_breakdown_ms["matmul_ms"] == pytest.approx(pad.time_breakdown_ms["matmul_ms"])
    pad, pack = pair("h100-sxm", **{"train.precision": "bf16-autocast", "model.dropout": 0.1})
    m = cfg.model
    repeated = m.n_layer * 2 * B * T * (m.n_head - m.kv_heads) * m.head_width * 2
    assert m.kv_heads < m.n_head
    assert pack.peak_alloc_mb - pad.peak_alloc_mb == pytest.approx((B * T * T * 2 + angles + repeated) / MB)
    assert pack.time_breakdown_ms["matmul_ms"] > pad.time_breakdown_ms["matmul_ms"]


def test_finetune_lines_give_learned_tokens_per_second_padded_and_packed(chat):  # noqa: F811 (the fixture)
    """`estimate --finetune` on a chat folder ends with these lines (estimate/finetune.py): for the LoRA fine-tune
    on a GPU, a line each for padded and packed windows whose tokens/s and learned tokens/s are the estimator's for
    that config (learned = tokens/s x the windows' learned share), the packed one through FlexAttention's block
    mask ('auto' on CUDA) or, with attention dropout, the explicit mask; none for text data."""
    from tokenmill.estimate.finetune import finetune_chat_lines, with_lora
    from tokenmill.estimate.sft import chat_shares

    for dropout, mask in ((0.0, "FlexAttention block mask"), (0.1, "explicit (B, 1, T, T) mask")):
        lora = with_lora(cfg_of(chat, "pad", **{"model.dropout": dropout}), 8)
        out = finetune_chat_lines(lora, GPUS["a100-80gb"])
        assert out[0].startswith("chat windows, LoRA on a100-80gb") and len(out) == 3
        rates = []
        for line, packing in zip(out[1:], ("pad", "pack")):
            cfg = C.from_dict(lora.to_dict())
            cfg.data.chat_packing = packing
            est, shares = estimate(C.validate(cfg), GPUS["a100-80gb"]), chat_shares(cfg)
            assert line.split()[0] == packing and f"{est.tokens_per_sec:,.0f} tokens/s" in line
            assert f"{est.tokens_per_sec * shares['learned_share']:,.0f} learned tokens/s" in line, line
            assert f"{100 * shares['padding_share']:.0f}% padding" in line
            rates.append(est.tokens_per_sec * shares["learned_share"])
        assert mask in out[2] and "mask" not in out[1]
        if not dropout:
            assert rates[1] > 1.5 * rates[0]  # short conversations: packing learns more per second
    assert finetune_chat_lines(with_lora(cfg_of(chat, "pad", **{"data.loss_mask": False}), 8), GPUS["a100-80gb"]) == []


def test_doctor_advises_flex_or_padding_for_packed_chat_on_the_explicit_path():
    """The typed rule on a packed chat run (its summary's learned_frac, chat_packing 'pack') with the explicit mask
    on an H100: the estimate's extra time and the mask's bytes, model.document_attention first and padding second;
    nothing with FlexAttention, nothing for a padded run, nothing without the chat figures (not a chat run)."""
    from tokenmill.profiling.docmask_rules import document_mask_cost
    from tokenmill.profiling.facts import Run

    Bd, Td = 16, 2048
    run = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 256,
           "model.n_head": 4, "model.block_size": Td, "train.batch_size": Bd, "train.precision": "bf16-autocast",
           "data.chat_packing": "pack", "model.document_attention": "explicit"}
    facts = {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "device_total_mb": 81559, "world_size": 1,
             "config": run, "learned_frac": 0.4, "padding_frac": 0.05}
    found = document_mask_cost(Run.of(facts))
    assert found is not None and "data.chat_packing='pack' keeps packed conversations apart" in found.evidence[0]
    assert f"{Bd * Td * Td * 2 / MB:.0f} MB more at the peak" in found.evidence[1]
    assert [s["switch"] for s in found.suggestions[:2]] == ["--model.document_attention auto",
                                                            "--data.chat_packing pad"]
    doc = document_mask_cost({**facts, "config": {**run, "data.chat_packing": "pad", "data.document_mask": True}})
    assert doc.evidence[1] == found.evidence[1]  # the same mask, the same estimate
    assert document_mask_cost({**facts, "config": {**run, "model.document_attention": "auto"}}) is None
    assert document_mask_cost({**facts, "config": {**run, "data.chat_packing": "pad"}}) is None
    assert document_mask_cost({k: v for k, v in facts.items() if k != "learned_frac"}) is None
