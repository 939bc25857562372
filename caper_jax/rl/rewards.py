"""Reward layouts of the three GRPO variants, in one code path.

A layout turns per-token PRM scores and execution rewards into *units*: each unit ends at one token,
owns the tokens from just after the previous unit's end up to its own end, and carries one reward.
The three variants differ only in where units end and whether the PRM score enters the reward:

| variant  | unit ends                        | unit reward                                        |
|----------|----------------------------------|----------------------------------------------------|
| `sparse` | the last completion token        | execution reward                                   |
| `clause` | each clause's last token (CAPER) | PRM score there (+ execution reward on the last)   |
| `token`  | every completion token           | PRM score there (+ execution reward on the last)   |

A causal PRM scores every prefix in one forward pass, so ``prm_scores[b, t]`` is the score of the
completion up to and including token ``t`` and a unit's PRM reward is a gather at its end.

A completion that does not parse falls back to a single unit ending at its last token with the
execution-failure reward minus the format penalty, and no PRM reward: the PRM was trained on
well-formed clauses and its score on broken SQL means nothing. A parsed completion none of whose clause
ends lies inside the completion gets the same single unit, with its own execution reward.
Tokens after the last unit end (e.g. a trailing ``;`` or EOS) belong to the last unit.

Unit ends are sorted and de-duplicated inside the layout (two clauses that end inside the same token
share one PRM score; the later duplicate is dropped), so the output has no holes: units ``0..n-1``
are valid and ``n..K-1`` are padding, which is what the return-to-go in ``clause_advantages`` expects.

The variants are a registry (``register_variant``): each is a function with one signature, from
``(clause_ends [B, K], token_mask [B, T] bool)`` to where its units end, ``(ends [B, U] int32, valid
[B, U] bool)``, registered under its name with whether the PRM score enters its rewards. ``VARIANTS``
(what the GRPO trainer's config accepts) is the registry's names; everything after the unit ends
(fallback, sorting, rewards, token ownership) is shared.

The clause ends come from the policy's side (``caper_jax.policy.clause_ends``: character spans of
``split_clauses`` to token positions, padded into ``[B, K]``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
UnitEnds = Callable[[Array, Array], tuple[Array, Array]]  # (clause_ends, token_mask) -> (ends, valid)


def _last_token(token_mask: Array) -> Array:
    """Index of each row's last masked token, -1 for an empty row."""
    positions = jnp.arange(token_mask.shape[1], dtype=jnp.int32)
    return jnp.max(jnp.where(token_mask, positions, -1), axis=1)


def _sorted_unique_ends(ends: Array, valid: Array, sentinel: int) -> tuple[Array, Array]:
    """Sorts each row's valid ends to the front and drops repeated positions."""
    ends = jnp.sort(jnp.where(valid, ends, sentinel), axis=1)
    repeated = jnp.concatenate([jnp.zeros_like(ends[:, :1], dtype=bool), ends[:, 1:] == ends[:, :-1]],
                               axis=1)
    ends = jnp.sort(jnp.where(repeated, sentinel, ends), axis=1)
    return ends, ends < sentinel


@dataclasses.dataclass(frozen=True)
class RewardVariant:
    name: str
    unit_ends: UnitEnds  # where the units of each row end, before the unparsed-row fallback
    uses_prm: bool       # the PRM score enters the unit rewards (so training needs a PRM run)


_REGISTRY: dict[str, RewardVariant] = {}


def register_variant(name: str, *, uses_prm: bool) -> Callable[[UnitEnds], UnitEnds]:
    """Decorator: registers a unit-ends function as the reward variant ``name``."""
    def register(unit_ends: UnitEnds) -> UnitEnds:
        if name in _REGISTRY:
            raise ValueError(f"reward variant {name!r} is already registered")
        _REGISTRY[name] = RewardVariant(name, unit_ends, uses_prm)
        return unit_ends
    return register


