"""DataLoaders over the global stream, validation batches, datasets from a DataConfig, and the
host-to-device step: :func:`to_device` (widens narrow token ids on the device) and
:class:`DevicePrefetcher` (the next batch copied on a side CUDA stream while this one computes)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tokenmill import signals
from tokenmill.errors import DataError

from .chat_windows import ChatWindows
from .dataset import SyntheticDataset, WindowDataset, global_indices, id_dtype, open_token_data
from .mixture import MixtureDataset, open_mixture


class StreamBatchSampler(Sampler[list[int]]):
    """Yields, in order, this rank's micro-batches (lists of global indices) of steps
    ``start_step .. max_steps-1``: for each step, micro-steps ``0 .. grad_accum-1``.

    The global stream is consumed ``batch_size x grad_accum x dp_size`` samples a step, from global
    sample ``start_sample`` on (default ``start_step`` x that global batch). A resumed run passes the
    number of samples its checkpoint had consumed, so a run resumed with another global batch (another
    data-parallel degree or accumulation) continues the same stream, neither replaying nor skipping."""

    def __init__(
        self,
        batch_size: int,
        grad_accum: int,
        start_step: int,
        max_steps: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        start_sample: int | None = None,
    ):
        if (batch_size < 1 or grad_accum < 1 or not 0 <= dp_rank < dp_size or start_step < 0
                or (start_sample is not None and start_sample < 0)):
            raise ValueError(
                f"bad stream layout: batch_size={batch_size}, grad_accum={grad_accum}, dp_rank={dp_rank}, "
                f"dp_size={dp_size}, start_step={start_step}, start_sample={start_sample}"
            )
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.start_step, self.max_steps = start_step, max_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch = batch_size * grad_accum * dp_size
        self.start_sample = start_step * self.global_batch if start_sample is None else start_sample

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            first = self.start_sample + (step - self.start_step) * self.global_batch  # of this step
            for m in range(self.grad_accum):
                local = global_indices(0, m, self.dp_rank, self.batch_size, self.grad_accum, self.dp_size)
                yield [first + i for i in local]

    def __len__(self) -> int:
        return max(0, self.max_steps - self.start_step) * self.grad_accum

    def samples_after(self, step: int) -> int:
        """Global samples of the stream consumed once step ``step`` is done (the stream's first ones)."""
        return self.start_sample + (step - self.start_step) * self.global_batch


def build_train_loader(
    dataset: Dataset,
    data_cfg,
    batch_size: int,
    grad_accum: int,
    start_step: int,
    max_steps: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    device_type: str = "cpu",
    start_sample: int | None = None,
) -> DataLoader:
    """A DataLoader yielding ``(x, y)`` of shape ``[batch_size, block_size]`` for every micro-step of
    steps ``start_step .. max_steps-1`` of this rank, in order (``grad_accum`` batches per step),
    starting at global sample ``start_sample`` (see :class:`StreamBatchSampler`).

    Uses data_cfg.num_workers, prefetch_factor and persistent_workers (the last two only with workers)
    and pin_memory (only when ``device_type == 'cuda'``).
    """
    sampler = StreamBatchSampler(batch_size, grad_accum, start_step, max_steps, dp_rank, dp_size, start_sample)
    workers = data_cfg.num_workers
    kwargs = {}
    if workers > 0:
        kwargs = {
            "persistent_workers": data_cfg.persistent_workers,
            "prefetch_factor": data_cfg.prefetch_factor,
        }
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=bool(data_cfg.pin_memory and device_type == "cuda"),
        **kwargs,
    )


def start_batches(batches: Iterable) -> Iterator:
    """``iter(batches)``, built whole: a DataLoader with workers starts them and only then records them, and
    a Ctrl-C raised between the two leaves an iterator that can neither use nor end its workers (its
    ``__del__`` fails with a traceback). A signal that comes meanwhile raises right after, and the finished
    iterator ends its workers as it goes."""
    with signals.deferred():
        return iter(batches)


