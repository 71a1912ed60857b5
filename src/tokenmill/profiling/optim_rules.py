"""Doctor rules for the optimizer choice: Muon's Newton-Schulz cost on small batches, Muon on a fine-tune.

Muon (``optim.name = 'muon'``, :mod:`tokenmill.optim.muon`) orthogonalises the update of every hidden matrix
(the blocks' 2-D weights; a fused q/k/v matrix as its three parts) with five Newton-Schulz iterations per
optimizer step. Their FLOPs (the estimator's :func:`tokenmill.estimate.techniques.ns_flops`) do not grow with
the batch, while the model's forward and backward (``flops_per_token`` x tokens per step) do: on a small
batch the orthogonalisation is a measurable share of the step. The share is counted (FLOPs, from the
model's own hidden matrices, built on ``meta``), not timed, so machine load does not move it; the profile's
optimizer share is shown beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import Finding, _clamp, advice, pct, switch

MUON_SHARE = 0.05  # Newton-Schulz FLOPs at least this share of the step's FLOPs: worth naming


@functools.lru_cache(maxsize=32)
def _hidden_shapes(model_items: tuple) -> tuple[tuple[int, int], ...]:
    """The matrices Muon orthogonalises in one block of the model (a fused q/k/v split into its parts)."""
    from tokenmill import config as C
    from tokenmill.model.build import build_gpt

    model_cfg = dataclasses.replace(C.ModelConfig(**dict(model_items)), n_layer=1)
    gpt = build_gpt(model_cfg, 256, "meta")
    out = []
    for p, rows in gpt.hidden_matrices():
        out += [(r, p.shape[1]) for r in rows] if rows else [tuple(p.shape)]
    return tuple(out)


@typed
def newton_schulz_flops(run: Run) -> Optional[float]:
    """Newton-Schulz FLOPs of one optimizer step for the run's model (all blocks), or None when the run's
    model config cannot be built here."""
    from tokenmill.errors import TokenmillError
    from tokenmill.estimate.techniques import ns_flops

    try:
        items = {**dataclasses.asdict(run.config.model), "vocab_size": None}
        shapes = _hidden_shapes(tuple(sorted(items.items())))
    except (TokenmillError, TypeError, ValueError, RuntimeError):
        return None
    return run.config.model.n_layer * sum(ns_flops(s) for s in shapes)


@typed
def muon_newton_schulz(run: Run) -> Optional[Finding]:
    """Muon's orthogonalisation a sizeable share of the step's FLOPs: a small batch per optimizer step."""
    if run.config.optim.name != "muon":
        return None
    w = run.work
    fpt, tokens = w.flops_per_token, int(w.tokens_per_step or 0)
    ns = newton_schulz_flops(run)
    # the model's FLOPs per step: per token x tokens, else per operator x operators (both counted)
    model = fpt * tokens if fpt and tokens else (w.flops_per_op or 0.0) * (w.host_ops_per_step or 0.0)
    if not (model and tokens and ns):
        return None
    share = ns / (ns + model)
    if share < MUON_SHARE:
        return None
    accum, batch = run.config.train.grad_accum_steps, run.config.train.batch_size
    ev = [f"optim.name = muon: five Newton-Schulz iterations per hidden matrix every optimizer step, "
          f"{ns / 1e9:,.2f} GFLOP, against {model / 1e9:,.2f} GFLOP of forward and backward for {tokens:,} tokens: "
          f"{pct(share)} of the step's FLOPs (counted, not timed)"]
    if run.timing.optimizer_share is not None:
        ev.append(f"the optimizer step measured {pct(run.timing.optimizer_share)} of the step")
    four = ns / (ns + 4 * model)
    sug = []
    if not run.config.memory.optimizer_in_backward:
        sug.append(switch("train.grad_accum_steps", 4 * accum, f"4x the tokens per optimizer step for the same "
                          f"orthogonalisation: its share falls to about {pct(four)}"))
    sug.append(switch("train.batch_size", 4 * batch, f"the same with a 4x micro-batch, if memory allows "
                      f"(about {pct(four)})"))
    sug.append(switch("optim.name", "adamw", "no orthogonalisation (a different optimizer: compare the loss, "
                      "not only the speed)"))
    return Finding(_clamp(0.8 * share), "Muon's Newton-Schulz orthogonalisation is a large share of a small step",
                   ev, sug)


@typed
def muon_finetune(run: Run) -> Optional[Finding]:
    """Muon fine-tuning a checkpoint that was (almost always) pretrained with AdamW: listed as minor, a
    question of the loss, not of speed."""
    if run.config.optim.name != "muon" or not run.config.train.init_from:
        return None
    ev = [f"optim.name = muon with train.init_from = {run.config.train.init_from}: published checkpoints are "
          "mostly pretrained with AdamW, and Muon's orthogonalised updates differ from AdamW's in shape and scale",
          "reports on fine-tuning with the other optimizer than the pretraining one are mixed"]
    sug: list[dict[str, Any]] = [advice("compare a short run with --optim.name adamw on the validation loss "
                                        "(tokenmill eval) before a long fine-tune")]
    return Finding(0.05, "Muon on a fine-tune of a (likely) AdamW-pretrained model", ev, sug)


RULES = [muon_newton_schulz, muon_finetune]
