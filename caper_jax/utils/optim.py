"""Optimizer state and update shared by the SFT, PRM and GRPO trainers.

AdamW (weight decay on matrices only) after global-norm clipping, on a warmup + cosine schedule;
the moments are stored in ``optim.mu_dtype`` / ``optim.nu_dtype`` (default float32; bfloat16 halves
their memory — the update itself is computed in fp32 either way, docs/scale.md "Fitting 16 GiB");
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


MOMENT_DTYPES = ("float32", "bfloat16")


def moment_dtypes(optim) -> tuple[str, str]:
    """(mu_dtype, nu_dtype) of an optim config; configs without the fields get float32."""
    get = optim.get if hasattr(optim, "get") else lambda key, default: getattr(optim, key, default)
    dtypes = (str(get("mu_dtype", "float32")), str(get("nu_dtype", "float32")))
    for name, value in zip(("mu_dtype", "nu_dtype"), dtypes):
        if value not in MOMENT_DTYPES:
            raise ValueError(f"optim.{name}={value!r}; expected one of {MOMENT_DTYPES}")
    return dtypes


def scale_by_adam(b1: float, b2: float, mu_dtype: str = "float32", nu_dtype: str = "float32"
                  ) -> optax.GradientTransformation:
    """optax's ``scale_by_adam`` with both moments stored in the given dtypes.

    optax has ``mu_dtype`` only; its update already casts ``nu`` back to the dtype the state holds
    (``cast_like``), so a ``nu`` initialised in bfloat16 stays bfloat16. Moments are updated and
    bias-corrected in fp32 (bf16 moments are promoted by the fp32 gradient) and rounded to nearest
    when stored. Same state structure (``ScaleByAdamState``) as optax's, only the leaf dtypes differ.
    """
    inner = optax.scale_by_adam(b1=b1, b2=b2, mu_dtype=None if mu_dtype == "float32" else jnp.dtype(mu_dtype))
    if nu_dtype == "float32":
        return inner

    def init(params):
        state = inner.init(params)
        return state._replace(nu=jax.tree.map(lambda x: x.astype(nu_dtype), state.nu))

    return optax.GradientTransformation(init, inner.update)


def learning_rate_per_update(optim, updates_per_step: int = 1) -> optax.Schedule:
    """``learning_rate`` indexed by optax's update count: every update of loop step ``s`` (1-based)
    gets the rate of step ``s - 1``, as a trainer with one update per step has it.

    The schedule's ``warmup_steps`` and ``total_steps`` count loop steps. optax counts updates, and
    GRPO makes ``update_epochs x num_minibatches`` of them per step: on optax's count its warmup and
    cosine ran that many times too fast (the default 2 x 1: the rate reached its 10 % floor at step 20
    of 40). A refused update (``guarded_update``: non-finite) keeps optax's state, its count included,
    so each one delays the rest of the schedule by one update.
    """
    if updates_per_step < 1:
        raise ValueError(f"updates_per_step must be >= 1, got {updates_per_step}")
    per_step = learning_rate(optim)
    return lambda count: per_step(count // updates_per_step)


def make_optimizer(optim, updates_per_step: int = 1) -> optax.GradientTransformation:
    """AdamW on the ``learning_rate`` schedule, after global-norm clipping; moments in
    ``moment_dtypes(optim)``. The state tree is optax.adamw's (same nesting), whatever the dtypes.
    ``updates_per_step``: optimizer updates per loop step (``learning_rate_per_update``)."""
    mu_dtype, nu_dtype = moment_dtypes(optim)
    adamw = optax.chain(
        scale_by_adam(optim.b1, optim.b2, mu_dtype, nu_dtype),
        optax.add_decayed_weights(optim.weight_decay, decay_mask),
        optax.scale_by_learning_rate(learning_rate_per_update(optim, updates_per_step)),
    )
    return optax.chain(optax.clip_by_global_norm(optim.grad_clip), adamw)


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
