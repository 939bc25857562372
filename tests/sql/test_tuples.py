"""Within-trajectory preference tuples, against hand-computed states and margins.

References: the clause rewards written out by hand (propagation's formula, -alpha * exp(-d^2/2)),
character offsets read off the SQL text, and SQLite through the Annotator on a Spider database.
A query's last clause is written with END (the end of the query is part of its state).
"""
import math

import pytest
from sqlglot import exp

from caper_jax.data.prm_records import decode_record
from caper_jax.sql.clauses import SqlParseError, parse_sql
from caper_jax.sql.contract import END_OF_SQL as END
from caper_jax.sql.execution import ExecResult
from caper_jax.sql.mutations import Negative
from caper_jax.sql.tuples import (AnnotationSettings, Annotator, Context, mutation_tuples,
                                  within_trajectory_tuples)

CONTEXT = Context("q", "db", "schema", "SELECT name FROM singer WHERE age > 20 ORDER BY age")
PARENT = math.exp(-0.5)          # one edge from v*, sigma = 1


def states(tuples):
    return [(t.clause, t.prefix_chosen, t.chosen, t.prefix_rejected, t.rejected, round(t.margin, 6), t.provenance)
            for t in tuples]


def test_every_clause_against_the_root_with_its_own_prefix():
    neg = "SELECT country FROM singer WHERE age > 20 ORDER BY age"
    rewards = {"SELECT": -1.0, "FROM": -PARENT, "WHERE": 0.0, "ORDER BY": 0.0}
    got = within_trajectory_tuples(CONTEXT, negative_sql=neg, negative_rewards=rewards, margin_floor=0.05,
                                   provenance="within:column")
    assert states(got) == [
        ("SELECT", "SELECT country ", "FROM singer", "", "SELECT country", round(1 - PARENT, 6), "within:column"),
        ("SELECT", "SELECT country FROM singer ", "WHERE age > 20", "", "SELECT country", 1.0, "within:column"),
        ("SELECT", "SELECT country FROM singer WHERE age > 20 ", "ORDER BY age" + END, "", "SELECT country", 1.0,
         "within:column"),
    ]
    assert all(t.negative_sql == neg and t.gold_sql == CONTEXT.gold_sql for t in got)
    # The floor applies to r_k - r_root: 1 - exp(-1/2) = 0.393 drops under a floor of 0.5.
    high = within_trajectory_tuples(CONTEXT, negative_sql=neg, negative_rewards=rewards, margin_floor=0.5,
                                    provenance="within:column")
    assert [t.chosen for t in high] == ["WHERE age > 20", "ORDER BY age" + END]


def test_root_in_the_middle_and_clauses_absent_from_the_rewards():
    neg = "SELECT name FROM singer WHERE age > 40 ORDER BY age"
    # Only WHERE is listed: every other clause counts as reward 0.
    got = within_trajectory_tuples(CONTEXT, negative_sql=neg, negative_rewards={"WHERE": -2.0}, margin_floor=0.05,
                                   provenance="within:counterfactual")
    rejected = ("SELECT name FROM singer ", "WHERE age > 40")
    assert [(t.prefix_chosen, t.chosen, (t.prefix_rejected, t.rejected), t.margin, t.clause) for t in got] == [
        ("", "SELECT name", rejected, 2.0, "WHERE"),
        ("SELECT name ", "FROM singer", rejected, 2.0, "WHERE"),
        ("SELECT name FROM singer WHERE age > 40 ", "ORDER BY age" + END, rejected, 2.0, "WHERE"),
    ]


def test_a_missing_root_clause_is_blamed_on_the_clause_written_next():
    # The negative lacks WHERE (reward -1 at that position): its omission shows at ORDER BY.
    neg = "SELECT name FROM singer ORDER BY age"
    rewards = {"SELECT": 0.0, "FROM": 0.0, "WHERE": -1.0, "ORDER BY": 0.0}
    got = within_trajectory_tuples(CONTEXT, negative_sql=neg, negative_rewards=rewards, margin_floor=0.05,
                                   provenance="within:counterfactual")
    assert [(t.clause, t.chosen, t.prefix_rejected, t.rejected, t.margin) for t in got] == [
        ("WHERE", "SELECT name", "SELECT name FROM singer ", "ORDER BY age" + END, 1.0),
        ("WHERE", "FROM singer", "SELECT name FROM singer ", "ORDER BY age" + END, 1.0)]
    # Nothing written after the missing clause: the query ended where WHERE belonged, so the state
    # to blame is its last clause with the end of the query -- FROM without END stays unblamed.
    ended = within_trajectory_tuples(CONTEXT, negative_sql="SELECT name FROM singer",
                                     negative_rewards={"SELECT": 0.0, "FROM": 0.0, "WHERE": -1.0},
                                     margin_floor=0.05, provenance="x")
    assert [(t.clause, t.prefix_chosen, t.chosen, t.prefix_rejected, t.rejected, t.margin) for t in ended] == [
        ("WHERE", "", "SELECT name", "SELECT name ", "FROM singer" + END, 1.0)]


