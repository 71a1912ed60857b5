"""A block's matrices, described once from the model config: each weight matrix of one block with its role, its
module path inside the block and its shape, as ``model/layers.py`` (``Block``) and ``model/moe.py`` (``MoE``)
build them.

Read by the size check (``config/size.py``: the parameter count), FP8 (``model/fp8.py``: which linears it
converts), the estimator and the doctor (through ``model/fp8.py``'s shapes: the FP8 speed-up each predicts).
Norms are not matrices: ``config/size.py`` counts them. A fused matrix names the row counts of its parts
(``split``: the q, k and v rows of 'qkv'; an expert's gate and up rows of 'experts_gate_up'), the matrices Muon
orthogonalises apart (``optim/muon.py``; read by the doctor's Newton-Schulz count).

Roles: 'qkv' (the fused [q; k; v] matrix) or 'q', 'k', 'v'; 'o' (attention output); 'gate', 'up', 'down' (the
dense MLP: gate only in a SwiGLU MLP); in a sparse layer 'router', 'experts_gate_up' and 'experts_down' (every
routed expert's weights stacked: (experts, out, in)), 'shared_gate', 'shared_up', 'shared_down' (the shared
experts, one SwiGLU) and 'shared_router' (the shared experts' gate, model.moe_shared_gate).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.model import ModelConfig

__all__ = ["Matrix", "block_matrices", "model_matrices"]


@dataclass(frozen=True)
class Matrix:
    """One weight matrix: ``shape`` is (out, in) as ``nn.Linear.weight`` holds it, or (experts, out, in) for
    the stacked routed experts; ``bias``: the linear has a bias of ``out`` values; ``split``: the row counts of
    the parts a fused matrix holds, in order (empty: one matrix)."""

    role: str
    path: str  # the parameter's module inside the block, e.g. 'attn.c_attn'
    shape: tuple[int, ...]
    bias: bool = False
    split: tuple[int, ...] = ()

    @property
    def linear(self) -> bool:
        """An ``nn.Linear`` (not the stacked experts)."""
        return len(self.shape) == 2

    @property
    def params(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n + (self.shape[-2] if self.bias else 0)


def _attention(m: ModelConfig) -> list[Matrix]:
    C, q, kv, b = m.n_embd, m.n_head * m.head_width, m.kv_heads * m.head_width, m.qkv_bias
    if m.fused_qkv:
        qkv = [Matrix("qkv", "attn.c_attn", (q + 2 * kv, C), b, (q, kv, kv))]
    else:
        qkv = [Matrix("q", "attn.q_proj", (q, C), b), Matrix("k", "attn.k_proj", (kv, C), b),
               Matrix("v", "attn.v_proj", (kv, C), b)]
    return qkv + [Matrix("o", "attn.c_proj", (C, q), m.bias)]


def _swiglu(prefix: str, role: str, C: int, width: int, bias: bool) -> list[Matrix]:
    return [Matrix(f"{role}gate", f"{prefix}.c_gate", (width, C), bias), Matrix(f"{role}up", f"{prefix}.c_fc", (width, C), bias),
            Matrix(f"{role}down", f"{prefix}.c_proj", (C, width), bias)]


def _dense_mlp(m: ModelConfig) -> list[Matrix]:
    C, inner = m.n_embd, m.mlp_width
    if m.mlp == "swiglu":
        return _swiglu("mlp", "", C, inner, m.bias)
    return [Matrix("up", "mlp.c_fc", (inner, C), m.bias), Matrix("down", "mlp.c_proj", (C, inner), m.bias)]


def _sparse_mlp(m: ModelConfig) -> list[Matrix]:
    C, E, Ie, S = m.n_embd, m.moe_experts, m.expert_width, m.shared_width
    out = [Matrix("router", "mlp.router", (E, C)),
           Matrix("experts_gate_up", "mlp.experts.gate_up", (E, 2 * Ie, C), split=(Ie, Ie)),
           Matrix("experts_down", "mlp.experts.down", (E, C, Ie))]
    if S:
        out += _swiglu("mlp.shared", "shared_", C, S, False)
        if m.moe_shared_gate:
            out.append(Matrix("shared_router", "mlp.shared_gate", (1, C)))
    return out


def block_matrices(m: ModelConfig, sparse: bool = False) -> list[Matrix]:
    """The matrices of one block: attention, then the dense MLP, or with ``sparse`` the mixture of experts of a
    sparse layer (``m.sparse_layers()``)."""
    return _attention(m) + (_sparse_mlp(m) if sparse else _dense_mlp(m))


def model_matrices(m: ModelConfig) -> list[list[Matrix]]:
    """Every block's matrices, block by block."""
    sparse = set(m.sparse_layers())
    dense, moe = block_matrices(m), (block_matrices(m, sparse=True) if sparse else [])
    return [moe if i in sparse else dense for i in range(m.n_layer)]
