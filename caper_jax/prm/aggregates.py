"""The names of the PRM's rerankers, without the scorer: importing them does not import jax.

``AGGREGATES`` turn a query's clause scores into one number (``caper_jax.prm.scoring.aggregate``);
each also names a PRM-weighted vote, ``VOTE_PREFIX + aggregate`` (``scoring.weighted_vote``).
``SELECTORS`` is every reranker a report lists. The command lines (``caper_jax.verify``) offer
these as choices while parsing their arguments, before any model is loaded.
"""
from __future__ import annotations

AGGREGATES = ("min", "mean", "last")
VOTE_PREFIX = "vote_"
SELECTORS = AGGREGATES + tuple(VOTE_PREFIX + how for how in AGGREGATES)   # every PRM reranker, as reported
