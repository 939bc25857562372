"""Jitted Clause-PRM steps: pure functions of (state, batch).

``train_step`` scores the chosen and rejected sides of a batch of preference tuples in ONE forward pass
(the two halves, and any within-trajectory group rows, are concatenated along the batch), applies the pair loss of ``caper_jax.prm.loss`` and an
optax AdamW update. A step whose loss or gradient is not finite is refused inside the jitted function —
parameters and optimizer state stay as they were — and ``state.nonfinite`` counts such refusals in a row
so the host loop can stop a run that keeps producing them.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from caper_jax.prm.loss import PairLossConfig, pairwise_loss


@struct.dataclass
class TrainState:
    step: jax.Array          # loop steps taken (refused ones included: their batch is consumed)
    params: Any              # nnx.State of the ClausePRM
    opt_state: Any
    nonfinite: jax.Array     # consecutive refused (non-finite) steps


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: norms, gains, biases and per-head scalars are left alone.

    Stacked layer parameters carry a leading ``layers`` axis, which does not count as a matrix axis.
    """
    def is_matrix(path, leaf) -> bool:
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        return leaf.ndim - int(stacked) >= 2
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def learning_rate(optim) -> optax.Schedule:
    """Linear warmup to ``optim.lr``, then cosine decay to 10 % of it at ``optim.total_steps``."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=optim.warmup_steps,
        decay_steps=max(optim.total_steps, optim.warmup_steps + 1), end_value=0.1 * optim.lr)


def make_optimizer(optim) -> optax.GradientTransformation:
    """AdamW on the ``learning_rate`` schedule, after global-norm clipping."""
    return optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        optax.adamw(learning_rate(optim), b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay,
                    mask=decay_mask),
    )


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      nonfinite=jnp.zeros((), jnp.int32))


def _pair_scores(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    pos = jnp.concatenate([batch["chosen_pos"], batch["rejected_pos"]])
    scores = model(ids, mask, pos)
    n = batch["chosen_ids"].shape[0]
    return scores[:n], scores[n:]


def _all_pairs(graphdef, params, batch):
    """(r_chosen, r_rejected, margin, weight) of every pair of a training batch, in one forward pass.

    Without ``group_*`` keys these are the tuple rows. With them (``prm_pipeline(within_batch_size>0)``)
    the group rows join the same forward pass and each group contributes its within-trajectory pairs,
    slot k > 0 (chosen) against slot 0 (the root state), with the margins ``group_margin[:, k]``;
    empty slots (margin 0) and padding groups get weight 0.
    """
    if "group_ids" not in batch:
        r_pos, r_neg = _pair_scores(graphdef, params, batch)
        return r_pos, r_neg, batch["margin"], batch["weight"]
    model = nnx.merge(graphdef, params)
    n = batch["chosen_ids"].shape[0]
    slots = batch["group_pos"].shape[1]
    ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"], batch["group_ids"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"], batch["group_mask"]])
    pair_pos = jnp.concatenate([batch["chosen_pos"], batch["rejected_pos"]])
    pair_pos = jnp.concatenate([pair_pos[:, None], jnp.full((2 * n, slots - 1), -1, pair_pos.dtype)], axis=1)
    scores = model(ids, mask, jnp.concatenate([pair_pos, batch["group_pos"]]))      # [2n + G, K]
    group = scores[2 * n:]
    margin = batch["group_margin"][:, 1:]
    group_weight = batch["group_weight"][:, None] * (margin > 0)
    return (jnp.concatenate([scores[:n, 0], group[:, 1:].reshape(-1)]),
            jnp.concatenate([scores[n:2 * n, 0], jnp.broadcast_to(group[:, :1], margin.shape).reshape(-1)]),
            jnp.concatenate([batch["margin"], margin.reshape(-1)]),
            jnp.concatenate([batch["weight"], group_weight.reshape(-1)]))


def train_step(state: TrainState, batch: dict, *, graphdef, tx: optax.GradientTransformation,
               loss_cfg: PairLossConfig) -> tuple[TrainState, dict]:
    def loss_fn(params):
        return pairwise_loss(*_all_pairs(graphdef, params, batch), loss_cfg)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    new_state = TrainState(
        step=state.step + 1,
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        nonfinite=jnp.where(finite, 0, state.nonfinite + 1),
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "refused": 1.0 - finite.astype(jnp.float32), **metrics}
    return new_state, metrics


def eval_scores(params: Any, batch: dict, *, graphdef) -> tuple[jax.Array, jax.Array]:
    """(r_chosen, r_rejected) for a batch of tuples."""
    return _pair_scores(graphdef, params, batch)


def clause_scores(params: Any, input_ids: jax.Array, attention_mask: jax.Array, clause_pos: jax.Array,
                  *, graphdef) -> jax.Array:
    """[B, K] scores of every clause of each query (one forward per query; -1 positions give 0)."""
    return nnx.merge(graphdef, params)(input_ids, attention_mask, clause_pos)


def jit_steps(graphdef, tx, loss_cfg, state_sharding=None):
    """The jitted (train_step, eval_scores, clause_scores) with the state donated to train_step."""
    train = jax.jit(functools.partial(train_step, graphdef=graphdef, tx=tx, loss_cfg=loss_cfg),
                    donate_argnums=0,
                    out_shardings=None if state_sharding is None else (state_sharding, None))
    evals = jax.jit(functools.partial(eval_scores, graphdef=graphdef))
    clauses = jax.jit(functools.partial(clause_scores, graphdef=graphdef))
    return train, evals, clauses
