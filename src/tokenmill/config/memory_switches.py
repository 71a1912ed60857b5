"""The one list of memory-saving switches: what each saves, when it applies to a config, and the flags
that turn it on. The out-of-memory message (``train/advice.py``), the estimator's advice
(``estimate/advice.py``: it estimates each and names the one that fits) and the doctor's memory rules
(``profiling/memory_rules.py``: the switches that save what dominates the run's peak) all read it, so a
new memory technique is added here once.

A config is read through ``get('section.field')``, so the same list serves a :class:`Config` and the
doctor's flat view of a recorded run (:func:`getter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FINETUNE_MICRO_BATCH", "FINETUNE_RECIPE", "MemorySwitch", "finetune_recipe", "flags", "getter",
           "memory_switches"]

Get = Callable[[str], Any]

ACTIVATIONS, LOGITS, OPTIMIZER, GRADIENTS, WEIGHTS = "activations", "logits", "optimizer", "gradients", "weights"


@dataclass(frozen=True)
class MemorySwitch:
    """``overrides`` (key -> value: the flags, including any a switch needs to be valid), ``why`` (what it
    saves and costs), ``saves`` (which part of the memory it shrinks), ``several_gpus`` (helps only when
    the job has more than one process)."""

    overrides: dict[str, Any]
    why: str
    saves: frozenset[str] = field(default_factory=frozenset)
    several_gpus: bool = False


def flags(s: MemorySwitch) -> str:
    """``--key value ...`` as typed on the command line."""
    return " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in s.overrides.items())


def getter(cfg: Any) -> Get:
    """``get`` for a :class:`~tokenmill.config.Config`."""
    return lambda key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])


def _optimizer_alternative_free(get: Get) -> bool:
    """None of the exclusive optimizer-memory switches is on (they exclude each other)."""
    return not any(get(f"memory.{k}") for k in ("optimizer_8bit", "optimizer_offload", "optimizer_in_backward"))


def _loss_compiled_with_model(get: Get) -> bool:
    """The loss is inside a compiled graph, the whole model's or the head's (where ``model.return_logits`` acts)."""
    return get("compile.enabled") and not get("compile.loss_outside") and get("parallel.pp") == 1


def _activation_switches(get: Get) -> list[MemorySwitch]:
    out = []
    if get("memory.activation_checkpointing") != 1:
        out.append(MemorySwitch({"memory.activation_checkpointing": 1},
                                "recompute activations in backward (about a third more compute)",
                                frozenset({ACTIVATIONS})))
    elif get("memory.activation_checkpointing_policy") != "full":  # every block checkpointed, selectively
        out.append(MemorySwitch({"memory.activation_checkpointing_policy": "full"},
                                "recompute the matmuls too: keep only each block's input",
                                frozenset({ACTIVATIONS})))
    b, a = get("train.batch_size"), get("train.grad_accum_steps")
    pp = get("parallel.pp")
    pp_micro = (get("parallel.pp_microbatches") or pp) if pp > 1 else 1
    if b >= 2 and not b % 2 and not (b // 2) % pp_micro and not get("memory.optimizer_in_backward"):
        out.append(MemorySwitch({"train.batch_size": b // 2, "train.grad_accum_steps": 2 * a},
                                "same global batch, half the activations", frozenset({ACTIVATIONS, LOGITS})))
    if get("train.precision") == "fp32":
        out.append(MemorySwitch({"train.precision": "bf16-autocast"}, "half-size activations",
                                frozenset({ACTIVATIONS})))
    if get("model.attention") == "manual":
        out.append(MemorySwitch({"model.attention": "sdpa"}, "no T x T attention matrix", frozenset({ACTIVATIONS})))
    if get("model.loss_impl") == "full" and get("model.return_logits") and _loss_compiled_with_model(get):
        out.append(MemorySwitch({"model.return_logits": False}, "the compiled model returns only the loss: no zero "
                                "gradient for the unused logits, backward overwrites them in place",
                                frozenset({LOGITS})))
    if get("model.loss_impl") == "full":
        out.append(MemorySwitch({"model.loss_impl": "chunked"}, "no full vocabulary logits", frozenset({LOGITS})))
    return out


def _state_switches(get: Get) -> list[MemorySwitch]:
    out = []
    free, fp16 = _optimizer_alternative_free(get), get("train.precision") == "fp16-autocast"
    model_parallel = get("parallel.tp") > 1 or get("parallel.pp") > 1
    sharded = get("parallel.dp_shard") != 1
    if get("train.init_from") and not get("lora.rank") and not model_parallel:  # a full fine-tune
        out.append(MemorySwitch({"lora.rank": 16}, "fine-tune LoRA adapters only: no gradients or AdamW state for "
                                "the base weights (`tokenmill estimate --finetune` compares)",
                                frozenset({OPTIMIZER, GRADIENTS})))
    if free and not fp16 and not sharded and not model_parallel:
        out.append(MemorySwitch({"memory.optimizer_offload": True}, "AdamW state and its step in CPU memory",
                                frozenset({OPTIMIZER})))
    if get("memory.optimizer_offload") and not get("memory.offload_gradients"):
        out.append(MemorySwitch({"memory.offload_gradients": True}, "the gradients too: each leaves the device "
                                "inside backward, as soon as it is complete", frozenset({GRADIENTS})))
    if get("optim.impl") != "for-loop" and not (get("memory.optimizer_offload") or get("memory.optimizer_8bit")):
        out.append(MemorySwitch({"optim.impl": "for-loop"}, "smaller optimizer temporaries (the state itself stays)",
                                frozenset({OPTIMIZER})))
    return out


def _optimizer_alternatives(get: Get) -> list[MemorySwitch]:
    """Switches the doctor offers for a state-dominated peak that the estimator does not search (they need an
    optional package, change the numerics, or need several GPUs)."""
    out = []
    free, fp16 = _optimizer_alternative_free(get), get("train.precision") == "fp16-autocast"
    model_parallel = get("parallel.tp") > 1 or get("parallel.pp") > 1
    if get("train.precision") != "bf16":
        out.append(MemorySwitch({"train.precision": "bf16"}, "pure bf16 halves weights, gradients and optimizer "
                                "state", frozenset({OPTIMIZER, WEIGHTS, GRADIENTS})))
    if free and not model_parallel:
        out.append(MemorySwitch({"memory.optimizer_8bit": True}, "8-bit AdamW state, about a quarter of fp32 state "
                                "(needs torchao)", frozenset({OPTIMIZER})))
    if get("lora.rank") and get("lora.quantize_base") == "none":
        out.append(MemorySwitch({"lora.quantize_base": "nf4"}, "QLoRA: the frozen blocks' projection weights as NF4, "
                                "about a quarter of bf16 (needs torchao; the base is rounded to 4 bits)",
                                frozenset({WEIGHTS})))
    if free and not fp16 and get("train.grad_accum_steps") == 1:
        also = {"optim.grad_clip": 0} if get("optim.grad_clip") > 0 else {}
        out.append(MemorySwitch({"memory.optimizer_in_backward": True, **also}, "step in backward: no full set "
                                "of gradient buffers" + (" (no gradient clipping)" if also else ""),
                                frozenset({GRADIENTS})))
    if get("parallel.dp_shard") == 1 and not get("parallel.zero1"):
        if not model_parallel:
            out.append(MemorySwitch({"parallel.zero1": True}, "with several GPUs: shard the optimizer state over "
                                    "data-parallel ranks", frozenset({OPTIMIZER}), several_gpus=True))
        also = {"parallel.dp_replicate": 1} if get("parallel.dp_replicate") == -1 else {}
        out.append(MemorySwitch({"parallel.dp_shard": -1, **also}, "with several GPUs: FSDP shards parameters, "
                                "gradients and state", frozenset({OPTIMIZER, GRADIENTS, WEIGHTS}), several_gpus=True))
    if get("parallel.dp_shard") != 1 and not get("parallel.fsdp_cpu_offload") and not model_parallel:
        out.append(MemorySwitch({"parallel.fsdp_cpu_offload": True}, "FSDP keeps the parameter and gradient shards "
                                "and the optimizer step in CPU memory, each group copied in as it runs (slower: "
                                "the copies cross PCIe every step)", frozenset({OPTIMIZER, GRADIENTS, WEIGHTS}),
                                several_gpus=True))
    return out


def memory_switches(get: Get, searched_only: bool = False) -> list[MemorySwitch]:
    """The memory-saving switches the config read by ``get`` does not use yet, most commonly useful first.
    ``searched_only``: only those the estimator evaluates (no optional package, same numerics, one GPU)."""
    out = _activation_switches(get) + _state_switches(get)
    return out if searched_only else out + _optimizer_alternatives(get)


# The recipe fine-tuners run (torchtune's single-GPU LoRA configs, for one: bf16 weights, activation
# checkpointing, a chunked cross-entropy): `tokenmill estimate --finetune` starts from it. With it, a micro-batch
# of FINETUNE_MICRO_BATCH sequence(s), accumulated to the same global batch (Lit-GPT's and Answer.AI's fine-tunes
# and Hugging Face's per-device batch of 1-4 with gradient accumulation): a preset's pre-training micro-batch
# (8 x 8,192 tokens for Llama 3.1 8B) is not what a fine-tune on one GPU runs.
FINETUNE_RECIPE = {"train.precision": "bf16", "memory.activation_checkpointing": 1, "model.loss_impl": "chunked"}
FINETUNE_MICRO_BATCH = 1


def finetune_recipe(get: Get) -> list[MemorySwitch]:
    """The switches of :data:`FINETUNE_RECIPE` that the config read by ``get`` does not use yet, as the list
    above has them, then the micro-batch of :data:`FINETUNE_MICRO_BATCH` (the same global batch)."""
    out = [s for s in memory_switches(get) if s.overrides.items() <= FINETUNE_RECIPE.items()]
    b, a = get("train.batch_size"), get("train.grad_accum_steps")
    pipelined = get("parallel.pp") > 1  # a pipeline splits each micro-batch into its own micro-batches
    if b > FINETUNE_MICRO_BATCH and not b % FINETUNE_MICRO_BATCH and not pipelined and not get(
            "memory.optimizer_in_backward"):  # optimizer_in_backward steps on every micro-batch: no accumulation
        out.append(MemorySwitch({"train.batch_size": FINETUNE_MICRO_BATCH,
                                 "train.grad_accum_steps": a * b // FINETUNE_MICRO_BATCH},
                                "the same global batch, accumulated over micro-batches of "
                                f"{FINETUNE_MICRO_BATCH} sequence(s)", frozenset({ACTIVATIONS, LOGITS})))
    return out
