"""Scale-out: process group and mesh (``world``), DDP/FSDP2 (``data_parallel``), ZeRO-1 (``zero``) and
checkpoints for every layout (``checkpointing``). See docs/parallel.md."""

from tokenmill.parallel.data_parallel import apply_data_parallel, apply_ddp, apply_fsdp, grad_sync, unwrap
from tokenmill.parallel.world import ParallelError, World, init_world, is_elastic_restart, shutdown

__all__ = [
    "ParallelError", "World", "apply_data_parallel", "apply_ddp", "apply_fsdp", "grad_sync", "init_world",
    "is_elastic_restart", "shutdown", "unwrap",
]
