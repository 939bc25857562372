"""GRPO clipped-surrogate loss with asymmetric clipping, k3 KL to a reference (optionally TRL's
bias-corrected ρ·k3), and four aggregations, each equal to one of TRL 1.16's ``loss_type`` and of
tunix 0.1.7's ``loss_agg_mode`` when every row has a token (measured: ``bench/peer_grpo.py``).

Per token (ratio ρ = exp(logp - old_logp), advantage A):

    policy = -min(ρ·A, clip(ρ, 1 - ε_low, 1 + ε_high)·A)    (DAPO clip-higher when ε_high > ε_low)
    kl_ref = exp(ref - logp) - (ref - logp) - 1               (k3 estimator of KL(π_θ ‖ π_ref))
    loss   = policy + β·kl_ref                                (the KL term is skipped when β = 0)

``kl_bias_correction`` uses ρ·kl_ref instead (TRL's ``use_bias_correction_kl``, its default).

With truncated importance sampling (``tis_cap``) the policy term is first multiplied by the constant
w = min(exp(old_logp - sampler_logp), tis_cap): the trainer's own recomputed old log-prob over the
sampler's, which corrects for the sampler's numerics (docs/grpo.md, "Sampler/trainer mismatch").

The per-token loss is reduced over the completion mask m by ``agg``:

    agg                           formula                     TRL loss_type     tunix loss_agg_mode
    token-mean                    Σ_it L / Σ_it m             bnpo, dapo        token-mean
    sequence-mean-token-mean      mean_i Σ_t L_it / Σ_t m_it  grpo              sequence-mean-token-mean
    sequence-mean-token-sum       mean_i Σ_t L_it             luspo (token IS)  seq-mean-token-sum, and
                                                                                sequence-mean-token-sum-norm
    sequence-mean-token-sum-norm  Σ_it L / (B · norm_len)     dr_grpo           sequence-mean-token-scale

"mean_i" runs over rows with at least one masked token (tunix's means do the same; TRL's grpo and luspo
count a fully masked row as a 0 in a mean over all B rows); ``norm_len`` defaults to the padded length T
(Dr. GRPO's MAX_TOKENS; TRL's max_completion_length), a constant, so no completion's length changes its
tokens' weight; tunix's sequence-mean-token-scale divides by (non-empty rows · T) instead of B · T.
tunix's own "sequence-mean-token-sum-norm" (its default normaliser: the non-empty rows) is this module's
sequence-mean-token-sum, not its namesake. TRL's dapo divides by the tokens of its whole generation
batch (all processes and accumulation steps, rescaled to one micro-batch), bnpo by the local
micro-batch's; this loss sees the whole (global) minibatch, so both equal token-mean on one process
without accumulation, the case measured. Padding is removed with ``where``
before anything is computed, so NaN or inf log-probs at masked positions leave the loss and gradient
finite; TRL and tunix multiply by the mask and return NaN. docs/grpo.md, "TRL and tunix".

Metrics are masked token means regardless of ``agg`` (diagnostics, not the objective).
Everything is computed in fp32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array

AGGREGATIONS: tuple[str, ...] = (
    "token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum", "sequence-mean-token-sum-norm")


def aggregate(per_token: Array, mask: Array, agg: str, norm_len: int | None = None) -> Array:
    """Reduces a ``[B, T]`` per-token loss to a scalar by one of ``AGGREGATIONS``."""
    valid = mask.astype(bool)
    masked = jnp.where(valid, per_token, 0.0)
    mask = valid.astype(jnp.float32)
    row_tokens = mask.sum(axis=1)
    rows = jnp.maximum((row_tokens > 0).sum(), 1)
    if agg == "token-mean":
        return masked.sum() / jnp.maximum(mask.sum(), 1.0)
    if agg == "sequence-mean-token-mean":
        return (masked.sum(axis=1) / jnp.maximum(row_tokens, 1.0)).sum() / rows
    if agg == "sequence-mean-token-sum":
        return masked.sum() / rows
    if agg == "sequence-mean-token-sum-norm":
        length = per_token.shape[1] if norm_len is None else norm_len
        return masked.sum() / (per_token.shape[0] * length)
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGGREGATIONS}")


def _token_mean(values: Array, mask: Array) -> Array:
    return jnp.where(mask, values, 0.0).sum() / jnp.maximum(mask.sum(), 1)


@functools.partial(jax.jit, static_argnames=("beta", "agg", "norm_len", "kl_bias_correction", "tis_cap"))
def grpo_loss(
    logp: Array,
    old_logp: Array | None,
    ref_logp: Array | None,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float | Array = 0.2,
    eps_high: float | Array = 0.28,
    beta: float = 0.04,
    agg: str = "token-mean",
    entropy: Array | None = None,
    norm_len: int | None = None,
    kl_bias_correction: bool = False,
    sampler_logp: Array | None = None,
    tis_cap: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """GRPO loss and metrics; all array arguments are ``[B, T]``.

    Args:
      logp: log-probs of the sampled tokens under the policy being trained (differentiated).
      old_logp: log-probs under the policy that sampled them (treated as constants); None when the
        batch is used for a single update right after sampling, where old = stop_gradient(logp)
        (ratio 1, saves a forward pass).
      ref_logp: log-probs under the reference policy; may be None when ``beta == 0``.
      advantages: token advantages (e.g. ``clause_advantages``), treated as constants.
      mask: 1 on completion tokens.
      eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` of the ratio.
      beta: weight of the k3 KL to the reference (static; 0 skips the term).
      agg: one of ``AGGREGATIONS`` (static).
      entropy: optional ``[B, T]`` policy entropy, reported as a metric.
      norm_len: normaliser of ``sequence-mean-token-sum-norm`` (static; default T).
      kl_bias_correction: multiply the k3 term by the ratio ρ (static; TRL's ``use_bias_correction_kl``):
        importance-weights the KL estimate from samples of π_old to π_θ; ρ carries gradient, so even at
        ρ = 1 the gradient changes (by β·k3·∇logp per token).
      sampler_logp: log-probs the sampler reported for the same tokens (constants); read only when
        ``tis_cap`` is set.
      tis_cap: truncated importance sampling (static; None or 0 = off): the policy term of each token is
        multiplied by ``w = min(exp(old_logp - sampler_logp), tis_cap)``, a constant, which corrects for
        the sampler's numerics differing from the trainer's when ``old_logp`` is the trainer's own
        recomputation (verl's ``rollout_is`` token/truncate, TRL's ``vllm_importance_sampling_correction``
        token_truncate). The KL term is not weighted.

    Returns:
      ``(loss, metrics)``; metrics: ``policy_loss``, ``clip_frac_low`` (ρ < 1-ε_low with A < 0, where
      the clip zeroes the gradient), ``clip_frac_high`` (ρ > 1+ε_high with A > 0), ``approx_kl``
      (k3 estimate of KL(π_old ‖ π_θ)), ``ratio_mean``, ``ratio_min``, ``ratio_max``, and ``kl_ref`` when
      β > 0 (the KL term as it enters the loss: ρ·k3 with ``kl_bias_correction``, as TRL logs it),
      ``entropy`` when given, ``tis_weight_mean`` (the mean w) and ``tis_capped_frac`` (tokens whose
      exp(old_logp - sampler_logp) exceeds the cap) when ``tis_cap`` is set.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGGREGATIONS}")
    if old_logp is None:
        old_logp = jax.lax.stop_gradient(logp)
    shapes = {"logp": logp.shape, "old_logp": old_logp.shape, "advantages": advantages.shape,
              "mask": mask.shape}
    if ref_logp is not None:
        shapes["ref_logp"] = ref_logp.shape
    if entropy is not None:
        shapes["entropy"] = entropy.shape
    if len(set(shapes.values())) != 1 or logp.ndim != 2:
        raise ValueError(f"all inputs must share one [B, T] shape, got {shapes}")
    if beta != 0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    if tis_cap and (sampler_logp is None or sampler_logp.shape != logp.shape):
        raise ValueError(f"tis_cap={tis_cap} needs sampler_logp of logp's shape {logp.shape}")

    mask = mask.astype(bool)

    def on_tokens(values: Array) -> Array:
        # Padding may hold garbage (an out-of-vocabulary target gives logp NaN); a `where` on the
        # inputs keeps it out of both the loss and the gradient (x * 0 would give NaN * 0 = NaN).
        return jnp.where(mask, values.astype(jnp.float32), 0.0)

    logp = on_tokens(logp)
    old_logp = jax.lax.stop_gradient(on_tokens(old_logp))
    advantages = jax.lax.stop_gradient(on_tokens(advantages))

    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    policy = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    if tis_cap:
        trainer_over_sampler = jnp.exp(old_logp - jax.lax.stop_gradient(on_tokens(sampler_logp)))
        tis_weight = jnp.minimum(trainer_over_sampler, tis_cap)
        policy = policy * tis_weight
    per_token = policy

    metrics = {
        "policy_loss": aggregate(policy, mask, agg, norm_len),
        "clip_frac_low": _token_mean((ratio < 1.0 - eps_low) & (advantages < 0), mask),
        "clip_frac_high": _token_mean((ratio > 1.0 + eps_high) & (advantages > 0), mask),
        "approx_kl": _token_mean(ratio - 1.0 - log_ratio, mask),
        "ratio_mean": _token_mean(ratio, mask),
        "ratio_min": jnp.where(mask.any(), jnp.where(mask, ratio, jnp.inf).min(), 1.0),
        "ratio_max": jnp.where(mask.any(), jnp.where(mask, ratio, -jnp.inf).max(), 1.0),
    }
    if tis_cap:
        metrics["tis_weight_mean"] = _token_mean(tis_weight, mask)
        metrics["tis_capped_frac"] = _token_mean(trainer_over_sampler > tis_cap, mask)
    if beta != 0:
        ref_minus_policy = jax.lax.stop_gradient(on_tokens(ref_logp)) - logp
        kl_ref = jnp.exp(ref_minus_policy) - ref_minus_policy - 1.0
        if kl_bias_correction:
            kl_ref = kl_ref * ratio
        per_token = per_token + beta * kl_ref
        metrics["kl_ref"] = _token_mean(kl_ref, mask)
    if entropy is not None:
        metrics["entropy"] = _token_mean(on_tokens(entropy), mask)
    metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
    return aggregate(per_token, mask, agg, norm_len), metrics
