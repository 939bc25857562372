"""Dry run: AOT-lower and compile a step on abstract, sharded inputs; report size, FLOPs, memory.

Nothing is allocated: the inputs are ``jax.ShapeDtypeStruct`` with shardings (see
``rules.abstract_state``), so a 9B-parameter train step can be checked on a laptop with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` simulating the mesh.

Two FLOP figures, because XLA's ``cost_analysis`` counts a ``while``/``scan`` body once (measured in
this JAX: a scan of 8 matmuls reports the FLOPs of one), which under-counts a model that scans over
its layers:
  * ``matmul_flops`` — counted on the jaxpr: every ``dot_general`` and convolution, with ``scan``
    bodies multiplied by their length and rematerialised forwards included (it is what the hardware
    executes). Global (all devices together), per step; elementwise ops are not counted (they are
    <1% for a transformer and are not what MFU is measured against).
  * ``xla_flops_per_device`` — XLA's own per-device count of the partitioned program (loop bodies
    once), kept as a cross-check for loop-free programs.

Memory is XLA's per-device buffer assignment (``memory_analysis``): arguments, outputs, aliased
(donated) bytes and temporaries; ``peak_bytes = argument + output - alias + temp`` is what one
device must hold while the step runs (the figure MaxText reports too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import Mesh

from caper_jax.parallel import hlo_collectives

GiB = 1024**3


def count_params(tree: Any) -> int:
    """Elements of every ``nnx.Param`` in ``tree`` (abstract or concrete)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return sum(math.prod(v.get_value().shape) for v in leaves if isinstance(v, nnx.Param))


def _dot_flops(eqn: jcore.JaxprEqn) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    contract = math.prod(lhs[d] for d in lhs_contract)
    batch = math.prod(lhs[d] for d in lhs_batch)
    lhs_free = math.prod(s for d, s in enumerate(lhs) if d not in (*lhs_contract, *lhs_batch))
    rhs_free = math.prod(s for d, s in enumerate(rhs) if d not in (*rhs_contract, *rhs_batch))
    return 2.0 * batch * lhs_free * rhs_free * contract


def _conv_flops(eqn: jcore.JaxprEqn) -> float:
    rhs = eqn.invars[1].aval.shape
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out_feature, in_feature, *spatial)
    window = math.prod(rhs[d] for d in rhs_spec[2:])
    out_elems = math.prod(eqn.outvars[0].aval.shape)
    return 2.0 * out_elems * window * rhs[rhs_spec[1]]


def _sub_jaxprs(eqn: jcore.JaxprEqn, while_trips: float = 1.0) -> list[tuple[jcore.Jaxpr, float]]:
    """(jaxpr, times it runs) for every sub-program of a higher-order primitive."""
    name = eqn.primitive.name
    if name == "cond":
        return []  # handled by the caller: the most expensive branch
    multiplier = float(eqn.params["length"]) if name == "scan" else while_trips if name == "while" else 1.0
    subs = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                subs.append((item.jaxpr, multiplier))
            elif isinstance(item, jcore.Jaxpr):
                subs.append((item, multiplier))
    return subs


