"""Host-to-device path: narrow token ids (data.narrow_ids) and the prefetcher (data.cuda_prefetch).

Both switches must leave the training stream unchanged: the same int64 batches on the device, in the
same order, as the plain loader with int64 ids.
"""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import config as C
from tokenmill.data import build_datasets, build_train_loader, prepare, to_device, val_batches
from tokenmill.data.dataset import id_dtype
from tokenmill.data.loader import DevicePrefetcher
from tokenmill.data.tokenizers import ByteTokenizer


def data_cfg(**kw) -> C.DataConfig:
    return C.DataConfig(**kw)


def host_batches(cfg: C.DataConfig, vocab: int | None, steps: int = 4, block: int = 16, grad_accum: int = 2):
    src = build_datasets(cfg, block, seed=5, model_vocab_size=vocab, progress=False)
    loader = build_train_loader(src.train, cfg, batch_size=3, grad_accum=grad_accum, start_step=0, max_steps=steps)
    return src, list(loader)


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory):
    src = tmp_path_factory.mktemp("text") / "t.txt"
    src.write_text("".join(chr(32 + (i * 7) % 90) for i in range(6000)) + "\n", encoding="utf-8")
    return prepare(src, tmp_path_factory.mktemp("bytes"), "bytes", workers=1, progress=False)


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory):
    """A 70,000-id vocabulary: stored as uint32, so narrow ids are int32."""

    class WideBytes(ByteTokenizer):
        vocab_size = 70_000

    src = tmp_path_factory.mktemp("wide") / "t.txt"
    src.write_text("abcdefgh\n" * 300)
    return prepare(src, tmp_path_factory.mktemp("wideout"), WideBytes(), progress=False)


def test_id_dtype():
    assert id_dtype(50257, False) is torch.int64
    assert id_dtype(50257, True) is torch.uint16 and id_dtype(65536, True) is torch.uint16
    assert id_dtype(65537, True) is torch.int32


@pytest.mark.parametrize("case", ["synthetic-uint16", "synthetic-int32", "tokens-uint16", "tokens-int32"])
def test_narrow_ids_give_the_same_batches(case, byte_folder, wide_folder):
    kind, narrow_type = case.split("-")
    if kind == "synthetic":
        base, vocab = {"source": "synthetic"}, (50257 if narrow_type == "uint16" else 100_000)
    else:
        base, vocab = {"path": str(byte_folder if narrow_type == "uint16" else wide_folder)}, None
    src, wide = host_batches(data_cfg(**base), vocab)
    nsrc, narrow = host_batches(data_cfg(narrow_ids=True, **base), vocab)
    want = getattr(torch, narrow_type)
    assert len(wide) == len(narrow) == 8
    for (x, y), (nx, ny) in zip(wide, narrow):
        assert x.dtype == y.dtype == torch.int64 and nx.dtype == ny.dtype == want
        assert nx.element_size() < x.element_size()  # fewer bytes cross to the device
        dx, dy = to_device((nx, ny), "cpu")  # widened after the copy
        assert dx.dtype == dy.dtype == torch.int64
        assert torch.equal(dx, x) and torch.equal(dy, y)
    if kind == "tokens":
        assert wide[0][0].max() > 0
        (vx, vy), = val_batches(nsrc.val, 2, 1)
        (wx, wy), = val_batches(src.val, 2, 1)
        assert vx.dtype == want and torch.equal(to_device((vx, vy), "cpu")[0], wx)


def test_narrow_ids_keep_the_top_id():
    """uint16 holds ids up to 65535 (int16 would wrap them negative)."""
    cfg = data_cfg(source="synthetic", narrow_ids=True)
    src = build_datasets(cfg, 4000, seed=0, model_vocab_size=65536, with_val=False, progress=False)
    x, _ = src.train[0]
    assert x.dtype == torch.uint16
    wide = to_device((x, x), "cpu")[0]
    assert wide.max().item() > 65000 and wide.min().item() >= 0


