"""Data: tokenizers, ``tokenmill prepare``, the embedded corpus, token files and the global stream.

Typical use::

    from tokenmill.data import build_datasets, build_train_loader, val_batches, to_device

    src = build_datasets(cfg.data, cfg.model.block_size, cfg.train.seed, cfg.model.vocab_size)
    loader = build_train_loader(src.train, cfg.data, B, A, start_step, max_steps, rank, world, "cuda")
"""

from tokenmill.errors import DataError

from .bpe import train_bpe
from .corpus import embedded_corpus_files, ensure_embedded_corpus
from .dataset import (
    SyntheticDataset,
    TokenFile,
    WindowDataset,
    global_indices,
    open_token_data,
)
from .loader import (
    DataSources,
    StreamBatchSampler,
    build_datasets,
    build_train_loader,
    start_batches,
    to_device,
    val_batches,
)
from .prepare import prepare
from .prepare_cli import add_prepare_args, run_prepare, tokenizer_from
from .tokenizers import get_tokenizer, load_tokenizer_for_data

__all__ = [
    "DataError",
    "DataSources",
    "StreamBatchSampler",
    "SyntheticDataset",
    "TokenFile",
    "WindowDataset",
    "add_prepare_args",
    "build_datasets",
    "build_train_loader",
    "embedded_corpus_files",
    "ensure_embedded_corpus",
    "get_tokenizer",
    "global_indices",
    "load_tokenizer_for_data",
    "open_token_data",
    "prepare",
    "run_prepare",
    "start_batches",
    "to_device",
    "tokenizer_from",
    "train_bpe",
    "val_batches",
]