def jaxpr_matmul_flops(jaxpr: jcore.Jaxpr, while_trips: float = 1.0) -> float:
    """Matmul + convolution FLOPs of a jaxpr, scan bodies × length, while bodies × ``while_trips``
    (the trip count is not in the jaxpr; e.g. the sampler's decode loop runs max_new_tokens - 1 times)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
        elif name == "conv_general_dilated":
            total += _conv_flops(eqn)
        elif name == "cond":
            total += max(jaxpr_matmul_flops(b.jaxpr, while_trips) for b in eqn.params["branches"])
        else:
            total += sum(k * jaxpr_matmul_flops(sub, while_trips) for sub, k in _sub_jaxprs(eqn, while_trips))
    return total


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of ``tree``'s arrays / ShapeDtypeStructs (the largest shard, by sharding)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        local = sharding.shard_shape(shape) if sharding is not None else shape
        total += math.prod(local) * np.dtype(leaf.dtype).itemsize
    return total


def _memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    memory = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
    }
    # Everything the program needs at once: inputs, outputs not aliased to (donated) inputs, and
    # the temporaries' buffer assignment (already liveness-packed by XLA). XLA's own
    # `peak_memory_in_bytes` is not used: on CPU it equals argument + output and omits temporaries.
    memory["peak_bytes"] = (
        memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]
    )
    return memory


def report(
    step_fn: Callable[..., Any],
    abstract_args: Sequence[Any],
    mesh: Mesh,
    *,
    params: Any = None,
    donate_argnums: Sequence[int] = (),
    print_fn: Callable[[str], None] | None = print,
    static_kwargs: dict[str, Any] | None = None,
    while_trips: float = 1.0,
) -> dict[str, Any]:
    """Lowers and compiles ``step_fn(*abstract_args)`` on ``mesh``; returns (and prints) the figures.

    Args:
      step_fn: a pure function (or an already ``jax.jit``-wrapped one, whose own options are kept).
      abstract_args: ``ShapeDtypeStruct`` pytrees carrying their input shardings (nnx.State allowed).
      mesh: the mesh the shardings refer to; lowering runs under ``jax.set_mesh(mesh)``.
      params: pytree whose ``nnx.Param`` elements are counted; default: all of ``abstract_args``.
      donate_argnums: donated inputs (their buffers are reused by outputs), if ``step_fn`` is not
        already jitted.
      print_fn: where the summary goes; ``None`` to stay silent.
      static_kwargs: keyword arguments passed as they are (a jitted function's static arguments).
      while_trips: how many times each ``while`` body runs, for the FLOP count (default once).

    Returns a dict: ``params``, ``matmul_flops`` (global per step), ``matmul_flops_per_device``,
    ``xla_flops_per_device``, ``memory`` (per-device bytes: argument/output/alias/temp/peak),
    ``collective_bytes`` (per device and call, by kind: ``parallel.hlo_collectives``),
    ``mesh``, ``lower_s``, ``compile_s``, and, not printed, ``output_shardings`` (the compiled
    program's, to chain one program's outputs into the next one's abstract inputs) and ``compiled``.
    """
    jitted = step_fn if hasattr(step_fn, "lower") else jax.jit(step_fn, donate_argnums=tuple(donate_argnums))
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        traced = jitted.trace(*abstract_args, **(static_kwargs or {}))
        lowered = traced.lower()
        lower_s = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    matmul_flops = jaxpr_matmul_flops(traced.jaxpr.jaxpr, while_trips)
    hlo_text = compiled.as_text()
    result = {
        "params": count_params(abstract_args if params is None else params),
        "matmul_flops": matmul_flops,
        "matmul_flops_per_device": matmul_flops / mesh.size,
        "xla_flops_per_device": float((cost or {}).get("flops", float("nan"))),
        "memory": _memory(compiled),
        "mesh": dict(mesh.shape),
        "lower_s": lower_s,
        "compile_s": compile_s,
        "output_shardings": compiled.output_shardings,
        # Bytes each kind of collective moves per call, per device, read from the compiled HLO (loops by their trip
        # counts), and its three largest unfused buffers (where a full-size vocabulary buffer would show).
        "collective_bytes": hlo_collectives.collective_bytes(hlo_text),
        "largest_buffers": [{"shape": b.shape, "bytes": b.bytes, "op": (b.op_names or [""])[0]}
                            for b in hlo_collectives.largest_shapes(hlo_text, 3)],
        "compiled": compiled,   # not printed
    }
    if print_fn is not None:
        print_fn(format_report(result))
    return result


def format_report(result: dict[str, Any]) -> str:
    mem = result["memory"]
    mesh = " × ".join(f"{k}={v}" for k, v in result["mesh"].items())
    lines = [
        f"mesh               {mesh} ({int(np.prod(list(result['mesh'].values())))} devices)",
        f"parameters         {result['params']:,} ({result['params'] / 1e9:.3f} B)",
        f"matmul FLOPs/step  {result['matmul_flops']:.4e} total, {result['matmul_flops_per_device']:.4e} per device",
        f"XLA FLOPs/device   {result['xla_flops_per_device']:.4e} (loop bodies counted once)",
        "per-device memory  "
        + ", ".join(f"{k.removesuffix('_bytes')} {v / GiB:.2f} GiB" for k, v in mem.items()),
        "collectives/device " + ", ".join(f"{k} {v / GiB:.3f} GiB" for k, v in result["collective_bytes"].items()),
        f"lower {result['lower_s']:.1f} s, compile {result['compile_s']:.1f} s",
    ]
    return "\n".join(lines)
