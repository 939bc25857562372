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
    alpha: float = 1.0          # the annotator's root-cause penalty; delta / alpha is in (0, 1]
    offset_scale: float = 1.0
    center_coef: float = 0.0

    def __post_init__(self):
        if self.form not in LOSS_FORMS:
            raise ValueError(f"loss form {self.form!r} not in {LOSS_FORMS}")
        if self.margin_weight not in MARGIN_WEIGHTS:
            raise ValueError(f"margin_weight {self.margin_weight!r} not in {MARGIN_WEIGHTS}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")


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
            per_row = per_row * (margin / cfg.alpha)
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
