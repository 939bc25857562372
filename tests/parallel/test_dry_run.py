"""Dry run: FLOP counting against hand-computed values, and report() on a sharded step.

The FLOP counter is checked on programs whose matmul FLOPs are known in closed form (2·M·N·K per
matmul), including the two places XLA's own cost analysis gets wrong for us: scan bodies (counted
once by XLA) and rematerialised forwards. Memory figures of a sharded step are checked against the
bytes each device must hold, computed by hand from shapes and shardings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from caper_jax.parallel.dry_run import jaxpr_matmul_flops, report
from caper_jax.parallel.mesh import make_mesh
from tests.helpers import simulated_devices_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
M, K, N, L = 32, 48, 48, 5  # K == N: the scanned layer maps [M, K] to [M, K]


def _flops(fn, *shapes) -> float:
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _scan_mlp(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jax.lax.scan(jax.checkpoint(layer), x, ws)[0].sum()


def test_matmul_flops_of_scan_are_multiplied_by_length():
    assert _flops(_scan_mlp, (L, K, N), (M, K)) == L * 2 * M * K * N


def test_matmul_flops_of_remat_backward_include_recompute():
    # Per layer: forward 1 matmul, backward recomputes it (1) plus d/dh and d/dw (2): 4 in total.
    assert _flops(jax.grad(_scan_mlp), (L, K, N), (M, K)) == L * 4 * 2 * M * K * N


def test_matmul_flops_of_batched_dot_and_depthwise_conv():
    einsum = lambda a, b: jnp.einsum("bhtd,bhsd->bhts", a, b)  # noqa: E731
    assert _flops(einsum, (2, 3, 5, 7), (2, 3, 11, 7)) == 2 * 2 * 3 * 5 * 11 * 7

    def depthwise(x, w):  # x [B, C, T], w [C, 1, W]: each output element is a W-tap dot
        return jax.lax.conv_general_dilated(x, w, (1,), [(3, 0)], feature_group_count=x.shape[1])

    assert _flops(depthwise, (2, 6, 10), (6, 1, 4)) == 2 * (2 * 6 * 10) * 4


def test_report_on_one_device_matches_hand_computed_sizes():
    mesh = make_mesh((1, 1, 1))
    rep = NamedSharding(mesh, P())
    w = jax.ShapeDtypeStruct((L, K, N), jnp.float32, sharding=rep)
    x = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=rep)
    result = report(jax.grad(_scan_mlp), (w, x), mesh, params=None, print_fn=None)
    assert result["matmul_flops"] == L * 4 * 2 * M * K * N
    assert result["memory"]["argument_bytes"] == 4 * (L * K * N + M * K)
    assert result["memory"]["output_bytes"] == 4 * L * K * N
    memory = result["memory"]
    assert memory["temp_bytes"] > 0
    assert memory["peak_bytes"] == memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
    # XLA counts the scan bodies once: strictly less than the true count (why we count on the jaxpr).
    assert result["xla_flops_per_device"] < result["matmul_flops"]


def test_report_counts_qwen_params_like_transformers():
    """Parameter count of the tiny Qwen3.5 vs transformers' own model of the same config."""
    from flax import nnx
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
    from caper_jax.parallel.rules import DEFAULT_RULES, abstract_state

    config = Qwen35Config.tiny()
    mesh = make_mesh((1, 1, 1))
    graphdef, abstract = abstract_state(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), mesh, DEFAULT_RULES)
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32, sharding=NamedSharding(mesh, P()))
    result = report(lambda state, x: nnx.merge(graphdef, state)(x), (abstract, ids), mesh, print_fn=None)
    reference = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config.to_hf_dict())).num_parameters()
    assert result["params"] == reference
    assert result["memory"]["argument_bytes"] == 4 * reference + 4 * 2 * 16
    assert result["memory"]["output_bytes"] == 4 * 2 * 16 * config.vocab_size


def _fsdp8_child() -> dict:
    """report() of the scanned MLP's gradient with its weights sharded 8 ways over fsdp."""
    mesh = make_mesh((1, 8, 1))
    w_sharding = NamedSharding(mesh, P(None, "fsdp", None))
    w = jax.ShapeDtypeStruct((L, 8 * K, 8 * K), jnp.float32, sharding=w_sharding)
    x = jax.ShapeDtypeStruct((M, 8 * K), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
    step = jax.jit(jax.grad(_scan_mlp), out_shardings=w_sharding)
    result = report(step, (w, x), mesh, print_fn=None)
    return {"devices": jax.device_count(), **{k: result[k] for k in ("memory", "matmul_flops", "matmul_flops_per_device")}}


def test_report_on_eight_devices_counts_per_device_shards():
    env = simulated_devices_env(8)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.parallel.test_dry_run", "fsdp8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    # Each device holds 1/8 of the weights and of the input, and its 1/8 of the weight gradient.
    assert result["memory"]["argument_bytes"] == 4 * (L * K * 8 * K + M * K)
    assert result["memory"]["output_bytes"] == 4 * L * K * 8 * K
    assert result["matmul_flops"] == L * 4 * 2 * M * (8 * K) * (8 * K)
    assert result["matmul_flops_per_device"] == result["matmul_flops"] / 8


if __name__ == "__main__":
    print(json.dumps({"fsdp8": _fsdp8_child}[sys.argv[1]]()))
