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

torchtune's chunked loss (``CEWithChunkedOutputLoss`` with a frozen tied head, as its LoRA and QLoRA recipes run
it at 1814feb): the decoder computes the head's output for every chunk in the forward (``chunked_output``: bf16,
2 bytes a logit of the whole batch, kept by the loss), and ``training.compile_loss`` compiles only each chunk's
upcast + cross-entropy. What that compiled piece keeps for its backward is what Inductor's partitioner decides,
traced here with its decompositions and ``min_cut_rematerialization_partition`` (:func:`torchtune_saved`): the
chunk's bf16 logits (already alive) and two numbers a row, nothing of 4 bytes a logit; its backward writes one
chunk's bf16 gradient while the chunk's logits are still held. So at the loss it holds 2 bytes a logit of the
batch plus 2 of one chunk, against tokenmill's chunked loss measured here (:func:`chunked`: one chunk at a time).

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


def _frozen_model(**over):
    """A one-block bf16 model at this script's shapes, its weights frozen (the head too, as LoRA's)."""
    from tokenmill import config as cfgs
    from tokenmill.model.build import build_gpt

    over = {"model.n_layer": 1, "model.n_embd": C, "model.n_head": 2, "model.block_size": T, **over}
    model = build_gpt(cfgs.resolve("gpt2-124m", overrides=over, overrides_from_string=False).model, V, "cpu",
                      torch.bfloat16)
    return model.requires_grad_(False)


def _peak_per_logit(run, head, labels: torch.Tensor) -> float:
    """The peak live bytes of ``run``'s forward and backward on random hidden states, a logit of the batch."""
    hidden = torch.randn(B, T, C, dtype=torch.bfloat16, requires_grad=True)
    counter = LiveBytes()
    with counter:
        output = run(hidden, head, labels)
        output[0].backward()
        del output
    return counter.peak / (B * T * V)


def measure() -> dict[str, float]:
    model = _frozen_model(**{"model.tie_embeddings": False})
    torch.manual_seed(0)
    labels = torch.randint(V, (B, T))
    return {name: _peak_per_logit(run, head, labels)
            for name, run, head in (("hf-4.38", hf_438, model.lm_head.weight), ("tokenmill", tokenmill, model))}


CHUNKS = 8  # CEWithChunkedOutputLoss's num_output_chunks


def torchtune_saved(n: int = 256, v: int = V) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what the compiled upcast + cross-entropy of one (n, v) bf16 chunk keeps for its backward
    (torch.compile's Inductor decompositions and partitioner, traced without generating code)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def forward_graph(gm, _inputs):
        out = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        saved.extend((tuple(a.meta["val"].shape), a.meta["val"].dtype) for a in out[1:])
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_graph, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())

    def compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=-100)

    torch._dynamo.reset()
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(compute_cross_entropy, backend=backend)(logits, torch.randint(v, (n,))).backward()
    torch._dynamo.reset()
    return saved


def chunked() -> float:
    """tokenmill's chunked loss (``model.loss_impl='chunked'``, CHUNKS chunks, the head frozen as LoRA's): the peak
    bytes it holds, a logit of the whole batch."""
    model = _frozen_model(**{"model.loss_impl": "chunked", "model.loss_chunk_size": B * T // CHUNKS})
    torch.manual_seed(0)
    return _peak_per_logit(tokenmill, model, torch.randint(V, (B, T)))


if __name__ == "__main__":
    for name, b in measure().items():
        print(f"{name:10s} {b:5.2f} bytes a logit at the loss's peak")
    print(f"tokenmill's chunked loss ({CHUNKS} chunks, frozen head): {chunked():.2f} bytes a logit of the batch")
    print("torchtune's compiled chunk cross-entropy keeps:", torchtune_saved())
