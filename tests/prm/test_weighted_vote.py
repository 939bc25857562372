"""PRM-weighted voting against hand-computed sums, and against majority vote when the PRM is indifferent."""
import math
import sqlite3

import numpy as np
import pytest

from caper_jax.eval.ex import majority_vote
from caper_jax.prm import scoring
from caper_jax.sql.execution import Executor


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_member_weight_is_the_sigmoid_and_zero_for_unparseable():
    assert scoring.member_weight(0.0) == 0.5
    assert scoring.member_weight(2.0) == pytest.approx(sig(2.0))
    assert scoring.member_weight(-800.0) == pytest.approx(0.0) and scoring.member_weight(800.0) == 1.0
    assert scoring.member_weight(float("-inf")) == 0.0


def test_weighted_vote_by_hand():
    scores = [np.array([2.0, 3.0]), np.array([0.0]), np.array([-0.5, 0.5]), np.array([]), np.array([4.0])]
    classes = [0, 1, 1, None, 2]
    # min aggregates: 2, 0, -0.5, -inf, 4 -> class 0: sig(2) = .881; class 1: sig(0) + sig(-.5) = .878; class 2: .982
    assert scoring.weighted_vote(scores, classes, "min") == 4
    # last: 3, 0, 0.5, -inf, 4 -> class 1: .5 + .622 = 1.122 > class 2 .982 > class 0 .953; best member: index 2
    assert scoring.weighted_vote(scores, classes, "last") == 2
    assert scoring.select(scores, "vote_last", classes) == 2 and scoring.select(scores, "min") == 4
    # Nothing executed: best-of-k by the same aggregate.
    assert scoring.weighted_vote(scores, [None] * 5, "mean") == 4
    with pytest.raises(scoring.ScoringError, match="5 candidates but 2"):
        scoring.weighted_vote(scores, [0, 1], "min")
    with pytest.raises(scoring.ScoringError, match="needs the candidates' execution-result classes"):
        scoring.select(scores, "vote_min")


def test_with_equal_scores_it_is_majority_vote(tmp_path):
    path = tmp_path / "t.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (a INTEGER)")
        conn.executemany("INSERT INTO t VALUES (?)", [(1,), (2,), (3,)])
    queries = ["SELECT a FROM t WHERE a = 1", "SELECT a FROM t WHERE a > 2", "SELECT 1", "SELECT nope FROM t",
               "SELECT a FROM t WHERE a >= 3", "SELECT a FROM t WHERE a < 2", "SELECT 3"]
    with Executor(path) as executor:
        results = [executor.execute(q) for q in queries]
    classes = scoring.result_classes(results, "spider")
    assert classes == [0, 1, 0, None, 1, 0, 1]
    flat = [np.zeros(2)] * len(queries)
    rng = np.random.default_rng(0)
    for _ in range(20):  # any subset and order of candidates
        pick = list(rng.permutation(len(queries))[: rng.integers(1, len(queries) + 1)])
        sub = [results[i] for i in pick]
        assert scoring.weighted_vote(flat[:len(pick)], scoring.result_classes(sub, "spider"), "min") == \
            majority_vote(sub, "spider")
