"""Hand-written GPU kernels (Triton), each behind a model switch; the PyTorch forms stay the reference.

``model.norm = "triton"``: :class:`~tokenmill.model.kernels.layernorm.TritonLayerNorm`, LayerNorm
forward and backward as two fused Triton kernels (the book's custom-kernel chapter). Triton is an
optional dependency (``pip install triton``; it ships with the CUDA builds of PyTorch). The kernels run
on CUDA GPUs; on a CPU only under ``TRITON_INTERPRET=1`` (Triton's interpreter, for the tests).
"""

from tokenmill.model.kernels.layernorm import TritonLayerNorm, triton_available, triton_layer_norm

__all__ = ["TritonLayerNorm", "triton_available", "triton_layer_norm"]
