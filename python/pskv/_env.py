"""Where this process sits in a job: rank and size from the launcher, as pskv-mnist reads them."""

import os
from dataclasses import dataclass
from typing import List, Optional

# (launcher, rank variable, size variable), first match wins. PSKV_* is explicit and beats the rest;
# torchrun's RANK/WORLD_SIZE come before MPI's because torchrun may itself run inside an MPI job.
_LAUNCHERS = [
    ("pskv", "PSKV_RANK", "PSKV_WORLD_SIZE"),
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
]


@dataclass
class Cluster:
    """rank/size as the launcher numbered the processes. Under torchrun and PSKV_* every process
    trains (`workers_only`); under mpirun/srun the first --servers ranks serve, as in pskv-mnist."""

    launcher: str
    rank: int
    size: int
    local_rank: int

    @property
    def workers_only(self) -> bool:
        return self.launcher in ("pskv", "torchrun")


def detect_cluster(environ=None) -> Optional[Cluster]:
    """The job this process was started in, or None when run alone."""
    env = os.environ if environ is None else environ
    for launcher, rank_var, size_var in _LAUNCHERS:
        # sbatch sets SLURM_PROCID=0 and SLURM_NTASKS for the batch script itself: only a task
        # that srun started (SLURM_STEP_ID) is one of the job's ranks.
        if launcher == "slurm" and "SLURM_STEP_ID" not in env:
            continue
        if rank_var in env and size_var in env:
            rank, size = int(env[rank_var]), int(env[size_var])
            if not 0 <= rank < size:
                raise ValueError(f"{rank_var}={rank} is outside {size_var}={size}")
            local = env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("SLURM_LOCALID", "0")))
            return Cluster(launcher, rank, size, int(local))
    return None


def servers_from_env(environ=None) -> Optional[List[str]]:
    """PSKV_SERVERS: comma-separated server URIs, if given."""
    env = os.environ if environ is None else environ
    value = env.get("PSKV_SERVERS", "").strip()
    return [u.strip() for u in value.split(",") if u.strip()] or None
