"""Clause-level GRPO advantages: group-normalised rewards, then a return-to-go over clause units.

This is the process-supervision form of GRPO (DeepSeekMath §4.1.3) with clauses as the steps:

    r̃[i, k] = (r[i, k] - mean(R_g)) / (std(R_g) + eps)    R_g: every valid unit reward of group g
    A[i, k] = Σ_{j ≥ k} γ^(j-k) · r̃[i, j]                (return-to-go over unit positions)
    adv[i, t] = A[i, token_clause[i, t]]                    (0 off the mask or where token_clause = -1)

Normalisation is *pooled* over all units of all rows of the group, not per clause position: clause k of
one completion need not be the same clause kind as clause k of another (ragged SELECT/FROM/WHERE/...
sequences), so per-position statistics would compare unlike things and be computed from few samples.
Pooling also makes the sparse variant (one unit per row) reduce exactly to outcome-supervised GRPO.

The standard deviation's conventions are arguments (the trainer's ``rl.std_ddof``, ``rl.std_eps``,
``rl.std_scope``; docs/grpo.md maps them to TRL's and tunix's): ``std_ddof`` 0 (population, the
default) or 1 (Bessel's, as TRL and tunix); ``eps`` added to the std keeps a group whose rewards are all
equal at advantage 0 instead of 0/0; ``std_scope="batch"`` takes the std over every valid unit of the
batch instead of the group (TRL's ``scale_rewards="batch"``), the mean staying the group's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


STD_SCOPES: tuple[str, ...] = ("group", "batch")


def _centred(values: Array, valid: Array) -> tuple[Array, Array]:
    """Each row of ``values`` ``[N, M]`` minus the mean of its valid entries (0 where invalid), and the
    rows' valid counts ``[N, 1]``."""
    count = valid.sum(axis=1, keepdims=True)
    mean = jnp.where(valid, values, 0.0).sum(axis=1, keepdims=True) / jnp.maximum(count, 1)
    return jnp.where(valid, values - mean, 0.0), count


def _std(centred: Array, count: Array, ddof: int) -> Array:
    """Std ``[N, 1]`` of centred rows, ``ddof`` as numpy's. The divisor is ``max(count - ddof, 1)``: a
    pool of one valid value (or none) has std 0 instead of 0/0 under either ddof, and its centred
    values are 0, so its advantages are 0 like an equal-reward group's."""
    return jnp.sqrt((centred**2).sum(axis=1, keepdims=True) / jnp.maximum(count - ddof, 1))


