"""Process group and device mesh: who am I, how many of us, and along which dimensions.

``tokenmill train`` started by ``torchrun`` finds ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its
environment and joins the process group (``nccl`` on CUDA, ``gloo`` on CPU). The degrees of the config
(``parallel.pp`` x ``parallel.dp_replicate`` x ``parallel.dp_shard`` x ``parallel.tp``) must multiply to
the world size; one of the two data-parallel degrees may be -1, "the rest". The device mesh has the
dimensions ``("pp", "dp_replicate", "dp_shard", "tp")`` in that order (torchtitan's): tensor-parallel
ranks are neighbours (on one node, where the links are fastest), pipeline stages are furthest apart.
A single process without torchrun is a world of one and never touches ``torch.distributed``. With
``parallel.ep`` > 1 a second mesh ``("dp_mod_ep", "ep")`` spans the data-parallel ranks for expert parallelism
(:mod:`tokenmill.parallel.expert_parallel`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from tokenmill.config import ParallelConfig
from tokenmill.errors import ParallelError


@dataclass
class World:
    """This process's place in the job."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    device: torch.device = torch.device("cpu")
    mesh: Optional[object] = None  # DeviceMesh ("pp", "dp_replicate", "dp_shard", "tp") when size > 1
    owns_group: bool = False  # this process created the process group (and destroys it at the end)
    tp: int = 1
    pp: int = 1
    fsdp: bool = False  # FSDP applies (dp_shard > 1, or dp_shard -1 resolved to 1 under a one-process torchrun)
    ep: int = 1  # expert-parallel degree (parallel.ep), carved from the data-parallel ranks
    ep_mesh: Optional[object] = None  # DeviceMesh ("dp_mod_ep", "ep") over the data-parallel ranks when ep > 1

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """Index of this rank's slice of the global batch (row-major over (dp_replicate, dp_shard))."""
        if self.mesh is None:
            return 0
        return self.mesh.get_local_rank("dp_replicate") * self.dp_shard + self.mesh.get_local_rank("dp_shard")

    def local_rank_in(self, dim: str) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.local_rank_in("pp")

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def sharded(self) -> bool:
        """Parameters are split over ranks (FSDP, TP or PP): checkpoints are DCP folders."""
        return self.fsdp or self.dp_shard > 1 or self.tp > 1 or self.pp > 1 or self.ep > 1

    def layout(self) -> str:
        """E.g. 'single', 'ddp', 'fsdp', 'hsdp', 'fsdp+tp', 'pp+tp'."""
        if not self.distributed:
            return "fsdp" if self.fsdp else "single"
        parts = ["pp"] if self.pp > 1 else []
        if self.dp_shard > 1:
            parts.append("hsdp" if self.dp_replicate > 1 else "fsdp")
        elif self.dp_replicate > 1:
            parts.append("ddp")
        if self.tp > 1:
            parts.append("tp")
        if self.ep > 1:
            parts.append("ep")
        return "+".join(parts)


def torchrun_env() -> Optional[tuple[int, int, int]]:
    """(rank, local_rank, world_size) when launched by torchrun (or any launcher setting them), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, int(os.environ.get("LOCAL_RANK", rank)), size


def is_elastic_restart() -> bool:
    """True in a worker that torchrun restarted after a failure (resume from the last checkpoint)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _torchrun_hint(world_size: int, nproc: int) -> str:
    """In a single process (no torchrun), how to start the ``nproc`` processes the degrees ask for."""
    if world_size != 1:
        return ""
    return f" This is one process; launch {nproc} with `torchrun --nproc-per-node {nproc} -m tokenmill train ...`."


