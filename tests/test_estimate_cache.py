"""The estimator's caches (traced pieces by :func:`~tokenmill.estimate.trace.trace_key`, step timelines and their
replays in :func:`tokenmill.estimate.core._replay`) change no answer: ``estimate --finetune --advice`` and the
memory search give the same output and the same numbers with them as with every piece traced and every step
replayed afresh, and a config that differs from another only in what the key leaves out traces the same."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.estimate import advice as A
from tokenmill.estimate import core
from tokenmill.estimate import finetune as ft
from tokenmill.estimate import trace as T

SHAPE = {"model.block_size": 256, "train.batch_size": 16}  # activations that a smaller micro-batch lowers


def _tiny(**overrides) -> C.Config:
    return C.resolve("tiny-llama", overrides={**SHAPE, **overrides}, overrides_from_string=False)


@pytest.fixture
def fresh(monkeypatch):
    """Empty caches for this test (restored after it), and a count of the pieces traced."""
    monkeypatch.setattr(T, "_CACHE", OrderedDict())
    monkeypatch.setattr(core, "_STEPS", OrderedDict())
    monkeypatch.setattr(core, "_MEMORIES", OrderedDict())
    traced = []
    real = T._trace_pieces

    def counting(*a, **k):
        traced.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(T, "_trace_pieces", counting)
    return traced


def _answers(capsys, monkeypatch) -> tuple:
    """What ``estimate --finetune --advice`` prints, its rows' exact figures, and a memory search that takes
    two rounds and a pruning (a capacity the micro-batch must halve twice for) with every figure it estimated."""
    rows = []
    real = ft.finetune_rows
    monkeypatch.setattr(ft, "finetune_rows", lambda *a, **k: rows.append(real(*a, **k)) or rows[-1])
    argv = ["estimate", "--preset", "tiny-llama", *(f"--{k}={v}" for k, v in SHAPE.items()),
            "--finetune", "--advice", "--gpu", "l4"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    lora = ft.with_lora(ft.with_recipe(_tiny(), set(SHAPE))[0], 16)  # the flags the command line set, kept
    spec = A._spec("l4", 0.9 * core.estimate(lora, "l4").peak_reserved_mb)
    found = A.search(lora, spec)
    return printed, [vars(r) for r in rows[0][0]], found.chosen, found.best, list(found.seen.values())


def test_cached_finetune_and_advice_answer_as_uncached(fresh, monkeypatch, capsys):
    # two GPUs of the table: two capacities, the pre-Hopper and the Hopper cuBLAS workspace
    monkeypatch.setattr(ft, "GPUS", {k: ft.GPUS[k] for k in ("l4", "h100-sxm")})
    cached = _answers(capsys, monkeypatch)
    n_cached, kept = len(fresh), (list(T._CACHE), list(core._STEPS), list(core._MEMORIES))
    # two rounds (16 -> 8 -> 4 sequences), the first then pruned as the second overrides it
    assert cached[2] == [{"train.batch_size": 4, "train.grad_accum_steps": 4}] and len(cached[4]) >= 4
    assert "advice: LoRA on l4" in cached[0] and [r["gpu"] for r in cached[1]] == ["l4", "h100-sxm"]
    fresh.clear()
    monkeypatch.setattr(T, "CACHE_SIZE", 0)
    monkeypatch.setattr(core, "MEMO", False)
    uncached = _answers(capsys, monkeypatch)
    assert uncached == cached  # the printed report and every figure, exactly
    # without the caches each GPU traces the full and the LoRA fine-tune again, and nothing is kept; with
    # them the GPUs share one trace of each
    assert len(fresh) >= n_cached + 4 and (list(T._CACHE), list(core._STEPS), list(core._MEMORIES)) == kept


def test_eager_trace_reads_nothing_the_key_leaves_out(fresh):
    """Every memory switch the search tries that keeps the trace key traces the same pieces as the config
    without it; so do another accumulation factor and another GPU's FLOP/byte balance (eager pieces)."""
    base = C.concrete(_tiny(**{"train.grad_accum_steps": 2}), "cuda")
    key = T.trace_key(base, 256, "cuda", pad_balance=100.0)
    ref = T._trace_pieces(base, 256, "cuda", None, 1, False, 100.0)
    same = [(C.concrete(_tiny(**{"train.grad_accum_steps": 8}), "cuda"), 300.0)]
    for ov in ({"train.tf32": True}, {"memory.expandable_segments": True}, {"data.document_mask": True}):
        same.append((C.concrete(_tiny(**{"train.grad_accum_steps": 2, **ov}), "cuda"), 100.0))
    for _text, ov in A.candidate_switches(base, numerics=True):
        c = A._with(base, ov)
        if c is not None:
            same.append((C.concrete(c, "cuda"), 100.0))
    kept = [(c, b) for c, b in same if T.trace_key(c, 256, "cuda", pad_balance=b) == key]
    assert len(kept) >= 7  # the optimizer's switches, offload of its state, the allocator, the data, tf32, ...
    for c, b in kept:
        assert T._trace_pieces(c, 256, "cuda", None, 1, False, b) == ref
    moved = [c for c, _ in same if T.trace_key(c, 256, "cuda") != key]
    assert moved and all(T._trace_pieces(c, 256, "cuda", None, 1, False, None) != ref for c in moved)


def test_compiled_pieces_keep_the_gpu_balance_in_the_key():
    """A compiled piece pads its matrix products by the GPU's balance: there the key keeps it."""
    cfg = C.concrete(_tiny(**{"compile.enabled": True}), "cuda")
    assert T.compiled_pieces(cfg)
    assert T.trace_key(cfg, 256, "cuda", pad_balance=100.0) != T.trace_key(cfg, 256, "cuda", pad_balance=300.0)
    eager = C.concrete(_tiny(), "cuda")
    assert T.trace_key(eager, 256, "cuda", pad_balance=100.0) == T.trace_key(eager, 256, "cuda", pad_balance=300.0)


@pytest.mark.slow  # captures compiled graphs
def test_compiled_graphs_shared_across_gpus_and_accumulation_answer_as_uncached(fresh, monkeypatch):
    """The captured graphs of a compiled piece (compiled.captured) are shared by configs that differ only in what
    reads them later (the GPU's balance, the accumulation's second round, the checkpoint wrapper, the loss
    switches for the blocks and embeddings): each estimate is exactly what a fresh capture gives."""
    from tokenmill.estimate import compiled as CP

    monkeypatch.setattr(CP, "_GRAPHS", OrderedDict())
    calls = []
    real = CP.capture
    monkeypatch.setattr(CP, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    tiny = {"model.n_layer": 1, "model.n_embd": 32, "model.n_head": 2, "model.n_kv_head": 1, "model.block_size": 16,
            "model.vocab_size": 64, "train.batch_size": 2, "compile.enabled": True}
    runs = [({}, "h100-sxm"), ({"train.grad_accum_steps": 2}, "a100-40gb"), ({"model.return_logits": False}, "l4")]

    def answers() -> list:
        return [core.estimate(C.resolve("tiny-llama", overrides={**tiny, **ov}, overrides_from_string=False),
                              gpu).to_dict() for ov, gpu in runs]

    cached, n_cached = answers(), len(calls)
    assert n_cached == 4  # embed, block, head once; the head again without the logits
    calls.clear()
    monkeypatch.setattr(T, "CACHE_SIZE", 0)
    monkeypatch.setattr(core, "MEMO", False)
    monkeypatch.setattr(CP, "GRAPH_CACHE_SIZE", 0)
    assert answers() == cached and len(calls) == 3 * len(runs)
