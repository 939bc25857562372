"""Mesh construction, logical-axis rules, sharded params and a sharded forward/backward.

Rule resolution is checked in-process against hand-written PartitionSpecs on an AbstractMesh (no
devices needed). Everything that needs 8 devices runs once in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (this file run as a script), because the
pytest process has already initialised JAX with one CPU device; the subprocess prints its
measurements as JSON and the tests below assert on them. The 1-device reference is computed in the
same subprocess from the *same* parameter values gathered to the host.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from caper_jax.parallel.mesh import MeshShapeError, make_mesh, resolve_mesh_shape
from caper_jax.parallel.rules import DEFAULT_RULES, LogicalAxisError, logical_to_spec
from tests.helpers import simulated_devices_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH_2x2x2 = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
MESH_1x1x8 = AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)

# Forward/backward of the sharded model vs the 1-device model, fp32: the only difference is the
# order of the cross-device sums (reduce-scatter/all-reduce), so agreement is to fp32 rounding.
# Per parameter: max |g - g_ref| <= GRAD_RTOL * max |g_ref| + GRAD_ATOL * (max |g_ref| over all
# params); the absolute term covers parameters whose gradients are ~1e-6 (DeltaNet decay of the
# last layer), where rounding relative to their own scale reaches ~3e-5 (measured).
# The loss is a mean over a few thousand fp32 terms summed in another order: rounding is
# ~sqrt(n) * eps ~ 1e-5 at worst (random-walk bound for n ~ 4096, eps = 1.2e-7).
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6


# ---------------------------------------------------------------------------------------------
# In-process: mesh shapes and rule resolution.


def test_resolve_mesh_shape_fills_one_axis():
    assert resolve_mesh_shape((1, -1, 2), 8) == (1, 4, 2)
    assert resolve_mesh_shape((2, 2, 2), 8) == (2, 2, 2)
    for bad in [(-1, -1, 1), (3, -1, 1), (2, 2, 1), (0, -1, 1)]:
        with pytest.raises(MeshShapeError):
            resolve_mesh_shape(bad, 8)


def test_make_mesh_uses_auto_axes_and_config_mapping():
    mesh = make_mesh({"data": 1, "fsdp": -1})
    assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "tensor": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    with pytest.raises(MeshShapeError, match="unknown mesh axes"):
        make_mesh({"model": 1})


def test_logical_to_spec_hand_computed():
    rules = DEFAULT_RULES
    assert logical_to_spec(("embed", "mlp"), rules, shape=(64, 128), mesh=MESH_2x2x2) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", "length", "embed"), rules, shape=(8, 16, 64), mesh=MESH_2x2x2) == P(
        ("data", "fsdp"), None, None  # fsdp already shards the batch, so not the embed dim too
    )
    assert logical_to_spec(("layers", "embed", "heads"), rules) == P(None, "fsdp", "tensor")
    assert logical_to_spec(None, rules) == P()


def test_logical_to_spec_drops_mesh_axes_that_do_not_divide():
    # 4 KV heads on an 8-way tensor axis: replicated rather than padded.
    assert logical_to_spec(("embed", "kv_heads"), DEFAULT_RULES, shape=(64, 4), mesh=MESH_1x1x8) == P("fsdp", None)
    # Batch 2 on (data=2, fsdp=2): keeps the prefix that divides.
    assert logical_to_spec(("batch", None), DEFAULT_RULES, shape=(2, 3), mesh=MESH_2x2x2) == P("data", None)


def test_logical_to_spec_rejects_unknown_names_and_axes():
    with pytest.raises(LogicalAxisError, match="no rule"):
        logical_to_spec(("embedd",), DEFAULT_RULES)
    with pytest.raises(LogicalAxisError, match="missing from mesh"):
        logical_to_spec(("embed",), [("embed", "model")], shape=(8,), mesh=MESH_2x2x2)
    with pytest.raises(LogicalAxisError, match="do not match shape"):
        logical_to_spec(("embed",), DEFAULT_RULES, shape=(8, 8), mesh=MESH_2x2x2)


# ---------------------------------------------------------------------------------------------
# Two processes × 4 CPU devices: host-local slices → one global batch.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _multihost_child() -> dict:
    from jax.sharding import NamedSharding

    from caper_jax.parallel import multihost

    assert multihost.initialize()
    mesh = make_mesh((2, -1, 1))  # 8 global devices: data=2 x fsdp=4
    global_batch = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    rows = multihost.process_slice(16)
    x = multihost.host_local_to_global({"x": global_batch[rows]}, mesh)["x"]
    row_sums = jax.jit(lambda a: (a * a).sum(axis=1), out_shardings=NamedSharding(mesh, P()))(x)
    local_rows = sorted({int(s.index[0].start) for s in x.addressable_shards})
    return {
        "process": jax.process_index(),
        "global_shape": list(x.shape),
        "spec": str(x.sharding.spec),
        "local_row_starts": local_rows,
        "row_sums": np.asarray(row_sums).tolist(),
    }


def test_two_processes_build_one_global_batch():
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.parallel.test_sharding", "multihost"],
            cwd=REPO,
            env=simulated_devices_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    expected = (np.arange(16 * 3, dtype=np.float32).reshape(16, 3) ** 2).sum(axis=1)
    for i, result in enumerate(results):
        assert result["process"] == i
        assert result["global_shape"] == [16, 3]
        assert result["spec"] == str(P(("data", "fsdp"), None))
        # 8 batch shards of 2 rows; process i holds global rows [8i, 8i + 8).
        assert result["local_row_starts"] == list(range(8 * i, 8 * i + 8, 2))
        np.testing.assert_array_equal(result["row_sums"], expected)


# ---------------------------------------------------------------------------------------------
# 8 simulated devices, mesh data=2 x fsdp=2 x tensor=2: the tiny Qwen3.5 model.


def _lm_loss(model, ids):
    import optax

    logits = model(ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def _mesh8_child() -> dict:
    from flax import nnx

    from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
    from caper_jax.parallel import multihost
    from caper_jax.parallel.rules import create_sharded, shard_state

    assert jax.device_count() == 8
    mesh = make_mesh((2, 2, 2))
    config = Qwen35Config.tiny()
    model = create_sharded(
        lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0), mesh=mesh, rules=DEFAULT_RULES), mesh, DEFAULT_RULES
    )
    params = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        params.append({
            "path": "/".join(map(str, path)),
            "names": list(var.get_metadata()["out_sharding"]),
            "shape": list(value.shape),
            "spec": [list(a) if isinstance(a, tuple) else a for a in value.sharding.spec],
            "shard_shapes": sorted({tuple(s.data.shape) for s in value.addressable_shards}),
            "num_shards": len(value.addressable_shards),
        })

    ids_np = np.random.default_rng(0).integers(0, config.vocab_size, (8, 32), dtype=np.int32)
    ids = multihost.host_local_to_global(ids_np, mesh)
    graphdef, state = nnx.split(model)
    loss_and_grad = jax.value_and_grad(lambda st, x: _lm_loss(nnx.merge(graphdef, st), x))
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(loss_and_grad)(state, ids)

    # Reference: the same parameter values on one device, no mesh.
    reference = nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    host_state = jax.tree.map(np.asarray, nnx.state(model))
    placed = shard_state(host_state, mesh, DEFAULT_RULES)  # host values → the same layout
    placement_matches = all(
        a.sharding.is_equivalent_to(b.sharding, a.ndim) and np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(nnx.state(model)))
    )
    nnx.update(reference, jax.device_put(host_state, jax.devices()[0]))
    ref_graphdef, ref_state = nnx.split(reference)
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda st, x: _lm_loss(nnx.merge(ref_graphdef, st), x))
    )(ref_state, jnp.asarray(ids_np))
    grad_errors = {}
    for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        g, r = np.asarray(g.get_value()), np.asarray(r.get_value())
        grad_errors["/".join(map(str, path))] = [float(np.abs(g - r).max()), float(np.abs(r).max())]
    return {
        "params": params,
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "batch_spec": str(ids.sharding.spec),
        "shard_state_matches": placement_matches,
        "grad_errors": grad_errors,
    }


@pytest.fixture(scope="module")
def mesh8():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.parallel.test_sharding", "mesh8"],
        cwd=REPO, env=simulated_devices_env(8), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_params_are_created_sharded_by_the_rules(mesh8):
    mesh_sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    sharded = 0
    for p in mesh8["params"]:
        expected = logical_to_spec(p["names"], DEFAULT_RULES, shape=p["shape"], mesh=MESH_2x2x2)
        spec = [tuple(a) if isinstance(a, list) else a for a in p["spec"]]
        assert P(*spec) == expected, p["path"]
        # Each device holds exactly its slice: every dim divided by the mesh axes sharding it.
        shard = [
            dim // int(np.prod([mesh_sizes[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
            for dim, axes in zip(p["shape"], list(expected) + [None] * (len(p["shape"]) - len(expected)))
        ]
        assert p["shard_shapes"] == [shard], p["path"]
        assert p["num_shards"] == 8
        sharded += shard != p["shape"]
    by_path = {p["path"]: p for p in mesh8["params"]}
    assert by_path["embed_tokens"]["shard_shapes"] == [[128, 32]]  # [vocab/tensor, embed/fsdp]
    assert by_path["layers/0/mlp/gate_proj"]["shard_shapes"] == [[1, 32, 64]]  # [layers, embed/fsdp, mlp/tensor]
    assert sharded >= len(mesh8["params"]) - 10  # only small per-head vectors stay replicated
    assert mesh8["shard_state_matches"]  # shard_state puts host values in the same layout


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_sharded_forward_backward_matches_one_device(mesh8):
    assert mesh8["batch_spec"] == str(P(("data", "fsdp"), None))
    assert abs(mesh8["loss"] - mesh8["ref_loss"]) <= LOSS_RTOL * abs(mesh8["ref_loss"])
    global_scale = max(scale for _, scale in mesh8["grad_errors"].values())
    for path, (max_err, scale) in mesh8["grad_errors"].items():
        assert scale > 0, path
        assert max_err <= GRAD_RTOL * scale + GRAD_ATOL * global_scale, (path, max_err, scale)


if __name__ == "__main__":
    _CHILDREN = {"multihost": _multihost_child, "mesh8": _mesh8_child}
    print(json.dumps(_CHILDREN[sys.argv[1]]()))
