"""Localisation metrics against hand-computed ranks, ties included."""
import numpy as np

import pytest

from caper_jax.prm.localization import (SEES_GOLD, Case, best_fair_baseline, clause_mean_logprobs,
                                       confidence_scores, disagreement_scores, execution_scores,
                                       expected_rank_metrics, heuristic_scores, random_scores, summarize,
                                       true_index_for)

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


def test_clause_mean_logprobs_by_hand():
    # "SELECT a FROM t WHERE x = 1": clauses start at 0, 9, 16; tokens at 0 ("SELECT"), 6 (" a"),
    # 8 (" FROM" starts on the space before FROM: it belongs to SELECT's span), 13 (" t"), 16, 22, 26,
    # and the stop token at 27 (len(sql)) belongs to the last clause.
    starts = [0, 6, 8, 13, 16, 22, 26, 27]
    logps = [-1.0, -2.0, -3.0, -4.0, -0.5, -0.5, -1.0, -2.0]
    assert clause_mean_logprobs(starts, logps, [0, 9, 16]) == (-2.0, -4.0, -1.0)
    # A clause no token starts in gets -inf (nothing says the policy was sure of it).
    assert clause_mean_logprobs([0, 5], [-1.0, -3.0], [0, 2, 4]) == (-1.0, float("-inf"), -3.0)
    with pytest.raises(ValueError, match="2 token offsets but 1"):
        clause_mean_logprobs([0, 1], [-1.0], [0])


def test_confidence_blames_the_least_sure_clause():
    scores = confidence_scores([-0.2, -1.5, -0.9])
    assert expected_rank_metrics(scores, 1) == (1.0, 1.0)
    # Equal confidence in two clauses: the true one is first or second with equal chance.
    top1, mrr = expected_rank_metrics(confidence_scores([-1.0, -1.0, -0.1]), 0)
    assert top1 == 0.5 and mrr == pytest.approx(0.75)


def test_disagreement_by_hand():
    pred = [("SELECT", "s1"), ("FROM", "f1"), ("WHERE", "w1")]
    samples = [{"SELECT": "s1", "FROM": "f1", "WHERE": "w1"},      # the prediction itself
               {"SELECT": "s1", "FROM": "f1", "WHERE": "w2"},
               {"SELECT": "s2", "FROM": "f1"},                      # no WHERE: disagrees there
               {"SELECT": "s1", "FROM": "f2", "WHERE": "w3"}]
    scores = disagreement_scores(pred, samples)
    assert scores == (0.75, 0.75, 0.25)
    assert expected_rank_metrics(scores, 2) == (1.0, 1.0)
    # SELECT and FROM tie at 0.75 behind WHERE: a true FROM is at rank 2 or 3.
    top1, mrr = expected_rank_metrics(scores, 1)
    assert top1 == 0.0 and mrr == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert disagreement_scores(pred, []) == (0.0, 0.0, 0.0)   # no samples: every clause tied (= random)


def test_best_fair_baseline_never_picks_one_that_sees_gold():
    assert SEES_GOLD["heuristic"] and not any(SEES_GOLD[m] for m in ("confidence", "disagreement", "execution",
                                                                       "random"))
    summaries = {"prm": {"top1": 0.9, "mrr": 0.9}, "heuristic": {"top1": 0.98, "mrr": 0.99},
                 "execution": {"top1": 0.4, "mrr": 0.6}, "disagreement": {"top1": 0.5, "mrr": 0.6},
                 "random": {"top1": 0.5, "mrr": 0.7}}
    assert best_fair_baseline(summaries) == "random"       # ties on top-1 go to the higher MRR
    assert best_fair_baseline({"prm": {}, "heuristic": {"top1": 1, "mrr": 1}}) is None
