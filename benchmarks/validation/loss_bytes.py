"""Measure the bytes a language-model loss holds per logit at its peak: Hugging Face transformers 4.38's
``LlamaForCausalLM`` loss path against tokenmill's own head and loss, on the CPU.

Why: a source that trained with Hugging Face's loss holds more memory around the loss than tokenmill does for the
same model, and ``published.toml`` states such differences as ``other_mib`` (never fitted). Which tensors are alive
at once is decided by autograd (what each op saves, what the caller keeps), not by the device, so it is counted
here on the CPU: every tensor an op creates is counted from its creation until its storage is freed, and the
peak of that sum over forward and backward is divided by the number of logits.

Hugging Face 4.38 (``src/transformers/models/llama/modeling_llama.py``, ``LlamaForCausalLM.forward``, as read at
v4.38.0): ``logits = self.lm_head(hidden_states)``; ``logits = logits.float()``; ``shift_logits =
logits[..., :-1, :].contiguous()``; ``CrossEntropyLoss()(shift_logits.view(-1, V), shift_labels.view(-1))``; the
output (``CausalLMOutputWithPast``) keeps ``logits`` while the caller runs ``output.loss.backward()``.
tokenmill: ``GPT.head_loss`` with the trainer's call (``model(x, y)[1]``: the logits dropped before backward).

    python benchmarks/validation/loss_bytes.py
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

B, T, C, V = 2, 256, 64, 4000


class LiveBytes(TorchDispatchMode):
    """The peak, over the ops run under it, of the bytes of the storages those ops created and still alive."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.alive: set[int] = set()

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self.alive:
            return
        self.alive.add(key)
        self.now += n
        self.peak = max(self.peak, self.now)

        def freed(key: int = key, n: int = n) -> None:
            self.now -= n
            self.alive.discard(key)

        weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def hf_438(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's loss path; returns what the output object holds (its locals are gone at backward)."""
    logits = hidden @ head.t()
    logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    loss = F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))
    return loss, logits  # CausalLMOutputWithPast(loss=loss, logits=logits), held by the caller


def tokenmill(hidden: torch.Tensor, model, labels: torch.Tensor) -> tuple[torch.Tensor]:
    return (model.head_loss(hidden, labels)[1],)  # the trainer's model(x, y)[1]: the logits dropped


def measure() -> dict[str, float]:
    from tokenmill import config as cfgs
    from tokenmill.model.build import build_gpt

    over = {"model.n_layer": 1, "model.n_embd": C, "model.n_head": 2, "model.block_size": T,
            "model.tie_embeddings": False}
    cfg = cfgs.resolve("gpt2-124m", overrides=over, overrides_from_string=False).model
    model = build_gpt(cfg, V, "cpu", torch.bfloat16)
    model.requires_grad_(False)
    torch.manual_seed(0)
    labels = torch.randint(V, (B, T))
    per_logit = {}
    for name, run, head in (("hf-4.38", hf_438, model.lm_head.weight), ("tokenmill", tokenmill, model)):
        hidden = torch.randn(B, T, C, dtype=torch.bfloat16, requires_grad=True)
        counter = LiveBytes()
        with counter:
            output = run(hidden, head, labels)
            output[0].backward()
            del output
        per_logit[name] = counter.peak / (B * T * V)
    return per_logit


if __name__ == "__main__":
    for name, b in measure().items():
        print(f"{name:10s} {b:5.2f} bytes a logit at the loss's peak")
