"""Text generation from a trained model or a run directory's latest checkpoint."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenmill import checkpoint
from tokenmill import config as C
from tokenmill.data import load_tokenizer_for_data
from tokenmill.errors import SampleError
from tokenmill.model import GPT


def sample_texts(
    model: GPT,
    data_dir: str | Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float | None = None,
    num_samples: int = 1,
    use_cache: bool = True,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (each with the prompt), decoded with the tokenizer of
    ``data_dir``. Sampling as :meth:`~tokenmill.model.GPT.generate`: ``temperature`` 0 is greedy,
    ``top_k``/``top_p`` None (or ``top_p`` 1) filter nothing; ``seed`` makes the draws reproducible (a
    generator of its own: the global RNG is untouched). An empty prompt starts from the end-of-text id."""
    tok = load_tokenizer_for_data(Path(data_dir))
    ids = tok.encode(prompt) or ([tok.eot_id] if tok.eot_id is not None else [0])
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=idx.device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         num_samples=num_samples, use_cache=use_cache, generator=gen)
    return [tok.decode(row.tolist()) for row in out]


def stream_tokens(model: GPT, ids: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int | None = None,
                  top_p: float | None = None, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> Iterator[int]:
    """The ids :meth:`~tokenmill.model.GPT.generate` appends to the one prompt ``ids`` (with its KV cache), yielded
    one at a time as each is drawn, for a caller that shows them as they come and stops early (at an end-of-turn
    id, on a signal: just stop iterating). The same forward, cache and draws as ``generate``, so the same ids for
    the same ``generator``; it ends when the sequence fills ``block_size`` (no sliding window: a chat stops there)."""
    from tokenmill.model.gpt import KVCache
    from tokenmill.model.sampling import sample_next_token

    bs = model.cfg.block_size
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    if not 1 <= idx.size(1) <= bs:
        raise SampleError(f"the prompt has {idx.size(1)} tokens; it must have 1 to {bs} (the model's block_size).")
    was_training = model.training
    model.eval()
    try:
        cache = KVCache(len(model.blocks), bs)
        for _ in range(min(max_new_tokens, bs - idx.size(1) + 1)):
            with torch.inference_mode():
                logits = model._last_logits(idx[:, cache.pos:], cache)  # generate's cached step
                nxt = sample_next_token(logits, temperature, top_k, top_p, generator)
                full = idx.size(1) == bs
                idx = idx if full else torch.cat((idx, nxt), dim=1)
            yield int(nxt)
            if full:
                return
    finally:
        model.train(was_training)


def sample_text(model: GPT, data_dir: str | Path, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                top_k: int | None = 200, device: torch.device | str = "cpu", seed: int = 0) -> str:
    """One continuation of ``prompt`` (see :func:`sample_texts`)."""
    return sample_texts(model, data_dir, prompt, max_new_tokens, temperature, top_k, device=device, seed=seed)[0]


def load_run(run_dir: str | Path, device: str = "cpu", checkpoint_path: str | Path | None = None
             ) -> tuple[GPT, C.Config, Path]:
    """The model of a run directory's newest good checkpoint (or ``checkpoint_path``), with the run's
    config and the folder its tokenizer loads from (the run's own copy when it has one)."""
    from tokenmill.checkpoint import tokenizer_dir

    if checkpoint_path is None:
        check_has_checkpoint(Path(run_dir))
    model, cfg, _ = checkpoint.load_model(run_dir, checkpoint_path)
    if cfg.data.source == "synthetic":
        raise SampleError(f"{run_dir} was trained on synthetic tokens: there is no tokenizer to sample text with.")
    return model.to(device), cfg, tokenizer_dir(Path(run_dir), cfg)


def check_has_checkpoint(run_dir: Path) -> None:
    """Say what is true when ``run_dir`` has no checkpoint to sample from: the folder does not exist (with the
    closest existing name), or its only checkpoints produced a non-finite loss and were set aside."""
    from tokenmill.train.resume import set_aside_checkpoints

    if not run_dir.is_dir():
        names = [p.name for p in run_dir.parent.iterdir() if p.is_dir()] if run_dir.parent.is_dir() else []
        close = difflib.get_close_matches(run_dir.name, names, n=1, cutoff=0.6)
        hint = f" Did you mean {run_dir.parent / close[0]}?" if close else ""
        raise SampleError(f"there is no run directory {run_dir}.{hint} Check --run-dir.")
    if checkpoint.list_checkpoints(run_dir) or not (aside := set_aside_checkpoints(run_dir)):
        return
    what = "its only checkpoint ({}) holds weights that" if len(aside) == 1 else "its checkpoints ({}) hold weights that"
    raise SampleError(
        f"{run_dir} has no good checkpoint: {what.format(', '.join(map(str, aside)))} produced a non-finite loss "
        f"and {'was' if len(aside) == 1 else 'were'} set aside, so there are no finite weights to sample from. Train again "
        f"after changing a setting, e.g. a lower learning rate: tokenmill train --resume --run-dir {run_dir} "
        "--optim.lr LR (it starts from step 0).")