def resolve_degrees(cfg: ParallelConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) with -1 replaced by the rest; pp x dp_replicate x dp_shard x tp must be
    the world size."""
    rep, shard = cfg.dp_replicate, cfg.dp_shard
    known = (rep if rep > 0 else 1) * (shard if shard > 0 else 1) * cfg.tp * cfg.pp
    if -1 in (rep, shard):
        if world_size % known:
            raise ParallelError(
                f"world size {world_size} is not divisible by the fixed parallel degrees (product {known}); "
                "change parallel.dp_replicate / dp_shard / tp / pp or --nproc-per-node."
                + _torchrun_hint(world_size, known)
            )
        rest = world_size // known
        rep, shard = (rest, shard) if rep == -1 else (rep, rest)
    total = cfg.pp * rep * shard * cfg.tp
    if total != world_size:
        raise ParallelError(
            f"parallel.pp ({cfg.pp}) x dp_replicate ({rep}) x dp_shard ({shard}) x tp ({cfg.tp}) = {total}, but "
            f"the world size is {world_size}: the degrees must multiply to the number of processes (use -1 for "
            "'the rest'; tp and pp need torchrun with that many processes)."
            + _torchrun_hint(world_size, total)
        )
    if (rep * shard) % cfg.ep:
        raise ParallelError(
            f"parallel.ep ({cfg.ep}) must divide the data-parallel world size (dp_replicate {rep} x dp_shard "
            f"{shard} = {rep * shard}): the experts are split over ep of the data-parallel ranks."
            + _torchrun_hint(world_size, cfg.ep)
        )
    return rep, shard


def _backend(cfg: ParallelConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(backend: str, device: torch.device, timeout: timedelta = timedelta(minutes=10)) -> None:
    """``init_process_group`` from the torchrun environment (``env://``).

    A worker that torchrun restarted after a failure may be handed the same key-value store as the
    failed attempt, still holding that attempt's connection addresses (gloo then tries to connect to
    dead peers). So under torchelastic the store is wrapped in a prefix unique to the attempt.
    """
    kw = {"device_id": device} if device.type == "cuda" else {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout, **kw)
        return
    store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"tokenmill/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kw)


def init_world(cfg: ParallelConfig, device: torch.device) -> World:
    """Join the process group (when launched by torchrun) and build the device mesh.

    ``device`` is the resolved device type; on CUDA each rank takes ``cuda:LOCAL_RANK``. A process group
    that the caller already initialised is used as it is (and left alive at the end).
    """
    env = torchrun_env()
    one_process_fsdp = env is not None and env[2] == 1 and cfg.dp_shard == -1  # FSDP over a 1-rank mesh
    if env is None or (env[2] == 1 and not one_process_fsdp):
        rep, shard = resolve_degrees(cfg, 1)
        return World(dp_replicate=rep, dp_shard=shard, device=device, tp=cfg.tp, pp=cfg.pp)
    rank, local_rank, size = env
    rep, shard = resolve_degrees(cfg, size)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ParallelError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible.")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ParallelError(f"multi-process training runs on CUDA or CPU, not {device.type}.")
    owns = not dist.is_initialized()
    if owns:
        init_process_group(_backend(cfg, device), device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (cfg.pp, rep, shard, cfg.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    ep_mesh = None
    if cfg.ep > 1:  # the data-parallel ranks in their flat order (tp and pp are 1): ep neighbours split the experts
        ep_mesh = init_device_mesh(device.type, (rep * shard // cfg.ep, cfg.ep), mesh_dim_names=("dp_mod_ep", "ep"))
    return World(rank, local_rank, size, rep, shard, device, mesh, owns, cfg.tp, cfg.pp,
                 fsdp=shard > 1 or one_process_fsdp, ep=cfg.ep, ep_mesh=ep_mesh)


def shutdown(world: World) -> None:
    if world.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


@contextlib.contextmanager
def rank0_first(world: World):
    """Rank 0 runs the body first (e.g. prepares and caches the corpus), then the others."""
    if not world.is_rank0:
        barrier(world)
    yield
    if world.is_rank0:
        barrier(world)


def global_mean(values: torch.Tensor, world: World) -> torch.Tensor:
    """Mean over data-parallel ranks (each rank's values are means over equal-sized slices, so this is
    the mean over the whole global batch). One collective for all the values.

    Under pipeline parallelism only the last stage has the losses (the others pass zeros and are not
    counted); tensor-parallel ranks hold equal copies, which the mean leaves unchanged."""
    if not world.distributed:
        return values
    out = values.detach().clone()
    if not world.is_last_stage:
        out.zero_()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return out / (world.size // world.pp)


# What a collective raises on the ranks left when another process of the job has died (gloo's TCP pairs,
# NCCL's aborted communicators, the store's connection), matched in the message where torch raises a
# plain RuntimeError.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport",
             "NCCL communicator was aborted", "NCCL error", "Socket Timeout", "failed to recv")


def peer_failure(e: BaseException) -> Optional[str]:
    """One line for the error a rank gets when another process of its job has ended (killed, crashed,
    out of memory), or None when ``e`` is something else. Not a bug of this rank: its cause is in the other
    rank's output, and torchrun reports which one."""
    env = torchrun_env()  # not the process group: the trainer has destroyed it on the way out
    if env is None or env[2] < 2 or not isinstance(e, RuntimeError):
        return None
    text = str(e)
    if not isinstance(e, dist.DistError) and not any(m in text for m in PEER_LOST):
        return None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return (f"rank {env[0]} of {env[2]}: another process of this job has ended, so this "
            f"one stops too ({first[:160]}). The cause is in that process's output (torchrun names its rank).")