def test_repeated_compound_units_and_ties():
    neg = "SELECT a FROM t UNION SELECT b FROM u UNION SELECT c FROM v"
    # The second UNION is the root; keys name repeated units "UNION#2".
    got = within_trajectory_tuples(CONTEXT, negative_sql=neg, negative_rewards={"UNION#2": -1.0, "UNION": -0.5},
                                   margin_floor=0.05, provenance="x")
    assert [(t.chosen, t.rejected, t.margin, t.clause) for t in got] == [
        ("SELECT a", "UNION SELECT c FROM v" + END, 1.0, "UNION"),
        ("FROM t", "UNION SELECT c FROM v" + END, 1.0, "UNION"),
        ("UNION SELECT b FROM u", "UNION SELECT c FROM v" + END, 0.5, "UNION")]
    # Two clauses at the minimum: the first in written order is the root, the other gets margin 0 (< floor).
    tie = within_trajectory_tuples(CONTEXT, negative_sql="SELECT a FROM t WHERE b = 1",
                                   negative_rewards={"WHERE": -1.0, "FROM": -1.0}, margin_floor=0.05, provenance="x")
    assert [(t.chosen, t.rejected) for t in tie] == [("SELECT a", "FROM t")]   # FROM is not the last clause


def test_no_penalty_no_tuples_and_bad_input():
    sql = "SELECT a FROM t"
    assert within_trajectory_tuples(CONTEXT, negative_sql=sql, negative_rewards={}, margin_floor=0.05,
                                    provenance="x") == []
    assert within_trajectory_tuples(CONTEXT, negative_sql=sql, negative_rewards={"SELECT": 0.0, "FROM": 0.0},
                                    margin_floor=0.05, provenance="x") == []
    with pytest.raises(ValueError, match="margin_floor"):
        within_trajectory_tuples(CONTEXT, negative_sql=sql, negative_rewards={"FROM": -1.0}, margin_floor=0.0,
                                 provenance="x")
    with pytest.raises(SqlParseError):
        within_trajectory_tuples(CONTEXT, negative_sql="SELECT FROM WHERE (", negative_rewards={"FROM": -1.0},
                                 margin_floor=0.05, provenance="x")


def test_mutation_tuples_add_within_tuples_only_when_asked():
    gold = "SELECT name FROM singer WHERE age > 20"
    sql = "SELECT country FROM singer WHERE age > 20"
    tree = parse_sql(sql)
    node = next(c for c in tree.find_all(exp.Column) if c.name == "country")
    negative = Negative(sql=sql, tree=tree, node=node, clause="SELECT", mutation="column", root_node_sql="country",
                        gold_node_sql="name", result=ExecResult())
    context = Context("q", "db", "schema", gold)
    paper = mutation_tuples(context, negative, alpha=1.0, sigma=1.0, margin_floor=0.05)
    both = mutation_tuples(context, negative, alpha=1.0, sigma=1.0, margin_floor=0.05, within_trajectory=True)
    assert both[:len(paper)] == paper and {t.provenance for t in paper} == {"mutation:column"}
    # Rewards SELECT -1, FROM 0 (no reference edges: the paper's rule), WHERE 0.
    assert states(both[len(paper):]) == [
        ("SELECT", "SELECT country ", "FROM singer", "", "SELECT country", 1.0, "within:column"),
        ("SELECT", "SELECT country FROM singer ", "WHERE age > 20" + END, "", "SELECT country", 1.0, "within:column")]


@pytest.fixture(scope="module")
def database_dir(spider):
    return spider / "database"


def test_annotator_setting_switches_within_tuples_and_pipeline_accepts_them(database_dir):
    record = {"question": "older than 30", "db_id": "concert_singer",
              "gold": "SELECT name FROM singer WHERE age > 30", "pred": "SELECT name FROM singer WHERE age > 40"}
    on = Annotator(database_dir, AnnotationSettings())
    off = Annotator(database_dir, AnnotationSettings(within_trajectory=False))
    try:
        with_within, paper = on(record), off(record)
    finally:
        on.close()
        off.close()
    # SQLite says the prediction is wrong; localisation blames WHERE (reward -1), SELECT and FROM get 0.
    assert [(t.provenance, t.chosen, t.rejected, t.margin) for t in paper.tuples] == [
        ("counterfactual", "WHERE age > 30" + END, "WHERE age > 40" + END, 1.0)]
    assert with_within.tuples[:1] == paper.tuples
    assert [(t.provenance, t.prefix_chosen, t.chosen, t.prefix_rejected, t.rejected, t.margin, t.clause)
            for t in with_within.tuples[1:]] == [
        ("within:counterfactual", "", "SELECT name", "SELECT name FROM singer ", "WHERE age > 40" + END, 1.0, "WHERE"),
        ("within:counterfactual", "SELECT name ", "FROM singer", "SELECT name FROM singer ", "WHERE age > 40" + END,
         1.0, "WHERE")]
    assert with_within.tuples_by_kind == {"counterfactual": 3}
    for i, t in enumerate(with_within.tuples):
        decoded = decode_record(t.as_dict(), i)    # the PRM pipeline's own validation
        assert decoded["prefix_chosen"] != decoded["prefix_rejected"] or i == 0
