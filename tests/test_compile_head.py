"""``compile.scope='block'`` compiles the head and the loss (``GPT.head_loss``) as one more graph beside the
blocks', as torchtitan's and torchtune's per-block compile also compile the loss, except with
``compile.loss_outside``, the chunked loss or a pipeline stage; the estimator's compiled pieces follow the same
rule (:func:`tokenmill.model.build.compiles_head`)."""

import pytest
import torch

from conftest import tiny_cfg
from tokenmill.estimate.trace import compiled_pieces
from tokenmill.model.build import apply_compile
from tokenmill.model.gpt import GPT

BLOCK = {"compile.enabled": True, "compile.scope": "block"}


@pytest.mark.parametrize("over, pipelined, head", [
    ({}, False, True),
    ({"compile.loss_outside": True}, False, False),
    ({"model.loss_impl": "chunked"}, False, False),
    ({}, True, False),
    ({"compile.scope": "model"}, False, True),
    ({"compile.scope": "model", "compile.loss_outside": True}, False, False),
], ids=["block", "block-loss-outside", "block-chunked", "block-pipeline", "model", "trunk"])
def test_what_is_compiled_and_what_the_estimator_compiles(over, pipelined, head, monkeypatch):
    """What apply_compile hands to torch.compile (nothing compiled: torch.compile replaced by a recorder)."""
    cfg = tiny_cfg(**{**BLOCK, **over})
    with torch.device("meta"):
        model = GPT(cfg.model, 64)
    if pipelined:  # the last stage of two: the schedule applies head_loss to its hidden states
        model.keep_stage(range(1, cfg.model.n_layer), first=False, last=True)
    names = list(model.state_dict())
    wrapped = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: wrapped.append(fn) or fn)
    apply_compile(model, cfg.compile)
    heads = [fn for fn in wrapped if getattr(fn, "__func__", None) is GPT.head_loss]
    per_block = cfg.compile.scope == "block"
    assert len(heads) == (head and per_block)  # scope 'model' compiles head_loss inside the model's graph
    assert ("head_loss" in vars(model)) == (head and per_block)
    assert list(model.state_dict()) == names  # no _orig_mod. prefix: checkpoints keep their names
    expected = ({"block"} if per_block else {"embed", "block"}) | ({"head"} if head else set())
    assert compiled_pieces(cfg, pipelined) == expected
