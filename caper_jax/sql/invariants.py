"""What every preference tuple must satisfy, checked on each tuple the annotator emits.

A tuple says "after ``prefix_chosen``, the clause ``chosen`` is better than ``rejected`` after
``prefix_rejected``". It can only teach the truth if both states are states a policy could have
been in while writing the two queries, and if the preference points the right way. The checks,
as small named rules (the first that fails is the reason a tuple is dropped):

``rejected_not_a_state``
    ``prefix_rejected + rejected`` is a prefix of the negative query as written, cut at a clause
    boundary: ending with ``END_OF_SQL`` exactly when nothing but a final ``;`` follows it.
``chosen_not_a_state``
    the same for ``prefix_chosen + chosen`` and the positive query (gold, the repaired query, or
    for a within-trajectory pair the negative itself).
``same_state``
    chosen and rejected are the same text after the same prefix (nothing to prefer).
``equal_clause_texts``
    the two clause texts (each with its end marker, if any) are equal after different prefixes: the pair only says "this prefix
    was wrong", which the pair at the clause that made it wrong says already; such pairs come from
    reference edges, and they contradict the within-trajectory pairs, which rate the clauses after
    an error as fine.
``root_on_chosen_side``
    a within-trajectory pair whose chosen clause is the clause holding v*, the negative's own
    error: the pair would teach that the error is better than another clause.
``margin_out_of_range``
    the margin is not in (0, alpha].

The annotator drops a tuple that breaks one and counts it by reason (``AnnotationSummary``); none
is kept silently.
"""
from __future__ import annotations

import math

from caper_jax.sql.contract import END_OF_SQL

REASONS = ("rejected_not_a_state", "chosen_not_a_state", "same_state", "equal_clause_texts",
           "root_on_chosen_side", "margin_out_of_range")


def is_state_of(sql: str, prefix: str, clause: str) -> bool:
    """``prefix + clause`` is a clause state of ``sql``: a prefix of it, with ``END_OF_SQL`` on the
    clause exactly when the query ends there (whitespace and a final ``;`` aside)."""
    ended = clause.endswith(END_OF_SQL)
    text = prefix + (clause[:-len(END_OF_SQL)] if ended else clause)
    if not clause.strip() or not sql.startswith(text):
        return False
    rest = sql[len(text):].strip().rstrip(";").strip()
    return (rest == "") == ended


def violation(t, *, positive_sql: str, alpha: float, within: bool,
              root_state: tuple[str, str] | None = None) -> str | None:
    """The first rule ``t`` (a ``PreferenceTuple``) breaks, or None.

    ``positive_sql``: the query the chosen state is cut from. ``within``: a within-trajectory pair.
    ``root_state``: (prefix, clause) of the negative's clause that holds v* (the state the
    negative wrote at its root position), for the ``root_on_chosen_side`` rule.
    """
    if not is_state_of(t.negative_sql, t.prefix_rejected, t.rejected):
        return "rejected_not_a_state"
    if not is_state_of(positive_sql, t.prefix_chosen, t.chosen):
        return "chosen_not_a_state"
    if (t.prefix_chosen, t.chosen) == (t.prefix_rejected, t.rejected):
        return "same_state"
    if _clause_text(t.chosen) == _clause_text(t.rejected):
        return "equal_clause_texts"
    if within and root_state is not None and (t.prefix_chosen, t.chosen) == root_state:
        return "root_on_chosen_side"
    if not (math.isfinite(t.margin) and 0.0 < t.margin <= alpha + 1e-9):
        return "margin_out_of_range"
    return None


def _clause_text(clause: str) -> str:
    # The end marker stays: "FROM t" against "FROM t<end>" is "go on" against "stop here".
    return " ".join(clause.split())


__all__ = ["REASONS", "is_state_of", "violation"]
