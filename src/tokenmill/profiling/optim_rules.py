"""Doctor rules for the optimizer choice: Muon's Newton-Schulz cost on small batches, Muon on a fine-tune.

Muon (``optim.name = 'muon'``, :mod:`tokenmill.optim.muon`) orthogonalises the update of every hidden matrix
with five Newton-Schulz iterations per optimizer step: the blocks' 2-D weights (a fused q/k/v matrix as its
three parts), and in a mixture-of-experts layer each routed expert's matrices on their own (its gate and up
rows apart, and its down matrix), while the router and the shared-expert gate go to AdamW. Their FLOPs (the
estimator's :func:`tokenmill.estimate.techniques.ns_flops`) do not grow with the batch, while the model's
forward and backward (``flops_per_token`` x tokens per step) do: on a small batch the orthogonalisation is a
measurable share of the step. The share is counted (FLOPs, from the model's matrices as
:mod:`tokenmill.config.matrices` describes them, block by block: dense and sparse layers as
``model.moe_every`` and ``model.moe_dense_layers`` place them), not timed, so machine load does not move it;
the profile's optimizer share is shown beside it. With LoRA (``lora.rank``) Muon steps the adapters only
(rank-wide matrices: a negligible orthogonalisation), so the rule stays quiet.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenmill.config.matrices import Matrix, model_matrices
from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import Finding, _clamp, advice, pct, switch

MUON_SHARE = 0.05  # Newton-Schulz FLOPs at least this share of the step's FLOPs: worth naming
ADAMW_ROLES = ("router", "shared_router")  # a mixture of experts' gates: AdamW's (optim/muon.py _moe_parameters)


def muon_parts(x: Matrix) -> list[tuple[int, tuple[int, int]]]:
    """The matrices Muon orthogonalises in ``x``: (how many, each one's (rows, cols)), one entry per part of a
    fused matrix (``x.split``); a routed experts' stack is as many matrices as experts. Nothing for AdamW's."""
    if x.role in ADAMW_ROLES:
        return []
    count, cols = (x.shape[0] if len(x.shape) == 3 else 1), x.shape[-1]
    return [(count, (rows, cols)) for rows in (x.split or (x.shape[-2],))]


@typed
def newton_schulz_flops(run: Run) -> Optional[float]:
    """Newton-Schulz FLOPs of one optimizer step for the run's model (every block, dense or sparse), or None
    when the run's model config cannot be described here or LoRA leaves the matrices frozen."""
    from tokenmill.errors import TokenmillError
    from tokenmill.estimate.techniques import ns_flops

    if run.config.lora.rank:
        return None
    try:
        blocks = model_matrices(run.config.model)
    except (TokenmillError, TypeError, ValueError):
        return None
    return float(sum(k * ns_flops(shape) for block in blocks for x in block for k, shape in muon_parts(x)))


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
    if run.config.model.sparse_layers():
        ev.append(f"{run.config.model.moe_experts} routed experts in each of {len(run.config.model.sparse_layers())} "
                  "sparse layer(s): each expert's matrices are orthogonalised on their own")
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
