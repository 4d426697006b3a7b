"""One process of a two-process run on one machine: multi-host as JAX runs it (one controller per host),
started twice by ``tests/mesh_checks.py`` with 4 CPU devices each.

    python tests/multihost_worker.py CONFIG.json OUT

The coordinator, the process count and this process's id come from the environment
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), as on a GPU cluster; CPU devices
talk through gloo (``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``). Steps, after
``specjax.distributed.initialize()`` joined the processes:

1. Greedy ``generate`` with a draft model (``mesh_checks.Models``) on a ``data=2,model=4`` mesh over the 8
   devices of both processes: the rows split between the processes, the weights within each.
2. Two training steps of the recipe in CONFIG.json on that mesh, checkpointed by both processes together
   (each writes its own shards), then the run resumed on ``data=8``.

Prints one JSON line: the generated tokens, the resumed step, whether the restored state equals the saved
one, and the mesh it was restored onto.
"""

from __future__ import annotations

import json
import pathlib
import sys


def main(config_path: str, out: str) -> int:
  from specjax import distributed

  distributed.initialize()

  import jax
  import numpy as np

  from mesh_checks import Models
  from specjax import sharding
  from specjax.train import config as config_lib
  from specjax.train import trainer

  assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
  tokens = Models(kinds=("draft",)).run("draft", sharding.make_mesh("data=2,model=4")).tokens

  recipe = config_lib.from_dict(json.loads(pathlib.Path(config_path).read_text()))
  run = trainer.start(recipe, out, mesh=sharding.make_mesh("data=2,model=4"))
  trainer.fit(run, stop_at=2, export=False)
  saved = distributed.host_copy((run.params, run.opt_state))
  moved = trainer.start(recipe, out, resume=True, mesh=sharding.make_mesh("data=8"))
  restored = distributed.host_copy((moved.params, moved.opt_state))
  same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)))
  print(json.dumps({"process": jax.process_index(), "tokens": tokens.tolist(), "step": moved.step,
                    "same_state": same, "mesh": dict(moved.params["embed"].sharding.mesh.shape)}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
