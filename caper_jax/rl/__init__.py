"""GRPO core: reward layouts, clause-level advantages, the clipped-surrogate loss (log-probs:
``caper_jax.policy.logprobs``).

Pure functions on padded arrays (docs/grpo.md); the training loop wires them to the sampler and PRM.
"""
from caper_jax.rl.advantages import clause_advantages, discounted_return_to_go, normalise_group_rewards
from caper_jax.rl.losses import AGGREGATIONS, aggregate, grpo_loss
from caper_jax.rl.rewards import (VARIANTS, RewardVariant, layout_rewards, pad_clause_ends, register_variant,
                                  reward_variant, spans_to_token_ends)

__all__ = [
    "AGGREGATIONS",
    "RewardVariant",
    "VARIANTS",
    "aggregate",
    "clause_advantages",
    "discounted_return_to_go",
    "grpo_loss",
    "layout_rewards",
    "normalise_group_rewards",
    "pad_clause_ends",
    "register_variant",
    "reward_variant",
    "spans_to_token_ends",
]
