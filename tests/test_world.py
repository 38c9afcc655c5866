"""Rank and world size: explicit > torch.distributed > RANK/WORLD_SIZE > SLURM > single process."""
from __future__ import annotations

import pytest

from streamwin.world import is_definitive, resolve_world

VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture
def env(monkeypatch):
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_single_process_is_not_definitive(env):
    assert resolve_world() == (0, 1) and not is_definitive()


def test_torchrun_variables(env):
    env.setenv("RANK", "2"), env.setenv("WORLD_SIZE", "4")
    assert resolve_world() == (2, 4) and is_definitive()


def test_slurm_variables_and_precedence(env):
    env.setenv("SLURM_PROCID", "5"), env.setenv("SLURM_NTASKS", "8")
    assert resolve_world() == (5, 8)
    env.setenv("RANK", "1"), env.setenv("WORLD_SIZE", "2")
    assert resolve_world() == (1, 2)  # torchrun inside srun: torchrun's view wins


def test_explicit_arguments_win(env):
    env.setenv("RANK", "1"), env.setenv("WORLD_SIZE", "2")
    assert resolve_world(3, 7) == (3, 7)


@pytest.mark.parametrize("rank,world", [(2, 2), (-1, 2), (0, 0)])
def test_inconsistent_values_are_refused(env, rank, world):
    with pytest.raises(ValueError, match="rank"):
        resolve_world(rank, world)


def test_non_integer_env_is_refused(env):
    env.setenv("RANK", "x"), env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        resolve_world()