def normalise_group_rewards(
    rewards: Array, mask: Array, group_size: int, *, eps: float = 1e-6, scale_by_std: bool = True,
    std_ddof: int = 0, std_scope: str = "group",
) -> Array:
    """Group-normalised unit rewards ``[B, K]``; masked units come back as 0.

    Consecutive rows ``[g*group_size, (g+1)*group_size)`` form group ``g``; the mean is pooled over
    every valid unit of the group, and so is the std with ``std_scope="group"``; ``std_scope="batch"``
    pools the std over every valid unit of the batch (around the batch mean, as TRL's
    ``scale_rewards="batch"``). ``std_ddof``: 0 population std, 1 Bessel-corrected sample std.
    ``scale_by_std=False`` only centres (Dr. GRPO drops the std division because it up-weights groups
    whose rewards barely differ); ``std_*`` are then unused.
    """
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof={std_ddof} must be 0 (population std) or 1 (sample std)")
    if std_scope not in STD_SCOPES:
        raise ValueError(f"unknown std_scope {std_scope!r}; expected one of {STD_SCOPES}")
    batch, units = rewards.shape
    if group_size < 1 or batch % group_size:
        raise ValueError(f"batch {batch} is not a multiple of group_size {group_size}")
    rewards = rewards.astype(jnp.float32)
    valid = mask.astype(bool)
    grouped = rewards.reshape(batch // group_size, group_size * units)
    grouped_valid = valid.reshape(grouped.shape)
    centred, count = _centred(grouped, grouped_valid)
    normalised = centred
    if scale_by_std:
        if std_scope == "group":
            std = _std(centred, count, std_ddof)
        else:   # around the batch's mean, not the groups' (TRL's rewards.std())
            std = _std(*_centred(rewards.reshape(1, -1), valid.reshape(1, -1)), std_ddof)
        normalised = centred / (std + eps)
    return normalised.reshape(batch, units)


def discounted_return_to_go(rewards: Array, gamma: float | Array) -> Array:
    """``A[:, k] = Σ_{j ≥ k} γ^(j-k) rewards[:, j]`` along the last axis.

    An associative scan over affine maps ``h ↦ r + γ·h`` (log depth, exact in fp32, no γ^-k blow-up
    for long unit sequences such as the token-level variant's).
    """
    decay = jnp.broadcast_to(jnp.asarray(gamma, rewards.dtype), rewards.shape)

    def compose(later, earlier):
        # With reverse=True the scan accumulates from the end: `later` is the map already built for
        # positions after `earlier`; the composite applies `later` first, then `earlier`.
        decay_later, reward_later = later
        decay_earlier, reward_earlier = earlier
        return decay_earlier * decay_later, reward_earlier + decay_earlier * reward_later

    _, returns = jax.lax.associative_scan(compose, (decay, rewards), reverse=True, axis=rewards.ndim - 1)
    return returns


@functools.partial(jax.jit, static_argnames=("group_size", "scale_by_std", "std_ddof", "std_scope"))
def clause_advantages(
    clause_rewards: Array,
    clause_mask: Array,
    token_clause: Array,
    token_mask: Array,
    group_size: int,
    gamma: float | Array = 1.0,
    *,
    eps: float = 1e-6,
    scale_by_std: bool = True,
    std_ddof: int = 0,
    std_scope: str = "group",
) -> Array:
    """Token advantages ``[B, T]`` (fp32) from unit rewards ``[B, K]``.

    Args:
      clause_rewards: ``[B, K]`` reward of each unit (clause), unit order = position order.
      clause_mask: ``[B, K]`` 1 for real units, 0 for padding. A masked unit in the middle of a row
        contributes reward 0 but still counts as one γ step.
      token_clause: ``[B, T]`` int, the unit each token belongs to; -1 (or any index outside
        ``[0, K)``) means "no unit" and gives advantage 0.
      token_mask: ``[B, T]`` 1 for tokens that are trained on.
      group_size: rows per group; consecutive rows form a group (static).
      gamma: discount per unit step of the return-to-go.
      eps: added to the std (may be traced).
      scale_by_std: divide by the std (True, GRPO) or only centre (False, Dr. GRPO).
      std_ddof: 0 (population std) or 1 (sample std, TRL's and tunix's) (static).
      std_scope: ``"group"`` (the group's units) or ``"batch"`` (every unit of the batch) for the std (static).
    """
    if clause_rewards.shape != clause_mask.shape or clause_rewards.ndim != 2:
        raise ValueError(f"clause_rewards {clause_rewards.shape} and clause_mask {clause_mask.shape} "
                         "must both be [B, K]")
    if token_clause.shape != token_mask.shape or token_clause.shape[0] != clause_rewards.shape[0]:
        raise ValueError(f"token_clause {token_clause.shape} and token_mask {token_mask.shape} must "
                         f"both be [B, T] with B = {clause_rewards.shape[0]}")
    if not jnp.issubdtype(token_clause.dtype, jnp.integer):
        raise TypeError(f"token_clause must be integer, got {token_clause.dtype}")
    normalised = normalise_group_rewards(
        clause_rewards, clause_mask, group_size, eps=eps, scale_by_std=scale_by_std, std_ddof=std_ddof,
        std_scope=std_scope)
    returns = discounted_return_to_go(normalised, gamma)
    units = clause_rewards.shape[1]
    in_range = (token_clause >= 0) & (token_clause < units)
    index = jnp.clip(token_clause, 0, units - 1)
    per_token = jnp.take_along_axis(returns, index, axis=1)
    return jnp.where(in_range & token_mask.astype(bool), per_token, 0.0)
