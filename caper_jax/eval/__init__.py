"""Evaluation: EX of predictions (``ex``), policy evaluation (``policy``, checked by ``config``),
the Clause-PRM as a verifier (``verify``: reranking and localisation), localisation metrics and
baselines (``localization``, ``confidence``), the PRM's held-out evaluation (``prm_heldout``),
reports (``report``) and tables over world seeds (``world_seeds``). The command lines are
``caper_jax/evaluate.py`` and ``caper_jax/verify.py``."""
