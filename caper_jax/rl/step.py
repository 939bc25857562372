"""The jitted programs of one GRPO step: pure functions of (state | params, batch).

``caper_jax.rl.trainer`` runs them in the order its docstring lists; ``caper_jax.rl.dry_run``
compiles the same programs on abstract shapes. ``update_step`` refuses (keeps the state) a non-finite
loss or gradient inside the jitted function, as the PRM and SFT steps do.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from caper_jax import loop
from caper_jax.policy.logprobs import completion_logprobs
from caper_jax.rl.advantages import clause_advantages
from caper_jax.rl.losses import grpo_loss
from caper_jax.rl.rewards import layout_rewards
from caper_jax.utils.optim import TrainState, guarded_update


def updates_per_step(settings) -> int:
    """Optimizer updates per GRPO step, ``update_step`` once per minibatch of every epoch over the step's
    rollouts: what ``make_optimizer`` needs so that its schedule counts steps, not updates."""
    return settings.rl.update_epochs * settings.rl.num_minibatches


def update_step(state: TrainState, batch: dict, *, graphdef, tx: optax.GradientTransformation, beta: float,
                agg: str, eps_low: float, eps_high: float, temperature: float, chunk_size: int,
                kl_bias_correction: bool, with_entropy: bool = True,
                tis_cap: float = 0.0) -> tuple[TrainState, dict]:
    """One GRPO optimizer step on a minibatch; refuses (keeps the state) on a non-finite loss/gradient.

    ``rl.recompute_old_logp``: the batch carries ``old_from_self`` [B] (bool). Where it is set, the old
    log-probs are this update's own (stop-gradient) log-probs, not ``batch["old_logp"]``: the ratio is then
    exactly 1, whatever the sampler reported, and the returned metrics carry ``logp`` [B, N] (the policy's
    log-probs at the parameters before this update: the old log-probs of the rollout's later updates). They
    come from this program itself because another program's forward rounds differently under bf16 compute
    (docs/grpo.md, "Sampler/trainer mismatch").
    ``tis_cap`` > 0: the batch also carries ``sampler_logp`` and the policy term is weighted by the
    truncated importance weight ``grpo_loss`` describes (old log-probs over the sampler's).

    ``with_entropy``: also compute the policy's entropy, a metric only (no term of the loss), so the
    trainer asks for it on logging steps alone: off, the program has no entropy in it (one
    ``[B, chunk, V]`` product and reduction per chunk fewer, forward and backward)."""
    completion_len = batch["completion_mask"].shape[1]

    def loss_fn(params):
        out = completion_logprobs(params, batch["input_ids"], batch["attention_mask"], graphdef=graphdef,
                                  completion_len=completion_len, temperature=temperature,
                                  chunk_size=chunk_size, return_entropy=with_entropy)
        logp, entropy = out if with_entropy else (out, None)
        old_logp = batch["old_logp"]
        if "old_from_self" in batch:
            old_logp = jnp.where(batch["old_from_self"][:, None], jax.lax.stop_gradient(logp), old_logp)
        loss, metrics = grpo_loss(logp, old_logp, batch.get("ref_logp"), batch["advantages"],
                                  batch["completion_mask"], eps_low=eps_low, eps_high=eps_high, beta=beta, agg=agg,
                                  entropy=entropy, kl_bias_correction=kl_bias_correction,
                                  sampler_logp=batch.get("sampler_logp"), tis_cap=tis_cap or None)
        if "old_from_self" in batch:
            metrics = {**metrics, "logp": jax.lax.stop_gradient(logp)}
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state, guard = guarded_update(state, loss, grads, tx, advance_step=False)   # run() counts outer steps
    return new_state, {**guard, **metrics}


def jit_update(graphdef, tx, settings, state_sharding=None, *, with_entropy: bool = True):
    """The jitted update for ``settings`` (``GrpoSettings``; state donated), cached per process
    (``loop.jit_state_step``); ``with_entropy`` as ``update_step``'s (the trainer holds both: logging steps
    and the others)."""
    update = functools.partial(
        update_step, graphdef=graphdef, tx=tx, beta=settings.rl.beta, agg=settings.rl.agg,
        eps_low=settings.rl.eps_low, eps_high=settings.rl.eps_high,
        temperature=settings.sampling.temperature, chunk_size=settings.chunk_size,
        kl_bias_correction=settings.rl.kl_bias_correction, with_entropy=with_entropy,
        tis_cap=float(settings.rl.tis_cap))
    # The frozen optim and rl sections are the key: everything tx and the update were made from.
    key = ("grpo", graphdef, settings.optim, settings.rl, settings.sampling.temperature, settings.chunk_size,
           with_entropy)
    return loop.jit_state_step(update, key, state_sharding)


@functools.partial(jax.jit, static_argnames=("graphdef", "completion_len", "temperature", "chunk_size"))
def jit_completion_logprobs(params, input_ids, attention_mask, *, graphdef, completion_len: int,
                            temperature: float, chunk_size: int):
    """Jitted ``completion_logprobs`` (reference policy), compiled once per process and shape."""
    return completion_logprobs(params, input_ids, attention_mask, graphdef=graphdef, completion_len=completion_len,
                               temperature=temperature, chunk_size=chunk_size)


@jax.jit
def logp_mismatch(trainer_logp, sampler_logp, completion_mask) -> dict:
    """Mean and max ``|trainer_logp - sampler_logp|`` over the completion tokens: how far the sampler's
    log-probs are from the trainer's for the same tokens and parameters."""
    mask = completion_mask.astype(bool)
    delta = jnp.where(mask, jnp.abs(trainer_logp - sampler_logp), 0.0)
    return {"logp_mismatch_mean": delta.sum() / jnp.maximum(mask.sum(), 1), "logp_mismatch_max": delta.max()}


@functools.partial(jax.jit, static_argnames=("graphdef", "last"))
def prm_token_scores(params, input_ids, attention_mask, *, graphdef, last: int | None = None):
    """The frozen Clause-PRM's per-prefix scores in one forward: ``[B, T]``, or ``[B, last]`` for the last
    ``last`` positions (the completion's: only those meet the score head)."""
    return nnx.merge(graphdef, params).token_scores(input_ids, attention_mask, last)


@functools.partial(jax.jit, static_argnames=("variant", "group_size", "scale_by_std", "std_ddof", "std_scope"))
def advantages_from_rewards(prm_scores, clause_ends, exec_rewards, completion_mask, parse_ok, *, variant: str,
                            group_size: int, gamma: float, prm_weight: float, exec_failure_reward: float,
                            format_penalty: float, scale_by_std: bool, std_ddof: int, std_eps: float,
                            std_scope: str) -> tuple[jax.Array, dict]:
    """``layout_rewards(variant)`` -> ``clause_advantages``: token advantages [B, N] and unit statistics."""
    rewards, unit_mask, token_unit = layout_rewards(
        variant, prm_scores, clause_ends, exec_rewards, completion_mask, parse_ok, prm_weight=prm_weight,
        exec_failure_reward=exec_failure_reward, format_penalty=format_penalty)
    adv = clause_advantages(rewards, unit_mask, token_unit, completion_mask, group_size, gamma, eps=std_eps,
                            scale_by_std=scale_by_std, std_ddof=std_ddof, std_scope=std_scope)
    valid = unit_mask.astype(jnp.float32)
    count = jnp.maximum(valid.sum(), 1.0)
    mean = (rewards * valid).sum() / count
    grouped = exec_rewards.reshape(-1, group_size)
    stats = {
        "unit_reward_mean": mean,
        "unit_reward_std": jnp.sqrt((((rewards - mean) * valid) ** 2).sum() / count),
        "units_per_sample": valid.sum(axis=1).mean(),
        "groups_with_exec_signal": (grouped.max(axis=1) > grouped.min(axis=1)).mean(),
        "abs_advantage": jnp.abs(adv).sum() / jnp.maximum(completion_mask.sum(), 1),
    }
    return adv, stats
