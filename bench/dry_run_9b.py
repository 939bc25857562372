"""Dry run of a Qwen3.5-9B Clause-PRM train step on a simulated mesh: params, FLOPs, memory.

The step is what the PRM trainer runs: backbone ``hidden_states`` (bf16 compute, fp32 master
params, full remat per layer group, scan over the 8 groups) → fp32 linear score head read at K
clause-boundary positions per sequence → margin-weighted Bradley–Terry loss over (chosen, rejected)
row pairs → AdamW (+ global-norm clipping) update, state donated. Nothing is allocated: inputs are
ShapeDtypeStructs with shardings and ``caper_jax.parallel.dry_run.report`` lowers and compiles.

The PRM never reads the 248k-vocab logits, so the backbone is built without a separate LM head
(``tie_word_embeddings=True`` creates none; the embedding table is still there and trained). That
drops 1.0 B parameters (16 GB of fp32 param + grad + Adam state) that the real PRM must not carry.

    python bench/dry_run_9b.py --devices 8              # 8-way FSDP, the ≤ 40 GiB/device target
    python bench/dry_run_9b.py --devices 16             # 16-way FSDP, a v5e chip has 16 GiB
    python bench/dry_run_9b.py --devices 16 --remat layers --mu_dtype bfloat16 --nu_dtype bfloat16
                                                        # the levers that fit it (docs/scale.md)
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (all on fsdp)")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (-1: the rest)")
    parser.add_argument("--seqs_per_device", type=int, default=1, help="sequences per device per step")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=8, help="clause boundaries scored per sequence")
    parser.add_argument("--remat", default="full", choices=("none", "full", "dots", "layers"),
                        help="model.remat: layers = full per group + each layer checkpointed again")
    parser.add_argument("--mu_dtype", default="float32", choices=("float32", "bfloat16"), help="optim.mu_dtype")
    parser.add_argument("--nu_dtype", default="float32", choices=("float32", "bfloat16"), help="optim.nu_dtype")
    parser.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    parser.add_argument("--layers", type=int, default=32, help="fewer layers for a quick check")
    parser.add_argument("--cast", default="none", choices=("matrices", "none"),
                        help="cast 2-D weights to bf16 once per step, before the layer scan (see module doc)")
    parser.add_argument("--rule", action="append", default=[], metavar="NAME=AXIS[+AXIS]",
                        help="override a logical-axis rule, e.g. vocab=tensor+fsdp or embed=none")
    return parser.parse_args()


ARGS = parse_args()
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import start_load_check  # noqa: E402

LOAD = start_load_check(own=1)  # compiling keeps about one core busy

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from ml_collections import ConfigDict  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from caper_jax.models import Qwen35ForCausalLM, qwen35_9b  # noqa: E402
from caper_jax.parallel.dry_run import report  # noqa: E402
from caper_jax.parallel.mesh import make_mesh  # noqa: E402
from caper_jax.parallel.rules import DEFAULT_RULES, abstract_state, logical_to_spec  # noqa: E402
from caper_jax.prm.loss import PairLossConfig, pairwise_loss  # noqa: E402
from caper_jax.utils.optim import make_optimizer  # noqa: E402


class PrmLike(nnx.Module):
    """Backbone + a linear scalar score head on the final hidden state."""

    def __init__(self, config, mesh, rules, rngs: nnx.Rngs):
        self.backbone = Qwen35ForCausalLM(config, rngs=rngs, mesh=mesh, rules=rules)
        self.score = nnx.Param(jnp.zeros((config.hidden_size,), jnp.float32), out_sharding=("embed",), eager_sharding=False)


def compute_copy(module: nnx.Module) -> nnx.Module:
    """The module with every weight *matrix* cast to bf16 (vectors — norms, decays — stay fp32).

    Done once per step on the sharded fp32 master params, so FSDP all-gathers (and the gathered
    per-group gradients, before their reduce-scatter) move bf16 instead of fp32. Gradients flow
    back through the cast to the fp32 masters.
    """
    graphdef, state = nnx.split(module)

    def cast(var):
        names = [n for n in var.get_metadata().get("out_sharding") or () if n != "layers"]
        value = var.get_value()
        return var.replace(value.astype(jnp.bfloat16)) if len(names) >= 2 else var

    state = jax.tree.map(cast, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


class TrainState(nnx.Module):
    def __init__(self, model: PrmLike, tx: optax.GradientTransformation):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


def sharding_rules() -> tuple:
    overrides = {}
    for item in ARGS.rule:
        name, _, axes = item.partition("=")
        parts = tuple(a for a in axes.split("+") if a and a.lower() != "none")
        overrides[name] = None if not parts else parts[0] if len(parts) == 1 else parts
    return tuple(overrides.items()) + tuple(r for r in DEFAULT_RULES if r[0] not in overrides)


def main() -> None:
    rules = sharding_rules()
    mesh = make_mesh(tuple(int(s) for s in ARGS.mesh.split(",")))
    layer_types = None if ARGS.layers == 32 else qwen35_9b().layer_types[: ARGS.layers]
    config = qwen35_9b(
        dtype="bfloat16", param_dtype="float32", remat=ARGS.remat, tie_word_embeddings=True,
        unroll_layers=False,   # the accelerators' scanned program (the CPU's default unrolls)
        **({} if layer_types is None else {"num_hidden_layers": ARGS.layers, "layer_types": layer_types}),
    )
    # The PRM trainer's optimizer (caper_jax/utils/optim.py) with configs/prm.py's 9B settings.
    tx = make_optimizer(ConfigDict(dict(lr=1e-5, warmup_steps=30, total_steps=2000, weight_decay=0.01, b1=0.9,
                                        b2=0.95, grad_clip=1.0, mu_dtype=ARGS.mu_dtype, nu_dtype=ARGS.nu_dtype)))
    loss_config = PairLossConfig()
    graphdef, abstract = abstract_state(
        lambda: TrainState(PrmLike(config, mesh, rules, nnx.Rngs(0)), tx), mesh, rules
    )

    def train_step(state, batch):
        train_state = nnx.merge(graphdef, state)

        def loss_fn(model: PrmLike):
            backbone = model.backbone if ARGS.cast == "none" else compute_copy(model.backbone)
            hidden = backbone.hidden_states(batch["ids"], batch["mask"])                # [B, T, H] bf16
            at = jnp.take_along_axis(hidden, batch["positions"][..., None], axis=1)    # [B, K, H]
            scores = jnp.einsum("bkh,h->bk", at.astype(jnp.float32), model.score[...])
            chosen, rejected = scores[0::2].reshape(-1), scores[1::2].reshape(-1)
            loss, _ = pairwise_loss(chosen, rejected, batch["margin"].reshape(-1), batch["weight"].reshape(-1), loss_config)
            return loss

        loss, grads = nnx.value_and_grad(loss_fn)(train_state.model)
        train_state.optimizer.update(train_state.model, grads)
        return nnx.state(train_state), loss

    batch_size = ARGS.seqs_per_device * mesh.size
    pairs = batch_size // 2
    k = ARGS.positions

    def batch_struct(shape, dtype, names):
        spec = logical_to_spec(names, rules, shape=shape, mesh=mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    batch = {
        "ids": batch_struct((batch_size, ARGS.seq_len), jnp.int32, ("batch", "length")),
        "mask": batch_struct((batch_size, ARGS.seq_len), jnp.int32, ("batch", "length")),
        "positions": batch_struct((batch_size, k), jnp.int32, ("batch", None)),
        "margin": batch_struct((pairs, k), jnp.float32, ("batch", None)),
        "weight": batch_struct((pairs, k), jnp.float32, ("batch", None)),
    }
    state_shardings = jax.tree.map(lambda x: x.sharding, abstract)
    step = jax.jit(
        train_step,
        donate_argnums=0,
        out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
    )
    print(f"Qwen3.5-9B PRM step: {ARGS.layers} layers, batch {batch_size} x {ARGS.seq_len} "
          f"({ARGS.seqs_per_device}/device), {k} scored positions/sequence, remat={ARGS.remat}, "
          f"fp32 params + bf16 compute (weight cast: {ARGS.cast}), AdamW moments mu {ARGS.mu_dtype} / nu "
          f"{ARGS.nu_dtype}; rule overrides {ARGS.rule or 'none'}")
    result = report(step, (abstract, batch), mesh, params=abstract.model)
    tokens = batch_size * ARGS.seq_len
    # Reference point: 6·N per token for forward + backward, 8·N with a rematerialised forward, where
    # N excludes the embedding table (a gather, no FLOPs); attention and DeltaNet add the rest.
    dense = result["params"] - config.vocab_size * config.hidden_size
    print(f"matmul FLOPs per token {result['matmul_flops'] / tokens:.4e}; non-embedding N = {dense:,}: "
          f"6N = {6 * dense:.4e}, 8N = {8 * dense:.4e}")
    LOAD.finish()
    if ARGS.json:
        print(json.dumps({"args": vars(ARGS), **{k: v for k, v in result.items() if k not in ("output_shardings", "compiled")},
                          "load": LOAD.as_dict()}))


if __name__ == "__main__":
    main()