def val_batches(
    val_dataset: Dataset, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` fixed validation micro-batches ``(x, y)`` (CPU; int64, or the dataset's narrow id
    type with ``data.narrow_ids``), the same on every call.

    For a token dataset: ``batch_size * n_batches`` windows with starts spread evenly over the val file
    (non-overlapping while the file is long enough); a mixture: each source's share of them, spread over
    its val split (:meth:`MixtureDataset.spread`). Otherwise (synthetic): samples ``0 .. N-1``.
    """
    n = batch_size * n_batches
    if isinstance(val_dataset, MixtureDataset):
        samples = val_dataset.spread(n)
    elif isinstance(val_dataset, WindowDataset):
        span = val_dataset.n_starts
        samples = [val_dataset.window(i * span // n) for i in range(n)]
    elif isinstance(val_dataset, ChatWindows):  # chat windows (data.chat_packing): spread over the split's windows
        samples = [val_dataset.window(i * val_dataset.n_windows // n) for i in range(n)]
    else:
        samples = [val_dataset[i] for i in range(n)]
    out = []
    for b in range(n_batches):
        chunk = samples[b * batch_size : (b + 1) * batch_size]
        out.append((torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk])))
    return out


def _widen(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def to_device(batch, device, non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Move ``(x, y)`` to ``device`` (``non_blocking`` overlaps the copy when the batch is pinned) and
    widen narrow token ids (``data.narrow_ids``: uint16/int32) to int64 there, after the copy, so
    only the narrow bytes cross the bus."""
    x, y = batch
    return _widen(x.to(device, non_blocking=non_blocking)), _widen(y.to(device, non_blocking=non_blocking))


class DevicePrefetcher:
    """Iterator of device batches ``(x, y)`` (int64) over host batches, one batch ahead.

    ``side_stream=True`` on a CUDA device (``data.cuda_prefetch``), double buffering: while the caller
    computes on batch ``i``, batch ``i+1`` is already being copied (``non_blocking``, so the host batch
    should be pinned: ``data.pin_memory``) and widened on a side CUDA stream. ``__next__`` makes the
    current stream wait for that copy, marks the tensors as used by the current stream (so the caching
    allocator does not hand their memory back to the side stream early), starts the copy of the batch
    after it and returns. Two device batches exist at a time.

    Otherwise (CPU, MPS, or ``side_stream=False``) each ``__next__`` is a plain :func:`to_device` of the
    next host batch, with ``non_blocking`` as given: the same batches, in the same order.

    Usage (the trainer)::

        batches = DevicePrefetcher(loader, device, cfg.data.non_blocking, side_stream=cfg.data.cuda_prefetch)
        x, y = next(batches)  # every micro-step

    Nothing is fetched before the first ``next``.
    """

    def __init__(self, batches: Iterable, device: torch.device | str, non_blocking: bool = False,
                 side_stream: bool = True):
        self.device = torch.device(device)
        self.host = start_batches(batches)
        self.non_blocking = non_blocking
        self.stream = None
        if side_stream and self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None
        self._started = self._done = False

    @property
    def uses_side_stream(self) -> bool:
        """Whether copies run on a side CUDA stream (False: plain copies)."""
        return self.stream is not None

    def __iter__(self) -> DevicePrefetcher:
        return self

    def _preload(self) -> None:
        """Start copying the next host batch on the side stream (or note the end of the data)."""
        try:
            batch = next(self.host)
        except StopIteration:
            self._next, self._done = None, True
            return
        with torch.cuda.stream(self.stream):
            self._next = to_device(batch, self.device, non_blocking=True)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stream is None:
            return to_device(next(self.host), self.device, self.non_blocking)
        if not self._started:
            self._started = True
            self._preload()
        if self._done:
            raise StopIteration
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)  # this batch's copy (and widening) has finished
        x, y = self._next
        x.record_stream(current)
        y.record_stream(current)
        self._preload()  # the next batch's copy overlaps the caller's compute on this one
        return x, y


@dataclass
class DataSources:
    """What :func:`build_datasets` returns."""

    train: Dataset
    val: Dataset | None
    vocab_size: int
    data_dir: (
        Path | None
    )  # the prepared folder (None: synthetic); tokenizer: load_tokenizer_for_data(data_dir)
    loss_mask: bool = False  # data.loss_mask resolved: targets at unlearned tokens are -100 (see WindowDataset)


def build_datasets(
    data_cfg,
    block_size: int,
    seed: int,
    model_vocab_size: int | None = None,
    with_val: bool = True,
    progress: bool = True,
) -> DataSources:
    """Train/val datasets for a DataConfig: synthetic ids, ``data_cfg.path``, a mixture of prepared folders
    (``data_cfg.mixture``: see :mod:`tokenmill.data.mixture`; ``data_dir`` is its first folder, all share
    one tokenizer), or the embedded corpus (prepared and cached on first use). Raises DataError for bad
    data (checked per data_cfg.validate). ``with_val=False`` skips the val split (no evaluation), so a
    short val file is no error."""
    if getattr(data_cfg, "mixture", None):
        train, val, vocab, first = open_mixture(data_cfg, block_size, seed, model_vocab_size, with_val,
                                                lambda v: id_dtype(v, data_cfg.narrow_ids), progress)
        use_loss_mask(data_cfg.loss_mask, [s.token_file for s in train.sources], "data.mixture")
        return DataSources(train, val, vocab, first)
    if data_cfg.source == "synthetic":
        use_loss_mask(data_cfg.loss_mask, [], "data.source = 'synthetic'")
        if model_vocab_size is None:
            raise ValueError("synthetic data needs model_vocab_size (model.vocab_size)")
        ids = id_dtype(model_vocab_size, data_cfg.narrow_ids)
        train = SyntheticDataset(model_vocab_size, block_size, seed, data_cfg.cpu_work_ms, ids)
        val = SyntheticDataset(model_vocab_size, block_size, seed + 1_000_003, ids=ids) if with_val else None
        return DataSources(train, val, model_vocab_size, None)
    if data_cfg.path is None:
        from .corpus import ensure_embedded_corpus

        folder = ensure_embedded_corpus(data_cfg, progress=progress)
    else:
        folder = Path(data_cfg.path)
    tf = open_token_data(folder, "train", model_vocab_size, data_cfg.validate)
    ids = id_dtype(tf.vocab_size, data_cfg.narrow_ids)  # the data's ids are < its own vocabulary
    masked = use_loss_mask(data_cfg.loss_mask, [tf], None)
    train = windows(tf, data_cfg, block_size, data_cfg.sampling, seed, data_cfg.cpu_work_ms, ids, masked)
    val = None
    if with_val:
        vf = open_token_data(folder, "val", model_vocab_size, data_cfg.validate)
        val = windows(vf, data_cfg, block_size, "sequential", seed, 0.0, ids, masked)
    return DataSources(train, val, tf.vocab_size, folder, masked)


def windows(tf, data_cfg, block_size: int, sampling: str, seed: int, cpu_work_ms: float, ids: torch.dtype,
            masked: bool) -> Dataset:
    """The windows of one split: a chat folder learned through its loss mask by ``data.chat_packing``
    (:class:`ChatWindows`: each window starts at a conversation), anything else at any offset
    (:class:`WindowDataset`)."""
    if masked:
        return ChatWindows(tf, block_size, data_cfg.chat_packing, sampling, seed, cpu_work_ms, ids)
    return WindowDataset(tf, block_size, sampling, seed, cpu_work_ms, ids)


def use_loss_mask(setting: bool | None, files: list, unsupported: str | None) -> bool:
    """``data.loss_mask`` resolved for the token files the run reads: None (auto) -> whether they carry a loss
    mask (``prepare --format chat``); True -> required. ``unsupported`` names a data source that cannot apply a
    mask yet (a mixture, synthetic tokens): a mask there is refused rather than silently learning every token."""
    has = [f for f in files if f.mask_shards is not None]
    if setting is False:
        return False
    if unsupported is not None and (setting or has):
        what = f"'{has[0].path}' holds chat data with a loss mask" if has else "data.loss_mask is true"
        raise DataError(f"{what}, but {unsupported} cannot apply a loss mask yet. Fix: --data.loss_mask false (learn "
                        "every token)" + (", or train on one chat folder with --data.path." if has else "."))
    if setting and len(has) < len(files):
        missing = next(f for f in files if f.mask_shards is None)
        raise DataError(f"data.loss_mask is true, but '{missing.path}' has no loss mask (it was not prepared with "
                        "--format chat). Fix: prepare it with `tokenmill prepare FILES --out DIR --format chat "
                        "--tokenizer-from HF_MODEL_FOLDER`, or leave data.loss_mask unset (auto) or false.")
    return bool(has)
