"""A tokenmill GPT as a model of EleutherAI's lm-evaluation-harness (``lm_eval.api.model.TemplateLM``).

Imported only when lm-eval is installed (:mod:`tokenmill.train.tasks` checks that first). The text is turned
into ids by a transformers tokenizer: a Hugging Face folder's own, or for a run the very files ``tokenmill
export`` writes for it (``write_hf_tokenizer_for_data``), so a run and its export see the same ids. What lm-eval
asks of a model:

- ``loglikelihood``: each (context, continuation) pair as lm-eval's ``TemplateLM`` encodes it; requests sorted
  longest first and run ``batch_size`` at a time, right-padded (causal: padding after a row changes nothing
  before it); a pair longer than ``model.block_size`` + 1 loses its oldest context tokens; the log-softmax is
  taken in fp32; requests that share a context and differ only in a one-token continuation share one forward
  (lm-eval's ``Collator``). Returns (sum of the continuation's log-probabilities, whether greedy decoding
  gives the continuation).
- ``loglikelihood_rolling``: a whole text in disjoint windows of at most ``block_size`` predicted tokens, the
  first conditioned on the prefix token (BOS, else EOS), each later one with the most context that fits.
- ``generate_until``: greedy (or, with ``do_sample``, sampled with ``temperature``/``top_k``/``top_p``) with the
  KV cache, prompts of the same length batched together, each row ending at the end-of-text id, at one of the
  ``until`` strings (cut there) or after ``max_gen_toks`` tokens; prompts lose their oldest tokens to leave
  room for ``max_gen_toks``.
- ``apply_chat_template``: transformers' ``apply_chat_template`` with the tokenizer's template.

On CUDA with bf16 the forwards run under bf16 autocast (``precision`` 'auto'); elsewhere in fp32. Under
torchrun with a replicated model (one process or DDP) every rank takes its share of the documents (lm-eval's
``rank``/``world_size``) and the results are gathered on rank 0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tokenmill.errors import ConfigError
from tokenmill.model import GPT
from tokenmill.model.layers import KVCache
from tokenmill.model.sampling import sample_next_token

__all__ = ["TokenmillLM"]


class TokenmillLM(TemplateLM):
    """``model`` (a plain GPT) with ``tokenizer`` (transformers) for lm-eval; see the module doc.
    ``stop_ids``: the ids that end a generation (default: the tokenizer's eos)."""

    def __init__(self, model: GPT, tokenizer: Any, device: torch.device | str = "cpu", batch_size: int = 8,
                 autocast_dtype: Optional[torch.dtype] = None, name: str = "tokenmill", rank: int = 0,
                 world_size: int = 1, stop_ids: Iterable[int] = (), max_gen_toks: int = 256, seed: int = 0):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        self._rank, self._world_size = rank, world_size
        self.batch_size = batch_size
        self.autocast_dtype = autocast_dtype
        self.name = name
        self._max_gen_toks = max_gen_toks
        eos = tokenizer.eos_token_id
        self.stop_ids = set(stop_ids) | ({eos} if eos is not None else set())
        self.generator = torch.Generator(device=self._device).manual_seed(seed)

    # --- what lm-eval reads
    @property
    def eot_token_id(self) -> Optional[int]:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else self.tokenizer.bos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What a text with no context is conditioned on: BOS, else EOS (a tokenizer with neither, e.g. bytes:
        one line, for the tasks that need it: empty contexts, rolling log-likelihoods)."""
        bos = self.tokenizer.bos_token_id
        if bos is None and self.eot_token_id is None:
            raise ConfigError(f"{self.name}: its tokenizer has no end-of-text or beginning-of-text token, which lm-eval "
                              "puts before a text with no context (rolling log-likelihood tasks, empty contexts).")
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.block_size

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", self.name) or self.name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, left_truncate_len: Optional[int] = None,
                   **kwargs) -> list[int]:
        """The tokenizer's ids of ``string`` (its special tokens as the tokenizer adds them by default, none when
        the text already starts with the prefix token's text); the last ``left_truncate_len`` when given."""
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prefix = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id
        if add_special_tokens is None and prefix is not None and string.startswith(self.tokenizer.decode([prefix])):
            kw = {"add_special_tokens": False}
        ids = list(self.tokenizer.encode(string, **kw))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # --- torchrun: a replicated model, the documents split by lm-eval
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size <= 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list]:
        if self.world_size <= 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # --- the forwards
    @torch.inference_mode()
    def _log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (B, T, vocab) in fp32 of the next token at every position of ``ids`` (B, T)."""
        with torch.autocast(self._device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            logits = self.model(ids)[0]
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ((context, continuation) or None, context ids, continuation ids); see the module doc."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])), group_by="contexts",
                         group_fn=lambda r: r[1] + r[2][:-1])
        L, out = self.max_length, []
        if any(len(r[2]) > L for r in requests):
            n = max(len(r[2]) for r in requests)
            raise ConfigError(f"a task asks for the likelihood of a continuation of {n} tokens, longer than the "
                              f"context of {self.name} ({L} tokens).")
        for chunk in order.get_batched(n=self.batch_size):
            rows = [(r[1] + r[2])[-(L + 1):][:-1] for r in chunk]
            width = max(len(x) for x in rows)
            ids = torch.tensor([x + [0] * (width - len(x)) for x in rows], dtype=torch.long, device=self._device)
            logp = self._log_probs(ids)
            for (req, ctx, cont), row, lp in zip(chunk, rows, logp):
                lp = lp[len(row) - len(cont): len(row)].unsqueeze(0)  # the continuation's positions, (1, n, V)
                greedy = lp.argmax(dim=-1)
                for key, cont_ids, lp_ in order.get_cache(req_str=req, cxt_toks=ctx, cont_toks=cont, logits=lp):
                    want = torch.tensor(cont_ids, dtype=torch.long, device=self._device).unsqueeze(0)
                    is_greedy = bool((greedy[:, -want.size(1):] == want).all())
                    score = float(torch.gather(lp_, 2, want.unsqueeze(-1)).sum())
                    out.append((score, is_greedy))
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, (score, is_greedy))
        return order.get_original(out)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (score, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += score
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        order = Collator([r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                         group_by="gen_kwargs", group_fn=lambda a: a[1])
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, kwargs = [c for c, _ in chunk], normalize_gen_kwargs(dict(chunk[0][1]), self.max_gen_toks)
            eos = self.tok_decode([self.eot_token_id], False) if self.eot_token_id is not None else None
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            n = kwargs.pop("max_gen_toks")
            room = self.max_length - n
            if room <= 0:
                raise ConfigError(f"a task asks for {n} generated tokens (max_gen_toks), but {self.name} has a context "
                                  f"of {self.max_length} tokens: nothing is left for the prompt.")
            prompts = [self.tok_encode(c, left_truncate_len=room) for c in contexts]
            texts = self._generate(prompts, n, [s for s in until if s], kwargs)
            for context, kw, text in zip(contexts, [a[1] for a in chunk], texts):
                text = postprocess_generated_text(text, until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, kw), text)
        return order.get_original(out)

    def _generate(self, prompts: list[list[int]], n: int, stops: list[str], kwargs: dict) -> list[str]:
        """The decoded continuations of ``prompts``, those of the same length run as one batch."""
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(prompts):
            by_len[len(p)].append(i)
        texts = [""] * len(prompts)
        for rows in by_len.values():
            ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=self._device)
            for i, new in zip(rows, self._continue(ids, n, stops, kwargs)):
                texts[i] = self.tok_decode(new)
        return texts

    @torch.inference_mode()
    def _continue(self, ids: torch.Tensor, n: int, stops: list[str], kwargs: dict) -> list[list[int]]:
        """Up to ``n`` new ids for each row of ``ids`` (B, T), with the KV cache; a row ends at a stop id or once
        its decoded text holds a stop string."""
        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        cache = KVCache(len(self.model.blocks), ids.size(1) + n)
        new: list[list[int]] = [[] for _ in range(ids.size(0))]
        done = [False] * ids.size(0)
        x = ids
        for _ in range(n):
            with torch.autocast(self._device.type, dtype=self.autocast_dtype or torch.bfloat16,
                                enabled=self.autocast_dtype is not None):
                logits = self.model.head_loss(self.model.trunk(x, cache)[:, -1:], None)[0][:, -1].float()
            if sample:
                nxt = sample_next_token(logits, float(kwargs["temperature"]), kwargs.get("top_k"), kwargs.get("top_p"),
                                        self.generator)
            else:
                nxt = logits.argmax(dim=-1, keepdim=True)
            for b, t in enumerate(nxt[:, 0].tolist()):
                if done[b]:
                    continue
                if t in self.stop_ids:
                    done[b] = True
                    continue
                new[b].append(t)
                if stops and any(s in self.tok_decode(new[b]) for s in stops):
                    done[b] = True
            if all(done):
                break
            x = nxt
        return new
