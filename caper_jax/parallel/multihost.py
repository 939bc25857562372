"""Multi-process setup: distributed init from the environment, host-local → global batches, logging.

One code path for 1 process and N processes. Every process reads its own slice of the data (the
Grain pipeline shards by ``jax.process_index()``), and ``host_local_to_global`` stitches those
slices into one global ``jax.Array`` without any process ever holding the whole batch.

When ``initialize`` talks to a coordinator (checked in this order):
  * ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID`` set → explicit
    (local runs, tests with 2 CPU processes, any launcher that exports them);
  * ``CAPER_DISTRIBUTED=auto`` → ``jax.distributed.initialize()`` with JAX's own cluster detection
    (Cloud TPU VM pods, SLURM, Kubernetes);
  * otherwise single-process: nothing to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from caper_jax.parallel.rules import DEFAULT_RULES, LogicalRules, logical_to_spec

_log = logging.getLogger("caper_jax")


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Starts jax.distributed when the environment asks for it; returns True if it did (or had)."""
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        return True
    address = env.get("JAX_COORDINATOR_ADDRESS")
    if address and "JAX_NUM_PROCESSES" in env:
        try:
            num_processes = int(env["JAX_NUM_PROCESSES"])
            process_id = int(env["JAX_PROCESS_ID"])
        except (KeyError, ValueError) as err:
            raise ValueError(
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID must both be set to integers with JAX_COORDINATOR_ADDRESS"
            ) from err
        jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id)
        return True
    mode = env.get("CAPER_DISTRIBUTED", "").lower()
    if mode == "auto":
        jax.distributed.initialize()
        return True
    if mode not in ("", "0", "off", "none"):
        raise ValueError(f"CAPER_DISTRIBUTED={mode!r}: expected 'auto' or unset")
    return False


def is_main_process() -> bool:
    return jax.process_index() == 0


# Long enough for process 0 to annotate a full training split while the others wait.
MAIN_FIRST_TIMEOUT_S = 4 * 3600


def barrier(name: str, timeout_s: float) -> None:
    """Blocks until every process reaches ``barrier(name)``; no-op with one process.

    Uses the distributed runtime's coordination service, not a device collective: a collective
    barrier would open a gloo (CPU) or NCCL context whose set-up gives up after about 30 s, far
    less than process 0 may need here. Each name may be used once per run.
    """
    if jax.process_count() == 1:
        return
    # The runtime client: jax has no public barrier with a timeout.
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"caper_jax:{name}", int(timeout_s * 1000))


@contextlib.contextmanager
def main_process_first(name: str, timeout_s: float = MAIN_FIRST_TIMEOUT_S) -> Iterator[None]:
    """Runs the block on process 0 first, then on every other process.

    For work whose result lands on disk and is reused when present (the demo world, annotated
    tuples): process 0 builds it once; on a shared file system the others then find it, on
    host-local disks each host builds its own copy, and no two processes ever write the same
    file at the same time. Every process must enter; if process 0 fails inside the block, the
    others fail at the barrier's timeout (or when the launcher stops them).
    """
    if not is_main_process():
        barrier(f"main_first:{name}", timeout_s)
    yield
    if is_main_process():
        barrier(f"main_first:{name}", timeout_s)


def log_main(msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Logs on process 0 only (every process computes the same metrics; print them once)."""
    if is_main_process():
        _log.log(level, msg, *args)


def batch_sharding(
    mesh: Mesh, ndim: int, rules: LogicalRules = DEFAULT_RULES, batch_axis: str = "batch"
) -> NamedSharding:
    """Sharding of a [batch, ...] array: leading dim by the ``batch`` rule, the rest replicated."""
    spec = logical_to_spec((batch_axis,) + (None,) * (ndim - 1), rules, mesh=mesh)
    return NamedSharding(mesh, spec)


def batch_multiple(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> int:
    """Number of shards the batch axis is split into: a global batch's row count must divide by it."""
    spec = batch_sharding(mesh, 1, rules).spec[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def replicated_batch(batch: Mapping[str, Any], mesh: Mesh, rules: LogicalRules = DEFAULT_RULES,
                     multiple: int = 1) -> tuple[dict[str, jax.Array], int]:
    """The same full batch on every host -> global arrays split over the batch axis.

    Rows are padded with zeros (-1 in ``*_pos`` keys: no position) to a multiple of ``multiple``
    (``batch_multiple`` for a batch of any size); returns (arrays, real row count).
    """
    n = len(next(iter(batch.values())))
    padded = -(-n // multiple) * multiple
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if padded != n:
            pad = np.zeros((padded - n,) + value.shape[1:], value.dtype)
            if key.endswith("_pos"):
                pad -= 1
            value = np.concatenate([value, pad])
        sharding = batch_sharding(mesh, value.ndim, rules)
        out[key] = jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx])
    return out, n


def fetch(x: Any) -> np.ndarray:
    """A global array as numpy on every host (gathered across hosts when it is sharded over them)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils  # only multi-host runs need it

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_local_to_global(
    batch: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES, batch_axis: str = "batch"
) -> Any:
    """Turns each process's slice of a batch (pytree of numpy arrays) into global jax.Arrays.

    Process ``p`` passes rows ``[p * n_local, (p + 1) * n_local)`` of the global batch; the global
    leading dim is ``n_local * jax.process_count()``. The per-process row count must be divisible
    by the number of batch shards living on that process.
    """

    def to_global(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError("host_local_to_global needs arrays with a leading batch dimension")
        sharding = batch_sharding(mesh, x.ndim, rules, batch_axis)
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(to_global, batch)


def process_slice(global_batch_size: int) -> slice:
    """Rows of the global batch that this process feeds (contiguous, equal per process)."""
    count = jax.process_count()
    if global_batch_size % count:
        raise ValueError(f"global batch {global_batch_size} not divisible by {count} processes")
    per_process = global_batch_size // count
    start = jax.process_index() * per_process
    return slice(start, start + per_process)
