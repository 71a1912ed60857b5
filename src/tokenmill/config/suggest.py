""""Did you mean": the closest config key for a mistyped or foreign one.

Users bring names from other tools (nanoGPT's ``learning_rate``, ``max_iters``, ``n_layer``; torchtitan's
``lr``, ``steps``, ``seq_len``; litgpt's ``micro_batch_size``; Hugging Face's ``hidden_size``...) and put
a field in the wrong section (``train.block_size`` for ``model.block_size``). So, in order: a field of
that name in another section; a known foreign name; a close spelling of the whole key; a close spelling
of the field name alone, in any section.
"""

from __future__ import annotations

import difflib

# Names used by nanoGPT, torchtitan, litgpt and Hugging Face configs -> the tokenmill key.
ALIASES: dict[str, str] = {
    "lr": "optim.lr", "learning_rate": "optim.lr", "max_lr": "optim.lr", "min_lr": "optim.min_lr",
    "lr_min": "optim.min_lr", "warmup_iters": "optim.warmup_steps", "warmup_steps": "optim.warmup_steps",
    "lr_warmup_steps": "optim.warmup_steps", "weight_decay": "optim.weight_decay", "beta1": "optim.beta1",
    "beta2": "optim.beta2", "grad_clip": "optim.grad_clip", "max_norm": "optim.grad_clip",
    "max_grad_norm": "optim.grad_clip", "gradient_clip_val": "optim.grad_clip", "lr_scheduler": "optim.schedule",
    "decay_lr": "optim.schedule", "max_iters": "train.max_steps", "max_steps": "train.max_steps",
    "steps": "train.max_steps", "training_steps": "train.max_steps", "iters": "train.max_steps",
    "micro_batch_size": "train.batch_size", "local_batch_size": "train.batch_size", "batch_size": "train.batch_size",
    "per_device_train_batch_size": "train.batch_size", "gradient_accumulation_steps": "train.grad_accum_steps",
    "grad_accum": "train.grad_accum_steps", "eval_interval": "train.eval_every_steps",
    "eval_iters": "train.eval_batches", "dtype": "train.precision", "mixed_precision": "train.precision",
    "mixed_precision_param": "train.precision", "seed": "train.seed", "init_from": "train.init_from",
    "log_interval": "log.every_steps", "log_freq": "log.every_steps", "checkpoint_interval": "checkpoint.every_steps",
    "save_interval": "checkpoint.every_steps", "block_size": "model.block_size", "seq_len": "model.block_size",
    "max_seq_len": "model.block_size", "max_seq_length": "model.block_size", "context_length": "model.block_size",
    "max_position_embeddings": "model.block_size", "n_layer": "model.n_layer", "n_layers": "model.n_layer",
    "num_layers": "model.n_layer", "num_hidden_layers": "model.n_layer", "n_head": "model.n_head",
    "n_heads": "model.n_head", "num_heads": "model.n_head", "num_attention_heads": "model.n_head",
    "n_kv_heads": "model.n_kv_head", "n_query_groups": "model.n_kv_head", "num_key_value_heads": "model.n_kv_head",
    "n_embd": "model.n_embd", "dim": "model.n_embd", "d_model": "model.n_embd", "hidden_size": "model.n_embd",
    "intermediate_size": "model.intermediate_size", "ffn_dim": "model.intermediate_size",
    "ffn_hidden_size": "model.intermediate_size", "hidden_dim": "model.intermediate_size",
    "vocab_size": "model.vocab_size", "padded_vocab_size": "model.vocab_pad_multiple",
    "padding_multiple": "model.vocab_pad_multiple", "rope_theta": "model.rope_theta", "rope_base": "model.rope_theta",
    "norm_eps": "model.norm_eps", "rms_norm_eps": "model.norm_eps", "layer_norm_epsilon": "model.norm_eps",
    "tie_word_embeddings": "model.tie_embeddings", "tie_embeddings": "model.tie_embeddings",
    "dropout": "model.dropout", "bias": "model.bias", "attention_bias": "model.qkv_bias",
    "compile": "compile.enabled", "activation_checkpointing": "memory.activation_checkpointing",
    "gradient_checkpointing": "memory.activation_checkpointing", "ac": "memory.activation_checkpointing",
    "tensor_parallel_degree": "parallel.tp", "tp_degree": "parallel.tp", "pipeline_parallel_degree": "parallel.pp",
    "data_parallel_shard_degree": "parallel.dp_shard", "data_parallel_replicate_degree": "parallel.dp_replicate",
    "num_workers": "data.num_workers", "dataset": "data.path", "data_dir": "data.path", "train_data_dir": "data.path",
}


def suggest(key: str, options: list[str]) -> str:
    """`` Did you mean 'section.field'?`` for an unknown ``key`` (``section.field`` or a bare name), or ''."""
    hit = closest_key(key, options)
    return f" Did you mean '{hit}'?" if hit else ""


def closest_key(key: str, options: list[str]) -> str | None:
    """The config key meant by ``key`` (see the module doc), or None."""
    name = key.split(".")[-1].lower().replace("-", "_")
    by_field: dict[str, list[str]] = {}
    for o in options:
        by_field.setdefault(o.split(".")[-1], []).append(o)
    hit = None
    if name in by_field:  # the right field in the wrong section
        hit = by_field[name][0]
    elif ALIASES.get(name) in options:
        hit = ALIASES[name]
    else:
        m = difflib.get_close_matches(key, options, n=1, cutoff=0.75)
        if m:
            hit = m[0]
        else:
            m2 = difflib.get_close_matches(name, list(by_field) + list(ALIASES), n=1, cutoff=0.6)
            if m2:
                hit = by_field[m2[0]][0] if m2[0] in by_field else ALIASES[m2[0]]
    return hit
