"""memory.offload_activations (tokenmill.model.offload): the hooks keep the math (gradients bit-equal to a run
without them), move every saved tensor but the model's own weights and buffers (counted independently, by data
pointer), bring tensors back ahead of backward's reads, survive a retained graph; and the estimator's replay of
its copies (estimate/techniques.py offload_stall_seconds) on hand-computed timelines. The CUDA side (side stream,
pinned copies, tensors kept at the forward's end) runs in tests/test_gpu.py."""

import pytest
import torch

from conftest import tiny_cfg
from tokenmill.estimate.techniques import offload_stall_seconds
from tokenmill.model.build import apply_activation_checkpointing, build_gpt
from tokenmill.model.offload import IN_FLIGHT, ActivationOffload

VOCAB = 64


def _model(ac: int = 0):
    torch.manual_seed(0)
    cfg = tiny_cfg(**{"model.dropout": 0.0})
    model = build_gpt(cfg.model, VOCAB, "cpu")
    if ac:
        apply_activation_checkpointing(model, ac)
    return model


def _grads(model, hooks, retain: int = 1):
    model.zero_grad(set_to_none=True)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with hooks:
        loss = model(idx, idx)[1]
    for r in range(retain):
        loss.backward(retain_graph=r + 1 < retain)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class _Count(torch.autograd.graph.saved_tensors_hooks):
    """Counts what a forward saves, telling weights from activations by data pointer (not by storage object)."""

    def __init__(self, model):
        ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.weights = self.activations = 0

        def pack(t):
            if t.untyped_storage().data_ptr() in ptrs:
                self.weights += 1
            else:
                self.activations += t.numel() * t.element_size()
            return t

        super().__init__(pack, lambda t: t)


@pytest.mark.parametrize("ac", [0, 1])
def test_offload_keeps_the_math_and_moves_every_activation_but_no_weight(ac):
    model = _model(ac)
    plain = _grads(model, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    count = _Count(model)
    _grads(model, count)
    offload = ActivationOffload(model, torch.device("cpu"))
    moved = _grads(model, offload)
    assert plain.keys() == moved.keys() and all(torch.equal(plain[n], moved[n]) for n in plain)
    assert offload.moved == count.activations > 0
    if ac == 0:
        assert count.weights > 0  # the weights were saved, and stayed
    else:  # checkpointed: each block saves its input only
        assert len([s for s in offload.saved if s[2] == 2 * 16 * 32 * 4]) >= 2


def test_a_retained_graph_reads_its_host_copies_twice():
    model = _model()
    once = _grads(model, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    twice = _grads(model, ActivationOffload(model, torch.device("cpu")), retain=2)
    assert all(torch.allclose(twice[n], 2 * once[n], rtol=1e-6, atol=1e-7) for n in once)


def test_backward_finds_the_tensors_saved_before_already_coming_back():
    model = _model()
    fetched = []

    class Recording(ActivationOffload):
        def _fetch(self, index):
            fetched.append((index, index in self.back))
            return super()._fetch(index)

    hooks = Recording(model, torch.device("cpu"))
    asked = []  # (index, already on its way back) of each read of a moved tensor
    unpack = hooks.unpack_hook
    hooks.unpack_hook = lambda i: (asked.append((i, i in hooks.back)) if isinstance(i, int) else None, unpack(i))[1]
    _grads(model, hooks)
    n = len(hooks.saved)
    assert sorted(i for i, _ in fetched) == list(range(n)) == sorted(i for i, _ in asked)  # each comes back once
    assert not any(prefetched for _, prefetched in fetched)
    # backward reads them about in reverse: two reads in three found theirs already coming back (a block's
    # attention reads its four in forward order: the first of those is not)
    assert not asked[0][1] and sum(found for _, found in asked) >= 2 * n // 3


def test_offload_replay_on_hand_computed_timelines():
    assert IN_FLIGHT == 2  # the timelines below assume the trainer's two copies in flight
    gb = 1e9
    # one tensor: still going down when the forward ends, kept on the device: no wait
    assert offload_stall_seconds([1.0], [2.0], [[gb]], gb) == 0.0
    # the first piece's copy lands as the forward ends (t = 2), the second's does not (kept): the first comes
    # back while the second runs its backward (2 -> 3), in time
    assert offload_stall_seconds([1.0, 1.0], [1.0, 1.0], [[gb], [gb]], gb) == 0.0
    # copies of 3 s behind forwards of 1 s: landed at 4, 7, 10; the fourth save waits for the first copy (t 3 -> 4),
    # so the forward ends at 5, with the last three kept; the first comes back 5 -> 8, read at 8: one second lost
    assert offload_stall_seconds([1.0] * 4, [1.0] * 4, [[3 * gb]] * 4, gb) == pytest.approx(1.0)
    # an infinitely fast link costs nothing; no bytes, nothing
    assert offload_stall_seconds([1.0, 2.0], [2.0, 4.0], [[gb, gb], [gb]], 1e30) == pytest.approx(0.0, abs=1e-12)
    assert offload_stall_seconds([1.0, 2.0], [2.0, 4.0], [[], []], gb) == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script's answer where no GPU is visible")
def test_the_gpu_measurement_script_resolves_its_configs_and_says_it_needs_a_gpu(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "validation" / "offload_overlap.py"
    spec = importlib.util.spec_from_file_location("offload_overlap", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for ac in (0, 1):  # the four configs it measures resolve, offloading off and on
        assert [script._cfg(ac, on).memory.offload_activations for on in (False, True)] == [False, True]
    assert script.main(["--out", "unused.json"]) == 2
    assert "none is visible here" in capsys.readouterr().err and not Path("unused.json").exists()
