"""Doctor rules for fine-tuning on chat data (``data.loss_mask``, ``data.chat_packing``): padding that costs compute
and teaches nothing, and a loss mask that leaves few learned tokens in a step.

Both read the run's own figures from ``summary.json`` (type-checked where read: :data:`tokenmill.profiling.run_files.SUMMARY`;
:func:`sft_facts` puts them among the doctor's facts, typed once as ``run.sft``, a
:class:`~tokenmill.profiling.facts.Sft`): ``padding_frac`` and ``learned_frac``,
the means over the run's steps of the shares of the step's input positions that are padding and that are learned
targets, and the typed run's ``work.tokens_per_step`` and ``config``.

Thresholds:

- :data:`HEAVY_PADDING` = 0.2: a padded position costs what a real one costs (every matmul and attention runs on
  it) and adds nothing to the loss, so a share ``p`` of padding is a share ``p`` of the step's compute spent on
  nothing, and packing (``data.chat_packing=pack``, the same loss: tests/test_sft_packing.py) gives back up to
  ``1 / (1 - p)`` times the learned tokens per second. At 20% that is 1.25x, more than the run-to-run noise of a
  throughput measurement and the doctor's bar for a major finding (``MIN_SCORE`` = 0.10 of the step); packed
  runs of short conversations stay below it (next-fit packing leaves at most one conversation's length empty).
- :data:`FEW_LEARNED` = 2048 learned tokens per optimizer step: the step's loss is the mean over its learned
  tokens, so its gradient noise falls as 1 / their number; common SFT recipes (TRL's defaults: 8 conversations
  of up to 1,024 tokens per device and step, about half of them reply tokens) learn a few thousand tokens a step,
  and below 2,048 a step averages over fewer than a single window of pretraining text at that length.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import MIN_SCORE, Finding, _clamp, advice, pct, switch

HEAVY_PADDING = 0.2
FEW_LEARNED = 2048


def sft_facts(summary: dict[str, Any]) -> dict[str, Any]:
    """The chat fine-tuning figures of a run's summary (absent keys: not a chat run, or an older version)."""
    return {k: summary[k] for k in ("padding_frac", "learned_frac", "learned_tokens_per_sec")
            if summary.get(k) is not None}


@typed
def heavy_padding(run: Run) -> Optional[Finding]:
    """A share of padding of at least :data:`HEAVY_PADDING`: that share of the compute teaches nothing."""
    pad = run.sft.padding_frac
    if pad is None or pad < HEAVY_PADDING:
        return None
    packing = run.config.data.chat_packing
    ev = [f"{pct(pad)} of the input positions of a step are padding (summary.json padding_frac, data.chat_packing = "
          f"'{packing}'): each costs the compute of a real token and adds nothing to the loss",
          f"without it the same steps would learn up to {1 / (1 - pad):.2f}x the tokens per second"]
    if packing == "pad":
        sug = [switch("data.chat_packing", "pack", "several whole conversations per window, kept apart (attention "
                      "within each, positions restarting): the same loss per conversation, far less padding")]
    else:
        sug = [advice("the conversations are long for the window: next-fit packing leaves the rest of a window empty "
                      "when the next conversation does not fit; a larger model.block_size holds more of them, or "
                      "prepare with --block-size to split long ones at turn boundaries")]
    return Finding(_clamp(pad), "padding takes a large share of the compute", ev, sug)


@typed
def few_learned_tokens(run: Run) -> Optional[Finding]:
    """Fewer than :data:`FEW_LEARNED` learned tokens per optimizer step: a noisy mean, and most of the step's compute
    spent on prompt tokens that teach nothing."""
    frac, per_step = run.sft.learned_frac, run.work.tokens_per_step
    if frac is None or not per_step:
        return None
    per_step = int(per_step)
    learned = frac * per_step
    if learned >= FEW_LEARNED:
        return None
    need = -(-FEW_LEARNED // max(1, int(learned)))  # the factor that reaches the threshold
    accum = run.config.train.grad_accum_steps * need
    ev = [f"{learned:,.0f} learned tokens per step on average ({pct(frac)} of the step's {per_step:,} input "
          f"positions; summary.json learned_frac): the loss, and its gradient, is a mean over so few tokens that "
          f"each step is noisy (below {FEW_LEARNED:,}, about what common SFT recipes learn per step)",
          "the rest of the positions are prompt, template and padding: computed, not learned"]
    sug = [] if run.config.memory.optimizer_in_backward else [  # the step in backward takes no accumulation
        switch("train.grad_accum_steps", accum, f"{need}x the conversations per step, the same memory")]
    if run.config.data.chat_packing == "pad":
        sug.append(switch("data.chat_packing", "pack", "more conversations, hence more learned tokens, in the same "
                          "windows"))
    sug.append(advice("or a larger train.batch_size where memory allows; with --chat-learn last only the last reply "
                      "of each conversation is learned (--chat-learn assistant learns every reply)"))
    return Finding(MIN_SCORE, "few learned tokens per step", ev, sug)  # noise, not speed: major, ranked last


RULES = [heavy_padding, few_learned_tokens]
