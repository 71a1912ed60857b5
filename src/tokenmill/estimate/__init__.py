"""Predict GPU memory and speed of a training config without a GPU (``tokenmill estimate``).

- :func:`estimate`: per-rank peak allocated / reserved memory with its breakdown, and a step time.
- :func:`memory_advice`: one sentence for out-of-memory messages and the doctor.
- :data:`GPUS` / :func:`gpu_spec`: the GPU table (peaks shared with ``tokenmill.model.flops``).

How: the model's own code is traced on the ``meta`` device (``trace``), strung into training steps
(``timeline``), replayed through a model of the CUDA caching allocator (``allocator``), and timed with
a roofline (``roofline``). docs/estimate.md describes the model and its measured error.
"""

from tokenmill.estimate.advice import memory_advice
from tokenmill.estimate.core import Estimate, estimate, resolve_layout, vocab_size_of
from tokenmill.estimate.gpus import GPUS, gpu_spec

__all__ = ["GPUS", "Estimate", "estimate", "gpu_spec", "memory_advice", "resolve_layout", "vocab_size_of"]
