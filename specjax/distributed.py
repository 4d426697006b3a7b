"""Multi-host runs: one process per host, every process running the same program (JAX's multi-controller
model), the mesh spanning every process's devices.

- :func:`initialize` joins the processes (``jax.distributed.initialize``) before anything touches a device;
  on a Cloud TPU slice it needs no arguments, on GPU hosts the coordinator's address, the process count and
  this process's id (or the cluster environment JAX detects: SLURM, Open MPI, Kubernetes).
- :func:`is_primary`: only process 0 writes logs, recipes, tokenizers and exports; orbax's
  ``CheckpointManager`` needs *every* process to call ``save`` (each writes its own shards; orbax's primary
  process writes the metadata and finalises the step).
- :func:`host_copy`: arrays as host NumPy arrays on every process, gathering shards other processes hold.

``tests/mesh_checks.py`` runs it with two processes of CPU devices on one machine (gloo collectives);
``docs/sharding.md`` gives the commands for a TPU slice and a multi-GPU host.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Joins this process to the others (``jax.distributed.initialize``); a no-op when already joined.

  Call it first, before any JAX computation (the CLI does with ``--distributed``).

  Args:
    coordinator_address: ``host:port`` of process 0; None: ``$JAX_COORDINATOR_ADDRESS``, else detected
      (Cloud TPU, SLURM, Open MPI, Kubernetes).
    num_processes, process_id: this run's process count and this process's id; None:
      ``$JAX_NUM_PROCESSES`` / ``$JAX_PROCESS_ID`` where set, else detected.
  """
  if jax.distributed.is_initialized():
    return
  env = lambda name: int(os.environ[name]) if os.environ.get(name) else None
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=env("JAX_NUM_PROCESSES") if num_processes is None else num_processes,
                             process_id=env("JAX_PROCESS_ID") if process_id is None else process_id)


def is_primary() -> bool:
  """Whether this is process 0, the one that writes logs and files (True on one host)."""
  return jax.process_index() == 0


def host_copy(tree: Any) -> Any:
  """Every array of ``tree`` as a NumPy array holding its whole value, on every process (on one host:
  ``np.asarray``; on many: ``process_allgather`` of the shards other processes hold)."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=True)