@pytest.mark.parametrize("side_stream", [True, False])
def test_prefetcher_on_cpu_is_a_plain_copy_in_order(side_stream):
    cfg = data_cfg(source="synthetic", narrow_ids=True)
    _, batches = host_batches(cfg, 50257)
    pf = DevicePrefetcher(batches, "cpu", side_stream=side_stream)
    assert not pf.uses_side_stream  # no CUDA stream off CUDA
    got = list(pf)
    assert len(got) == len(batches)
    for (x, y), (hx, hy) in zip(got, batches):
        assert x.dtype == torch.int64 and torch.equal(x, hx.long()) and torch.equal(y, hy.long())
    with pytest.raises(StopIteration):
        next(pf)


def test_prefetcher_fetches_nothing_before_the_first_next():
    pulled = []

    def gen():
        for i in range(3):
            pulled.append(i)
            yield torch.full((2, 2), i), torch.full((2, 2), i)

    pf = DevicePrefetcher(gen(), "cpu")
    assert pulled == []
    assert next(pf)[0][0, 0].item() == 0 and pulled == [0]


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetcher_on_cuda_side_stream_same_batches_in_order():
    cfg = data_cfg(source="synthetic", narrow_ids=True)
    _, batches = host_batches(cfg, 50257, steps=6)
    pinned = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    pf = DevicePrefetcher(pinned, "cuda")
    assert pf.uses_side_stream
    out = []
    for x, y in pf:
        assert x.is_cuda and x.dtype == torch.int64
        out.append(((x * 1).cpu(), (y * 1).cpu()))  # consumed on the current stream
        torch.cuda._sleep(1_000_000)  # compute that the next copy overlaps
    assert len(out) == len(batches)
    for (x, y), (hx, hy) in zip(out, batches):
        assert torch.equal(x, hx.long()) and torch.equal(y, hy.long())


@pytest.mark.slow
def test_training_with_narrow_ids_is_unchanged(tmp_path):
    """Through the trainer (which widens in to_device): the same losses, step for step."""
    from conftest import tiny_cfg
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.trainer import train

    def losses(run_dir):
        return [r["loss"] for r in read_metrics(run_dir) if r.get("loss") is not None]

    common = {"train.max_steps": 4, "log.every_steps": 1, "train.eval_batches": 1, "checkpoint.save_final": False}
    train(tiny_cfg(**common), tmp_path / "a", quiet=True)
    train(tiny_cfg(**common, **{"data.narrow_ids": True}), tmp_path / "b", quiet=True)
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(la) == 4 and la == lb


@pytest.mark.slow
def test_a_sharded_folder_gives_the_same_batches_as_one_file(tmp_path):
    """The same corpus prepared into 1,024-token shards and into one file per split: the loader (random
    windows, many across a shard boundary, with and without narrow ids), the validation batches and
    training read the same tokens, memory-mapped."""
    from conftest import tiny_cfg
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.trainer import train

    src = tmp_path / "t.txt"
    src.write_text("".join(chr(32 + (i * 13) % 90) for i in range(30_000)) + "\n", encoding="utf-8")
    one = prepare(src, tmp_path / "one", "bytes", workers=1, progress=False)
    many = prepare(src, tmp_path / "many", "bytes", workers=1, progress=False, shard_tokens=1024)
    meta = json.loads((many / "meta.json").read_text())
    assert len(meta["splits"]["train"]["shards"]) > 20
    for narrow in (False, True):
        a, b = data_cfg(path=str(one), narrow_ids=narrow), data_cfg(path=str(many), narrow_ids=narrow)
        (sa, ba), (sb, bb) = host_batches(a, None, steps=6, block=100), host_batches(b, None, steps=6, block=100)
        assert len(ba) == len(bb) == 12
        assert all(torch.equal(x, y) and torch.equal(p, q) for (x, p), (y, q) in zip(ba, bb))
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(val_batches(sa.val, 2, 2), val_batches(sb.val, 2, 2)))
    common = {"train.max_steps": 3, "log.every_steps": 1, "train.eval_batches": 1, "checkpoint.save_final": False}
    train(tiny_cfg(**common, **{"data.path": str(one)}), tmp_path / "r1", quiet=True)
    train(tiny_cfg(**common, **{"data.path": str(many)}), tmp_path / "r2", quiet=True)
    losses = [[r["loss"] for r in read_metrics(tmp_path / d) if r.get("loss") is not None] for d in ("r1", "r2")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
