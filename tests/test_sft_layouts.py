"""Packed chat windows (``data.chat_packing='pack'``) with the rest of the engine: FSDP2 and tensor parallelism
under torchrun, Muon, and QLoRA.

The chat folder is prepared here with the small Llama 3 tokenizer of tests/test_chat_prepare.py; windows of 128
tokens hold two or three conversations, so every step's packed windows carry sequence starts inside them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_chat_prepare import TEMPLATES, _build  # noqa: E402
from test_sft_train import conversations, write_jsonl  # noqa: E402
from tokenmill.config import DataConfig  # noqa: E402
from tokenmill.config.data import SEQUENCE_START_FLAG  # noqa: E402
from tokenmill.data.dataset import IGNORE_INDEX  # noqa: E402
from tokenmill.data.loader import build_datasets  # noqa: E402

T = 128


def prepare(d: Path) -> Path:
    """The chat folder of this file's tests, prepared in folder ``d``: its path."""
    from tokenmill.data.chat import ChatTemplate
    from tokenmill.data.chat_prepare import prepare_chat

    model = _build("llama3", d / "model", (TEMPLATES / "llama3.jinja").read_text())
    src = write_jsonl(d / "chats.jsonl", conversations(60))
    return prepare_chat(src, d / "data", ChatTemplate(model), workers=1, progress=False, val_fraction=0.2)


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("layouts"))


PACKED = {"preset": "tiny-llama", "data.chat_packing": "pack", "model.block_size": T, "model.dropout": 0,
          "train.device": "cpu", "train.precision": "fp32", "train.max_steps": 2, "log.every_steps": 1,
          "train.eval_batches": 0, "log.progress": "plain", "log.tensorboard": False, "model.fused_qkv": False}
LAYOUTS = {"fsdp": {"parallel.dp_shard": 2, "train.batch_size": 2}, "tp": {"parallel.tp": 2, "train.batch_size": 4}}


def train_args(chat: Path, run: Path, *extra) -> list[str]:
    flags = [a for k, v in PACKED.items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]
    return ["train", "--run-dir", str(run), "--data.path", str(chat), *flags, *map(str, extra)]


def losses(run: Path) -> dict[int, float]:
    from tokenmill.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


# ----------------------------------------------------------------------------------------------
# FSDP2 and TP: 2 gloo processes in the shared torchrun launch, against one process through the command line


def two_rank_jobs(tmp: Path) -> list[dict]:
    """The FSDP2 and TP runs on 2 gloo processes, on a chat folder prepared here first (in ``tmp/chat``), trained in
    the shared 2-rank launch (conftest.two_rank_launch: one launch's imports for several files)."""
    chat = prepare(tmp / "chat")
    cfg = {k: v for k, v in PACKED.items() if k != "preset"}
    return [{"preset": PACKED["preset"], "run_dir": str(tmp / name),
             "cfg": {"data.source": "tokens", "model.vocab_size": None, "data.path": str(chat), **cfg, **over}}
            for name, over in LAYOUTS.items()]


@pytest.mark.slow  # trains (in the shared torchrun launch)
def test_packed_chat_under_fsdp_and_tp_equals_one_process(two_rank_launch, tmp_path, capsys):
    """chat_packing='pack' (explicit mask on the CPU; starts from the ids' bit 30) with parallel.dp_shard=2 (each
    rank half the global batch) and parallel.tp=2 (each rank half the heads, the whole batch), on 2 gloo processes:
    every step's loss (the mean over the global batch's learned tokens) within rel 1e-5 of one process run through
    tokenmill's command line with the same config and global batch."""
    from tokenmill import config as C
    from tokenmill.cli import main

    runs = two_rank_launch / "sft_layouts"
    assert main(train_args(runs / "chat" / "data", tmp_path / "one", "--train.batch_size", 4)) == 0
    capsys.readouterr()
    one = losses(tmp_path / "one")
    assert len(one) == 2 and len(set(one.values())) == 2
    ref = C.load_toml(tmp_path / "one" / "config.toml")
    for name, over in LAYOUTS.items():
        saved = C.load_toml(runs / name / "config.toml")  # the one-process run's config but the layout
        assert {k: v for k, v in C.flatten(saved).items() if k not in over} == \
            {k: v for k, v in C.flatten(ref).items() if k not in over}, name
        got = losses(runs / name)
        assert got.keys() == one.keys(), name
        for s in one:
            assert got[s] == pytest.approx(one[s], rel=1e-5), (name, s, got[s], one[s])
        assert json.loads((runs / name / "summary.json").read_text())["layout"] == name


# ----------------------------------------------------------------------------------------------
# Muon and QLoRA: the loss of step 2 (after one update) is the packed conversations' loss one by one


def step_two_by_hand(chat: Path, run: Path, over: dict) -> tuple[float, float]:
    """Two steps of a packed run; after step 1, the step-2 global batch's mean over its learned targets computed
    by hand through the run's own (updated) model, one conversation at a time, padded (no packing, no mask):
    (logged step-2 loss, by hand)."""
    from test_sft_packing import model_cfg
    from tokenmill.train.trainer import Callbacks, train

    cfg = model_cfg("tiny-llama", None, **{"data.path": str(chat), "data.chat_packing": "pack", "model.block_size": T,
                                           "train.max_steps": 2, "train.batch_size": 2, "train.eval_batches": 0,
                                           "log.every_steps": 1, "checkpoint.save_final": False, **over})
    pack = build_datasets(DataConfig(path=str(chat), chat_packing="pack"), T, cfg.train.seed).train
    pad = build_datasets(DataConfig(path=str(chat), chat_packing="pad"), T, 0).train
    g = cfg.train.batch_size
    seen: dict = {}

    def by_hand(step: int) -> None:
        if step != 1:
            return
        model, total, count = seen["trainer"].model, 0.0, 0
        windows = [pack.item(k) for k in range(g, 2 * g)]
        assert sum(int(((pack.window(j)[0] & SEQUENCE_START_FLAG) != 0).sum()) for j in windows) > g  # packed
        with torch.no_grad():
            for j in windows:
                off, used = pack.offsets[j], pack.used[j]
                for i in np.flatnonzero((pad.offsets >= off) & (pad.offsets < off + used)):
                    x, y = (t[None].long() for t in pad.window(i))
                    total += model(x, y, reduction="sum")[1].item()
                    count += int((y != IGNORE_INDEX).sum())
        seen["by_hand"] = total / count

    train(cfg, run, quiet=True, callbacks=Callbacks(on_train_start=lambda tr: seen.update(trainer=tr),
                                                    on_step_end=by_hand))
    return losses(run)[2], seen["by_hand"]


@pytest.mark.slow  # trains (two steps)
@pytest.mark.parametrize("name, over", [
    ("muon", {"optim.name": "muon"}),
    ("qlora", {"lora.rank": 4, "lora.quantize_base": "nf4"}),
])
def test_packed_chat_step_two_loss_with_muon_and_qlora(chat, tmp_path, name, over):
    """After one Muon update (hidden matrices orthogonalised), and with QLoRA (NF4 base, adapters trained), the
    second step's logged loss equals its conversations' loss one by one over their learned tokens (rel 1e-5)."""
    if name == "qlora":
        pytest.importorskip("torchao")
    logged, by_hand = step_two_by_hand(chat, tmp_path / name, over)
    assert logged == pytest.approx(by_hand, rel=1e-5)
