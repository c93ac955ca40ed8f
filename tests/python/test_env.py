"""Rank and size from the launchers pskv-mnist understands, plus torchrun and PSKV_*."""

import pytest

from pskv import _env


@pytest.mark.parametrize("environ, launcher, rank, size", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, "torchrun", 3, 4),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "6"}, "openmpi", 2, 6),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "pmi", 0, 2),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}, "slurm", 5, 8),
    ({"PSKV_RANK": "1", "PSKV_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "9"}, "pskv", 1, 2),
])
def test_detect_cluster(environ, launcher, rank, size):
    c = _env.detect_cluster(environ)
    assert (c.launcher, c.rank, c.size) == (launcher, rank, size)
    assert c.workers_only == (launcher in ("pskv", "torchrun"))


def test_alone_and_inconsistent():
    assert _env.detect_cluster({}) is None
    # An sbatch script (no srun step) is not rank 0 of its job.
    assert _env.detect_cluster({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}) is None
    with pytest.raises(ValueError):
        _env.detect_cluster({"RANK": "4", "WORLD_SIZE": "4"})


def test_servers_from_env():
    assert _env.servers_from_env({"PSKV_SERVERS": "shm://a-0, tcp://h:1"}) == ["shm://a-0", "tcp://h:1"]
    assert _env.servers_from_env({}) is None