def reward_variant(name: str) -> RewardVariant:
    """The registered variant ``name``; ValueError naming the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reward variant {name!r}; expected one of {tuple(_REGISTRY)}") from None


@register_variant("sparse", uses_prm=False)
def _sparse_unit_ends(clause_ends: Array, token_mask: Array) -> tuple[Array, Array]:
    """One unit, ending at the last completion token (outcome-supervised GRPO)."""
    last = _last_token(token_mask)
    return last[:, None], (last >= 0)[:, None]


@register_variant("clause", uses_prm=True)
def _clause_unit_ends(clause_ends: Array, token_mask: Array) -> tuple[Array, Array]:
    """A unit per clause, ending at its last token; ends outside the completion are dropped (CAPER)."""
    length = token_mask.shape[1]
    ends = clause_ends.astype(jnp.int32)
    in_range = (ends >= 0) & (ends < length)
    return ends, in_range & jnp.take_along_axis(token_mask, jnp.clip(ends, 0, length - 1), axis=1)


@register_variant("token", uses_prm=True)
def _token_unit_ends(clause_ends: Array, token_mask: Array) -> tuple[Array, Array]:
    """A unit per completion token."""
    batch, length = token_mask.shape
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)), token_mask


VARIANTS: tuple[str, ...] = tuple(_REGISTRY)


@functools.partial(jax.jit, static_argnames=("variant",))
def layout_rewards(
    variant: str,
    prm_scores: Array,
    clause_ends: Array,
    exec_rewards: Array,
    token_mask: Array,
    parse_ok: Array,
    *,
    prm_weight: float | Array = 1.0,
    exec_failure_reward: float | Array = 0.0,
    format_penalty: float | Array = 0.0,
) -> tuple[Array, Array, Array]:
    """Unit rewards for ``clause_advantages``.

    Args:
      variant: a registered variant's name, ``"sparse"``, ``"clause"`` or ``"token"`` (static).
      prm_scores: ``[B, T]`` PRM score of the prefix ending at each token.
      clause_ends: ``[B, K]`` int token index of each clause's last token, -1 for padding. Ignored by
        ``sparse`` and ``token``. Ends outside the completion (token_mask 0) are dropped.
      exec_rewards: ``[B]`` execution reward of each completion.
      token_mask: ``[B, T]`` 1 on completion tokens.
      parse_ok: ``[B]`` bool, the completion parsed into clauses.
      prm_weight: scale of the PRM score relative to the execution reward.
      exec_failure_reward: the reward that replaces ``exec_rewards`` for completions that do not parse.
      format_penalty: subtracted from that reward for completions that do not parse (>= 0).

    Returns:
      ``(clause_rewards [B, U] fp32, clause_mask [B, U] bool, token_clause [B, T] int32)`` with
      ``U = 1`` (sparse), ``K`` (clause) or ``T`` (token); ``token_clause`` is -1 off the completion.
    """
    spec = reward_variant(variant)
    batch, length = token_mask.shape
    if prm_scores.shape != (batch, length):
        raise ValueError(f"prm_scores {prm_scores.shape} must match token_mask {token_mask.shape}")
    if clause_ends.ndim != 2 or clause_ends.shape[0] != batch:
        raise ValueError(f"clause_ends {clause_ends.shape} must be [B={batch}, K]")
    if exec_rewards.shape != (batch,) or parse_ok.shape != (batch,):
        raise ValueError(f"exec_rewards {exec_rewards.shape} and parse_ok {parse_ok.shape} must be [B]")

    token_mask = token_mask.astype(bool)
    parse_ok = parse_ok.astype(bool)
    last = _last_token(token_mask)
    positions = jnp.arange(length, dtype=jnp.int32)
    ends, valid = spec.unit_ends(clause_ends, token_mask)  # the one step in which variants differ

    # Rows that cannot be scored clause by clause fall back to one unit at their last token.
    structured = parse_ok & valid.any(axis=1)
    single = jnp.zeros_like(ends).at[:, 0].set(last)
    single_valid = jnp.zeros_like(valid).at[:, 0].set(last >= 0)
    ends = jnp.where(structured[:, None], ends, single)
    valid = jnp.where(structured[:, None], valid, single_valid)
    ends, valid = _sorted_unique_ends(ends, valid, sentinel=length)

    use_prm = float(spec.uses_prm)
    prm_at_end = jnp.take_along_axis(
        prm_scores.astype(jnp.float32), jnp.clip(ends, 0, length - 1), axis=1)
    prm_gain = jnp.where(structured, jnp.asarray(prm_weight, jnp.float32), 0.0) * use_prm
    outcome = jnp.where(parse_ok, exec_rewards.astype(jnp.float32),
                        jnp.asarray(exec_failure_reward, jnp.float32) - format_penalty)
    units = valid.sum(axis=1)
    is_last = jnp.arange(ends.shape[1]) == (units - 1)[:, None]
    clause_rewards = jnp.where(valid, prm_gain[:, None] * prm_at_end + is_last * outcome[:, None], 0.0)

    # Unit of token t = the first unit ending at or after t; tokens past the last end join the last unit.
    first_end_at_or_after = jax.vmap(functools.partial(jnp.searchsorted, side="left"), in_axes=(0, None))
    owner = first_end_at_or_after(ends, positions)
    owner = jnp.minimum(owner, units[:, None] - 1).astype(jnp.int32)
    token_clause = jnp.where(token_mask & (units[:, None] > 0), owner, -1)
    return clause_rewards, valid, token_clause
