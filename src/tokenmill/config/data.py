"""The config's data section: where tokens come from and how they reach the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from tokenmill.config.field import F


@dataclass
class DataConfig:
    """Where tokens come from and how they reach the device."""

    source: Literal["tokens", "synthetic"] = F(
        "tokens",
        "'tokens' = a prepared token folder (data.path, or the embedded corpus when path is unset); "
        "'synthetic' = uniformly random token ids (pure throughput runs; vocab from model.vocab_size).",
    )
    path: Optional[str] = F(
        None,
        "A folder written by `tokenmill prepare` (meta.json + token shards). None: the embedded "
        "corpus (this Python's standard-library sources), prepared on first use and cached.",
        path="one",
    )
    mixture: Optional[str] = F(
        None,
        "Train on several prepared folders at once, instead of data.path: 'PATH:WEIGHT,PATH:WEIGHT,...' (the "
        "weight after each entry's last colon; positive numbers such as 3, 0.25 or 1/3, relative). The folders "
        "must share one tokenizer. Sample k's source follows a fixed schedule that holds every source's exact "
        "share in each period of samples (a pure function of train.seed and k: resume and any batch, "
        "accumulation, process or worker layout give the same stream); validation takes the sources' val "
        "splits in the same shares. The realised shares are logged (mix_share/NAME) and in summary.json.",
        path="list",
    )
    tokenizer: Literal["gpt2", "bytes", "bpe"] = F(
        "bpe",
        "Tokenizer used when the embedded corpus is prepared on first use: 'gpt2' (tiktoken), 'bytes' "
        "(256 ids), 'bpe' (byte-level BPE trained on the corpus with HF tokenizers).",
    )
    bpe_vocab_size: int = F(4096, "Vocabulary size of the 'bpe' tokenizer trained for the embedded corpus.", ge=257)
    cache_dir: Optional[str] = F(
        None, "Where the embedded corpus is prepared and cached. None: $TOKENMILL_CACHE or ~/.cache/tokenmill.",
        path="one",
    )
    sampling: Literal["random", "sequential"] = F(
        "random",
        "'random' = windows at random offsets; 'sequential' = non-overlapping windows in file order, "
        "wrapping around. Both are a pure function of (seed, global sample index).",
    )
    validate: Literal["full", "quick"] = F(
        "full",
        "'full' scans every token id against the vocabulary before training; 'quick' checks only "
        "metadata, dtype and file sizes.",
    )
    num_workers: int = F(0, "DataLoader worker processes (0 = load in the training process).", ge=0)
    pin_memory: bool = F(False, "Page-locked host batches (faster, asynchronous host-to-device copies).")
    non_blocking: bool = F(False, "Host-to-device copies with non_blocking=True (overlap with compute when pinned).")
    persistent_workers: bool = F(True, "Keep DataLoader workers alive between epochs/evals (num_workers > 0).")
    prefetch_factor: int = F(2, "Batches prefetched per worker (num_workers > 0).", ge=1)
    cpu_work_ms: float = F(
        0.0,
        "Synthetic CPU workload per sample, in milliseconds (holds the GIL, like text augmentation). "
        "Reproduces the book's data-bound case; the tokens are unchanged.",
        ge=0, le=60_000,
    )
    narrow_ids: bool = F(
        False,
        "Send token ids to the device in a narrow type, uint16 when the vocabulary fits (<= 65536 ids) "
        "else int32, and widen them to int64 there: 4x (2x) fewer bytes per host-to-device copy and in "
        "pinned host memory. The same ids.",
    )
    cuda_prefetch: bool = F(
        False,
        "Double-buffered prefetch on CUDA: the next batch is copied (and widened) on a side CUDA stream "
        "while the current one computes (tokenmill.data.loader.DevicePrefetcher; pair with data.pin_memory). "
        "No effect off CUDA (plain copies). The same batches in the same order.",
    )
    document_mask: bool = F(
        False,
        "Keep documents apart inside a packed window: attention is causal AND within one document, documents "
        "ending with the data's end-of-text token (meta.json tokenizer.eot_id; the token belongs to the "
        "document it ends). The model derives each token's document from the input ids (model/gpt.py), so "
        "data, loader and data parallelism are unchanged. model.document_attention: FlexAttention (CUDA's default) or "
        "an explicit (batch, 1, T, T) mask, which costs the flash kernel. The loss still counts every "
        "position. Needs an end-of-text id (not the 'bytes' tokenizer, not synthetic data); not with "
        "parallel.pp > 1, nor model.sdpa_backend='flash' on the explicit path (FlexAttention bypasses SDPA's kernels, "
        "so 'flash' is allowed with it); generation with the KV cache does not use it. A chat folder's conversations "
        "are kept apart by data.chat_packing='pack' instead (from its start bits: chat templates emit no end-of-text).",
    )
    document_positions: bool = F(
        False,
        "With data.document_mask: positions (learned or rotary) restart at 0 in every document, so each "
        "document is computed exactly as if it stood alone at the start of a window.",
    )
    loss_mask: Optional[bool] = F(None, "Learn only the tokens the folder's loss mask marks (`prepare --format chat`; "
        "other targets -100), the loss a mean over the global batch's learned tokens (any accumulation or process "
        "layout alike). None (auto): when the folder has one; true: required; false: every token. Not with "
        "parallel.pp > 1 or data.mixture.")
    chat_packing: Literal["pad", "pack"] = F(
        "pad",
        "How a chat folder's conversations (data.loss_mask on) fill the model.block_size windows. 'pad' = one "
        "conversation per window, padded (pad targets ignored): the default, as in TRL (SFTConfig packing=False), "
        "Axolotl (sample_packing: false) and litgpt, so a step's samples are conversations and nothing is shared "
        "between them. 'pack' = as many whole conversations as fit in each window (next fit in file order), the "
        "boundaries taken from the folder's sequence-start bits: attention kept within each conversation and "
        "positions restarting at 0 in each, so the loss equals the same conversations trained one by one, with "
        "far less padding when conversations are short (model.document_attention picks FlexAttention or the "
        "explicit mask). Either way a window starts at a conversation's start, a conversation longer than the "
        "window is cut to it (prepare with --block-size to split it at turn boundaries instead), and the shares "
        "of padding and of learned tokens are logged (padding_frac, learned_frac). Each sample is a pure "
        "function of (train.seed, its index): resume and any layout give the same stream.",
    )


# data.chat_packing='pack': the input id of each conversation's first token carries this bit, which the model
# strips to find the boundaries (model/gpt.py); every token id is below it.
SEQUENCE_START_FLAG = 1 << 30
