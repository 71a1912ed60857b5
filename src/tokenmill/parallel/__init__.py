"""Scale-out: process group and mesh (``world``), DDP/FSDP2 (``data_parallel``), tensor parallel
(``tensor_parallel``) and pipeline parallel (``pipeline``). See docs/parallel.md."""

from tokenmill.parallel.data_parallel import apply_data_parallel, apply_ddp, apply_fsdp, grad_sync, unwrap
from tokenmill.parallel.world import World, init_world, is_elastic_restart, shutdown

__all__ = [
    "World", "apply_data_parallel", "apply_ddp", "apply_fsdp", "grad_sync", "init_world",
    "is_elastic_restart", "shutdown", "unwrap",
]
