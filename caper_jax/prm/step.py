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
from flax import nnx

from caper_jax.prm.loss import LmAuxConfig, PairLossConfig, lm_nll, pairwise_loss, sql_target_mask
from caper_jax.policy.logprobs import token_logprobs
from caper_jax.utils.optim import TrainState, guarded_update


def _rows(batch: dict, field: str, *more: jax.Array) -> jax.Array:
    """The chosen rows, then the rejected rows (then ``more``) of one batch field, as one array."""
    return jnp.concatenate([batch[f"chosen_{field}"], batch[f"rejected_{field}"], *more])


def _pair_scores(graphdef, params, batch):
    scores = nnx.merge(graphdef, params)(_rows(batch, "ids"), _rows(batch, "mask"), _rows(batch, "pos"))
    n = batch["chosen_ids"].shape[0]
    return scores[:n], scores[n:]


def _all_pairs(model, batch):
    """((r_chosen, r_rejected, margin, weight) of every pair of a training batch, chosen hidden states).

    One forward pass. Without ``group_*`` keys the pairs are the tuple rows. With them
    (``prm_pipeline(within_batch_size>0)``) the group rows join the same forward pass and each group
    contributes its within-trajectory pairs, slot k > 0 (chosen) against slot 0 (the root state),
    with the margins ``group_margin[:, k]``; empty slots (margin 0) and padding groups get weight 0.
    The chosen rows' backbone states [n, T, H] come back for the auxiliary LM term (unused ones are
    dropped by XLA).
    """
    n = batch["chosen_ids"].shape[0]
    if "group_ids" not in batch:
        hidden = model.backbone.hidden_states(_rows(batch, "ids"), _rows(batch, "mask"))
        scores = model.scores_at(hidden, _rows(batch, "pos"))
        return (scores[:n], scores[n:], batch["margin"], batch["weight"]), hidden[:n]
    slots = batch["group_pos"].shape[1]
    pair_pos = _rows(batch, "pos")[:, None]         # one scored position per pair row, padded to K slots
    pair_pos = jnp.concatenate([pair_pos, jnp.full((2 * n, slots - 1), -1, pair_pos.dtype)], axis=1)
    hidden = model.backbone.hidden_states(_rows(batch, "ids", batch["group_ids"]),
                                          _rows(batch, "mask", batch["group_mask"]))
    scores = model.scores_at(hidden, jnp.concatenate([pair_pos, batch["group_pos"]]))     # [2n + G, K]
    group = scores[2 * n:]
    margin = batch["group_margin"][:, 1:]
    group_weight = batch["group_weight"][:, None] * (margin > 0)
    pairs = (jnp.concatenate([scores[:n, 0], group[:, 1:].reshape(-1)]),
             jnp.concatenate([scores[n:2 * n, 0], jnp.broadcast_to(group[:, :1], margin.shape).reshape(-1)]),
             jnp.concatenate([batch["margin"], margin.reshape(-1)]),
             jnp.concatenate([batch["weight"], group_weight.reshape(-1)]))
    return pairs, hidden[:n]


def _chosen_sql_nll(model, hidden, batch, lm_cfg: LmAuxConfig) -> jax.Array:
    """Next-token NLL of the chosen rows' SQL (the auxiliary LM term, ``caper_jax.prm.loss``)."""
    ids = batch["chosen_ids"]
    # The PRM backbone always ties its head to the input embedding (prm.model.backbone_config).
    logp = token_logprobs(hidden[:, :-1], model.backbone.embed_tokens[...], ids[:, 1:], lm_cfg.chunk_size,
                          tied=True)
    target = sql_target_mask(ids, batch["chosen_mask"], batch["chosen_pos"], lm_cfg.marker_id)
    return lm_nll(logp, target, batch["weight"] * batch["lm_weight"])   # lm_weight: 0 for a wrong query's state


def train_step(state: TrainState, batch: dict, *, graphdef, tx: optax.GradientTransformation,
               loss_cfg: PairLossConfig, lm_cfg: LmAuxConfig = LmAuxConfig()) -> tuple[TrainState, dict]:
    def loss_fn(params):
        model = nnx.merge(graphdef, params)
        pairs, chosen_hidden = _all_pairs(model, batch)
        loss, metrics = pairwise_loss(*pairs, loss_cfg)
        if lm_cfg.coef:
            nll = _chosen_sql_nll(model, chosen_hidden, batch, lm_cfg)
            loss = loss + lm_cfg.coef * nll
            metrics = {**metrics, "lm_nll": nll}
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state, guard = guarded_update(state, loss, grads, tx)
    return new_state, {**guard, **metrics}


def eval_scores(params: Any, batch: dict, *, graphdef) -> tuple[jax.Array, jax.Array]:
    """(r_chosen, r_rejected) for a batch of tuples."""
    return _pair_scores(graphdef, params, batch)


def clause_scores(params: Any, input_ids: jax.Array, attention_mask: jax.Array, clause_pos: jax.Array,
                  *, graphdef) -> jax.Array:
    """[B, K] scores of every clause of each query (one forward per query; -1 positions give 0)."""
    return nnx.merge(graphdef, params)(input_ids, attention_mask, clause_pos)


def jit_steps(graphdef, tx, loss_cfg, state_sharding=None, lm_cfg: LmAuxConfig = LmAuxConfig()):
    """The jitted (train_step, eval_scores, clause_scores) with the state donated to train_step."""
    train = jax.jit(functools.partial(train_step, graphdef=graphdef, tx=tx, loss_cfg=loss_cfg, lm_cfg=lm_cfg),
                    donate_argnums=0,
                    out_shardings=None if state_sharding is None else (state_sharding, None))
    evals = jax.jit(functools.partial(eval_scores, graphdef=graphdef))
    clauses = jax.jit(functools.partial(clause_scores, graphdef=graphdef))
    return train, evals, clauses
