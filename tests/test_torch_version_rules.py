"""The estimator names the torch versions its imitated rules were read from; on another torch this fails,
saying what to re-read. Which pieces it compiles comes from ``apply_compile``'s own function."""

import pytest
import torch

from tokenmill import config as C
from tokenmill.estimate.torch_rules import REREAD, RULES_TORCH, in_range, major_minor


def test_this_torch_is_one_the_estimators_rules_were_read_from():
    lo, hi = RULES_TORCH
    got = major_minor(torch.__version__)
    assert in_range(torch.__version__), (
        f"torch {got[0]}.{got[1]} is outside {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}, the versions the estimator's imitated "
        "rules were read from (tokenmill/estimate/torch_rules.py RULES_TORCH). Re-read, check against a run and "
        "update before widening the range:\n- " + "\n- ".join(REREAD))


def test_version_parsing_and_range():
    assert major_minor("2.13.0+cpu") == (2, 13) and major_minor("2.11.0a0+git1234") == (2, 11)
    assert major_minor("3.0.1") == (3, 0)
    lo, hi = RULES_TORCH
    assert in_range(f"{lo[0]}.{lo[1]}.0") and in_range(f"{hi[0]}.{hi[1]}.1+cu128")
    assert not in_range(f"{lo[0]}.{lo[1] - 1}.0") and not in_range(f"{hi[0]}.{hi[1] + 1}.0")


@pytest.mark.parametrize("over, pieces, compiled", [
    ({}, set(), None),
    ({"compile.enabled": True}, {"embed", "block", "head"}, "model"),
    ({"compile.enabled": True, "compile.scope": "block"}, {"block", "head"}, "blocks"),
    ({"compile.enabled": True, "compile.loss_outside": True}, {"embed", "block"}, "trunk"),
    ({"compile.enabled": True, "model.loss_impl": "chunked"}, {"embed", "block"}, "model"),
])
def test_the_estimator_compiles_what_apply_compile_compiles(over, pieces, compiled, monkeypatch):
    from tokenmill.estimate.trace import compiled_pieces
    from tokenmill.model.build import apply_compile, compile_scope
    from tokenmill.model.gpt import GPT

    cfg = C.resolve("tiny", overrides={"data.source": "synthetic", "model.vocab_size": 64, **over},
                    overrides_from_string=False)
    assert compiled_pieces(cfg) == pieces and compile_scope(cfg.compile) == compiled
    with torch.device("meta"):
        model = GPT(cfg.model, 64)
    wrapped = []  # what apply_compile hands to torch.compile (nn.Module.compile calls it too)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: wrapped.append(getattr(fn, "__self__", fn)) or fn)
    apply_compile(model, cfg.compile)
    blocks = [b for _, b in model.present_blocks()]
    kinds = {"model": [model], "blocks": blocks + [model], "trunk": [model], None: []}[compiled]  # + head_loss
    assert wrapped == kinds
    assert ("trunk" in vars(model)) == (compiled == "trunk")
    assert ("head_loss" in vars(model)) == (compiled == "blocks")
