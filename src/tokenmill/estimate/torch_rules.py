"""The PyTorch versions the estimator's imitated rules were read from, and what to re-read on another one.

The estimator does not run PyTorch's GPU code; it imitates a few of its rules, each read from PyTorch's source
(and checked against real runs) for the versions below:

- Inductor's fusion and padding rules (:mod:`.inductor`: which ops fuse into one kernel, ``pad_mm``'s padding
  of misaligned matrix products, which reductions keep their rows in registers and the online softmax;
  ``torch/_inductor/scheduler.py``, ``fx_passes/pad_mm.py``, ``choices.py``, ``fx_passes/post_grad.py``);
- AOTAutograd's partition of a compiled forward and backward (:mod:`.compiled`: the min-cut
  rematerialisation, the zero gradient of an unused output; ``torch/_functorch/partitioners.py``);
- the autocast op lists (:mod:`.device`: which ops run in the lower precision on CUDA;
  ``aten/src/ATen/autocast_mode.cpp``);
- the CUDA caching allocator (:mod:`.allocator`: pool sizes, rounding, splitting, expandable segments, one
  pool per stream; ``c10/cuda/CUDACachingAllocator.cpp``);
- FSDP2's buffers and the streams they come from (:mod:`.fsdp`: all-gather buffers on the copy-in stream,
  gradient shards on the reduce-scatter stream, dim-0 padding; ``torch/distributed/fsdp/_fully_shard/``).

The GPUs this project measures on run torch 2.11 and CI runs 2.13: the rules were checked on both.
``tests/test_torch_version_rules.py`` fails on a torch outside the range, naming :data:`REREAD`.
"""

from __future__ import annotations

__all__ = ["REREAD", "RULES_TORCH", "in_range", "major_minor"]

# (oldest, newest) torch major.minor whose rules the estimator imitates, both checked.
RULES_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 13))

# What to re-read on another torch (and update here, with the estimator, before widening RULES_TORCH).
REREAD = (
    "Inductor fusion and pad_mm padding (torch/_inductor/scheduler.py, torch/_inductor/fx_passes/pad_mm.py) "
    "-> estimate/inductor.py",
    "Inductor's persistent reductions and online softmax (torch/_inductor/choices.py "
    "should_use_persistent_reduction, torch/_inductor/fx_passes/post_grad.py prepare_softmax_online) "
    "-> estimate/inductor.py PERSISTENT_INNER, ONLINE_SOFTMAX",
    "Inductor's removal of kernel-local buffers (torch/_inductor/codegen/common.py remove_kernel_local_buffers) "
    "-> estimate/inductor.py _drop_local",
    "AOTAutograd's min-cut partition (torch/_functorch/partitioners.py) -> estimate/compiled.py",
    "how dynamo hands a selective checkpoint to AOTAutograd (torch/_higher_order_ops/wrap.py, "
    "torch/utils/checkpoint.py) -> estimate/compiled.py selective",
    "the CUDA autocast op lists (aten/src/ATen/autocast_mode.cpp) -> estimate/device.py",
    "the CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) -> estimate/allocator.py",
    "FSDP2's all-gather / reduce-scatter buffers and their streams (torch/distributed/fsdp/_fully_shard/"
    "_fsdp_collectives.py, _fsdp_param_group.py) -> estimate/fsdp.py",
)


def major_minor(version: str) -> tuple[int, int]:
    """``'2.13.0+cpu'`` -> ``(2, 13)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def in_range(version: str) -> bool:
    """Whether a torch ``version`` lies within :data:`RULES_TORCH` (major.minor, both ends included)."""
    lo, hi = RULES_TORCH
    return lo <= major_minor(version) <= hi
