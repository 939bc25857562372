"""Pairwise losses for the Clause-PRM.

CAPER trains the PRM on preference tuples (u+, u-) whose margin delta = r(u+) - r(u-) comes from the
propagated clause rewards, so a tuple at the root-cause clause (delta = alpha) matters more than one on
its decayed dependency path. Two ways of using delta, both pure functions of scores:

* ``"weighted"`` (the paper's margin-weighted Bradley-Terry): ``-w(delta) * log sigmoid(r+ - r-)``
  with ``w(delta) = delta / alpha`` (``margin_weight="linear"``, so the root-cause tuple has weight 1)
  or ``w = 1`` (``"none"``, plain Bradley-Terry).
* ``"offset"`` (TRL's RewardTrainer margin form): ``-log sigmoid(r+ - r- - scale * delta)``, which asks
  for a score gap of at least ``scale * delta`` instead of reweighting.

Optional reward centring (TRL's ``center_rewards_coefficient``) adds ``c * mean((r+ + r-)^2)`` so the
scores stay near zero: GRPO adds them to an execution reward, whose scale they should not drift from.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LOSS_FORMS = ("weighted", "offset")
MARGIN_WEIGHTS = ("linear", "none")


@dataclasses.dataclass(frozen=True)
class PairLossConfig:
    form: str = "weighted"
    margin_weight: str = "linear"
    # The annotator's root-cause penalty (configs' annotate.alpha), read here as the weight scale: delta / alpha
    # is in (0, 1]. One setting drives both, so the loss names it for where it comes from.
    annotation_alpha: float = 1.0
    offset_scale: float = 1.0
    center_coef: float = 0.0

    def __post_init__(self):
        if self.form not in LOSS_FORMS:
            raise ValueError(f"loss form {self.form!r} not in {LOSS_FORMS}")
        if self.margin_weight not in MARGIN_WEIGHTS:
            raise ValueError(f"margin_weight {self.margin_weight!r} not in {MARGIN_WEIGHTS}")
        if self.annotation_alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.annotation_alpha}")


def pairwise_loss(
    r_chosen: jax.Array,
    r_rejected: jax.Array,
    margin: jax.Array,
    weight: jax.Array,
    cfg: PairLossConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean pairwise loss over the rows with ``weight > 0`` (padding rows carry weight 0).

    Args:
      r_chosen, r_rejected: [B] scalar scores of u+ and u-.
      margin: [B] delta > 0 from the annotator.
      weight: [B] 1 for real rows, 0 for padding rows.
    Returns:
      (loss, metrics) with metrics ``accuracy`` (r+ > r-), ``margin_gap`` (mean r+ - r-).
    """
    r_chosen = r_chosen.astype(jnp.float32)
    r_rejected = r_rejected.astype(jnp.float32)
    margin = margin.astype(jnp.float32)
    weight = weight.astype(jnp.float32)
    gap = r_chosen - r_rejected
    if cfg.form == "weighted":
        per_row = -jax.nn.log_sigmoid(gap)
        if cfg.margin_weight == "linear":
            per_row = per_row * (margin / cfg.annotation_alpha)
    else:
        per_row = -jax.nn.log_sigmoid(gap - cfg.offset_scale * margin)
    n = jnp.maximum(weight.sum(), 1.0)
    loss = (per_row * weight).sum() / n
    if cfg.center_coef:
        loss = loss + cfg.center_coef * ((r_chosen + r_rejected) ** 2 * weight).sum() / n
    metrics = {
        "accuracy": ((gap > 0).astype(jnp.float32) * weight).sum() / n,
        "margin_gap": (gap * weight).sum() / n,
    }
    return loss, metrics


# -- auxiliary language-modelling term ----------------------------------------------------------
#
# The paper's PRM starts from a pretrained LLM that already maps questions to SQL; a randomly
# initialised backbone (the built-in demo) has to learn from preference pairs alone which column a
# question asks for. The chosen side of every aligned tuple is correct SQL (gold, the repaired
# prediction, whose clause rewards are 0, or a right prediction), so next-token prediction of its SQL
# tokens is free supervision of exactly that mapping, read from the same forward pass. A
# within-trajectory tuple's chosen side is a state of the wrong query itself (after its wrong root
# clause when it comes later): the batch's ``lm_weight`` leaves those rows out.


@dataclasses.dataclass(frozen=True)
class LmAuxConfig:
    coef: float = 0.0          # 0 disables the term (and XLA drops its computation)
    marker_id: int = -1        # the SQL starts after this token's last occurrence (<|im_start|>)
    chunk_size: int = 128      # sequence positions per chunk of the vocabulary projection

    def __post_init__(self):
        if self.coef < 0:
            raise ValueError(f"lm_coef must be >= 0, got {self.coef}")
        if self.coef and self.marker_id < 0:
            raise ValueError("lm_coef > 0 needs marker_id, the token the SQL follows")


def sql_target_mask(input_ids: jax.Array, attention_mask: jax.Array, last: jax.Array,
                    marker_id: int) -> jax.Array:
    """[B, T-1] bool: position t predicts token t+1, and token t+1 is SQL to learn.

    SQL tokens are the real tokens after the row's last ``marker_id`` (the assistant turn's
    ``<|im_start|>``: its role line ``assistant``, then the SQL), up to and including index ``last``
    [B] (the scored clause's last token);
    the marker itself is not a target. A row without the marker (its prompt truncated away) counts
    every token up to ``last``.
    """
    seen = jnp.cumsum(input_ids == marker_id, axis=1)
    after_marker = (seen == seen[:, -1:]) & (input_ids != marker_id)
    index = jnp.arange(input_ids.shape[1])[None]
    target = after_marker & (index <= last[:, None]) & attention_mask.astype(bool)
    return target[:, 1:]


def lm_nll(logp: jax.Array, target_mask: jax.Array, weight: jax.Array) -> jax.Array:
    """Mean negative log-likelihood over target tokens of rows with ``weight > 0`` (0 if none)."""
    mask = target_mask & (weight[:, None] > 0)
    return -jnp.where(mask, logp, 0.0).sum() / jnp.maximum(mask.sum(), 1)
