"""Who am I: rank and world size, resolved when iteration starts, not at construction.

Users often build the dataset before ``init_process_group``; so the order is: explicit
arguments, then torch.distributed when initialized, then torchrun's RANK/WORLD_SIZE, then
SLURM's SLURM_PROCID/SLURM_NTASKS, then a single process.
"""
from __future__ import annotations

import os


def resolve_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size) by the rule above; ValueError if they are inconsistent."""
    return resolve(rank, world_size)[0]


def is_definitive(rank: int | None = None, world_size: int | None = None) -> bool:
    """False when nothing says who we are yet (a later init_process_group still may)."""
    return resolve(rank, world_size)[1]


def resolve(rank: int | None, world_size: int | None) -> tuple[tuple[int, int], bool]:
    """((rank, world_size), definitive): the answer, and whether anything actually said so."""
    definitive = True
    if rank is None or world_size is None:
        found = _from_distributed() or _from_env("RANK", "WORLD_SIZE") or _from_env("SLURM_PROCID", "SLURM_NTASKS")
        if found is None:
            found, definitive = (0, 1), False
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    return (rank, world_size), definitive


def _from_distributed() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _from_env(rank_var: str, size_var: str) -> tuple[int, int] | None:
    if rank_var in os.environ and size_var in os.environ:
        try:
            return int(os.environ[rank_var]), int(os.environ[size_var])
        except ValueError as e:
            raise ValueError(f"{rank_var}={os.environ[rank_var]!r} / {size_var}={os.environ[size_var]!r} are not integers") from e
    return None
