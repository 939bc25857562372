"""GRPO core: reward layouts, clause-level advantages, the clipped-surrogate loss (log-probs:
``caper_jax.policy.logprobs``; clause ends of a completion: ``caper_jax.policy.clause_ends``).

Pure functions on padded arrays (docs/grpo.md); the training loop wires them to the sampler and PRM.
"""
from caper_jax.rl.advantages import clause_advantages, discounted_return_to_go, normalise_group_rewards
from caper_jax.rl.losses import AGGREGATIONS, aggregate, grpo_loss
from caper_jax.rl.rewards import VARIANTS, RewardVariant, layout_rewards, register_variant, reward_variant

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
    "register_variant",
    "reward_variant",
]
