"""Optimizer state and update shared by the SFT, PRM and GRPO trainers.

AdamW (weight decay on matrices only) after global-norm clipping, on a warmup + cosine schedule;
``guarded_update`` applies an update only when the loss and the gradient are finite, and counts the
refusals in a row so each trainer's host loop can stop a run that keeps producing them.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct


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


def guarded_update(state: TrainState, loss: jax.Array, grads: Any, tx: optax.GradientTransformation, *,
                   advance_step: bool = True) -> tuple[TrainState, dict[str, jax.Array]]:
    """``state`` after the optax update, or ``state`` unchanged (but counted) when ``loss`` or the
    gradient norm is not finite. ``advance_step``: whether ``state.step`` counts this update (GRPO
    counts its outer steps itself). Returns the new state and ``loss``, ``grad_norm``, ``refused``."""
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    new_state = TrainState(
        step=state.step + 1 if advance_step else state.step,
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        nonfinite=jnp.where(finite, 0, state.nonfinite + 1),
    )
    return new_state, {"loss": loss, "grad_norm": grad_norm, "refused": 1.0 - finite.astype(jnp.float32)}
