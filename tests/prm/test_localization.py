"""Localisation metrics against hand-computed ranks, ties included."""
import numpy as np

from caper_jax.prm.localization import (Case, execution_scores, expected_rank_metrics, heuristic_scores,
                                        random_scores, summarize, true_index_for)

ORDER = ("SELECT", "FROM", "WHERE", "GROUP BY", "HAVING", "ORDER BY", "LIMIT")


def test_clear_ranks():
    assert expected_rank_metrics([0.5, -2.0, 0.1], 1) == (1.0, 1.0)
    top1, mrr = expected_rank_metrics([0.5, -2.0, 0.1], 2)
    assert top1 == 0.0 and mrr == 0.5
    top1, mrr = expected_rank_metrics([0.5, -2.0, 0.1], 0)
    assert top1 == 0.0 and np.isclose(mrr, 1 / 3)


def test_ties_are_expected_values():
    # All tied over 4 clauses: top-1 1/4, MRR (1 + 1/2 + 1/3 + 1/4) / 4.
    top1, mrr = expected_rank_metrics(random_scores(4), 2)
    assert np.isclose(top1, 0.25) and np.isclose(mrr, (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    # One clause lower, the target tied with one other: rank 2 or 3.
    top1, mrr = expected_rank_metrics([-1.0, 0.0, 0.0], 1)
    assert top1 == 0.0 and np.isclose(mrr, (1 / 2 + 1 / 3) / 2)


def test_summary_per_clause_and_confusion():
    cases = [Case(("SELECT", "FROM", "WHERE"), (0.0, 0.0, -1.0), 2),
             Case(("SELECT", "FROM", "WHERE"), (-1.0, 0.0, 0.5), 2),
             Case(("SELECT", "FROM"), (-3.0, 1.0), 0)]
    s = summarize(cases)
    assert s["n"] == 3
    assert np.isclose(s["top1"], 2 / 3)
    assert np.isclose(s["mrr"], (1 + 1 / 3 + 1) / 3)
    assert s["per_clause"]["WHERE"] == {"top1": 0.5, "mrr": (1 + 1 / 3) / 2, "n": 2}
    assert s["confusion"]["WHERE"] == {"WHERE": 1, "SELECT": 1}


def test_baselines():
    pred = [("SELECT", "SELECT name"), ("FROM", "FROM t"), ("WHERE", "where  AGE > 3")]
    gold = [("SELECT", "select name"), ("FROM", "FROM t"), ("WHERE", "WHERE age > 4")]
    assert heuristic_scores(pred, gold) == (0.0, 0.0, -1.0)
    assert execution_scores(3) == (0.0, 0.0, -1.0)


def test_missing_clause_is_blamed_where_it_shows():
    assert true_index_for(["SELECT", "FROM", "GROUP BY"], "WHERE", ORDER) == 2
    assert true_index_for(["SELECT", "FROM"], "WHERE", ORDER) == 1
    assert true_index_for(["SELECT", "FROM", "WHERE"], "FROM", ORDER) == 1
