"""Evaluation: EX of predictions (``ex``), policy evaluation (``policy``, checked by ``config``),
the Clause-PRM as a verifier (``verify``: reranking and localisation), the policy-confidence
localisation baseline (``confidence``; the metrics and the other baselines are
``caper_jax.prm.localization``, the PRM's held-out evaluation ``caper_jax.prm.heldout``), reports
(``report``) and tables over world seeds (``world_seeds``). The command lines are
``caper_jax/evaluate.py`` and ``caper_jax/verify.py``."""
