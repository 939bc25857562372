"""Counterfactual localisation on a real Spider database (concert_singer).

References: SQLite itself (a prediction is wrong because its result differs; a repaired single
error gives gold's result) and hand-written cases with a known root clause.
"""
import pytest

from caper_jax.data.prompts import END_OF_SQL as END
from caper_jax.sql.execution import Executor, order_matters, results_equal
from caper_jax.sql.localize import GoldError, localize, text_clauses
from caper_jax.sql.schema import Schema
from caper_jax.sql.tuples import Context, counterfactual_tuples


@pytest.fixture(scope="module")
def db(spider):
    path = spider / "database" / "concert_singer" / "concert_singer.sqlite"
    with Executor(path) as executor:
        yield executor, Schema.from_sqlite(path)


def run(db, gold, pred, **kwargs):
    executor, schema = db
    return localize(gold, pred, executor, schema, **kwargs)


SURFACE_ONLY = [
    ("SELECT T2.name, count(*) FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id "
     "GROUP BY T1.stadium_id",
     "select s.Name, COUNT(*) from stadium s join concert c on s.Stadium_ID = c.Stadium_ID group by c.stadium_id"),
    ("SELECT name FROM singer WHERE age > 30 AND country = 'France'",
     "SELECT singer.name FROM singer WHERE (singer.country = \"France\") AND (30 < singer.age)"),
    ("SELECT count(*) FROM singer WHERE country != 'France'", "SELECT COUNT(*) FROM singer WHERE country <> 'France'"),
]


@pytest.mark.parametrize("gold,pred", SURFACE_ONLY)
def test_surface_only_prediction_is_never_blamed(db, gold, pred):
    result = run(db, gold, pred)
    assert result.correct and result.root_clause is None and result.clause_rewards == {}


@pytest.mark.parametrize("gold,pred,root", [
    # surface differences in SELECT/FROM, real error in WHERE
    ("SELECT T2.name FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id WHERE T1.year = 2014",
     "select s.name from stadium s join concert c on c.stadium_id = s.stadium_id where c.year = 2015", "WHERE"),
    # several errors: the earliest in written order is the root
    ("SELECT name, age FROM singer WHERE age > 30 ORDER BY age DESC",
     "SELECT name, age FROM singer WHERE age > 40 ORDER BY age ASC", "WHERE"),
    ("SELECT name FROM singer ORDER BY age DESC LIMIT 3", "SELECT country FROM singer ORDER BY age DESC LIMIT 1",
     "SELECT"),
    ("SELECT country, count(*) FROM singer GROUP BY country HAVING count(*) > 1",
     "SELECT country, count(*) FROM singer GROUP BY country HAVING count(*) > 4", "HAVING"),
    # a wrong table: unqualified columns differ only through it, so FROM is the root, not SELECT
    ("SELECT name FROM stadium", "SELECT name FROM singer", "FROM"),
    ("SELECT * FROM stadium", "SELECT * FROM concert", "FROM"),
    # missing and extra clauses
    ("SELECT count(*) FROM singer WHERE country = 'France'", "SELECT count(*) FROM singer", "WHERE"),
    ("SELECT count(*) FROM singer", "SELECT count(*) FROM singer WHERE age > 40", "WHERE"),
    ("SELECT name FROM stadium UNION SELECT name FROM singer", "SELECT name FROM stadium", "UNION"),
    # does not run: unknown column
    ("SELECT name FROM singer WHERE age > 20", "SELECT nme FROM singer WHERE age > 20", "SELECT"),
])
def test_root_clause(db, gold, pred, root):
    result = run(db, gold, pred)
    assert not result.correct and result.root_clause == root, result
    assert result.clause_rewards[root] == -1.0
    assert all(r <= 0 for r in result.clause_rewards.values())


@pytest.mark.parametrize("gold,pred", [
    ("SELECT name FROM singer WHERE age > 32", "SELECT name FROM singer WHERE age >= 32"),
    ("SELECT name, age FROM singer ORDER BY age DESC", "SELECT name, age FROM singer ORDER BY age"),
    ("SELECT T2.name FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id WHERE T1.year = 2014",
     "SELECT T2.location FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id WHERE T1.year = 2014"),
    ("SELECT count(*) FROM singer WHERE country = 'France'", "SELECT count(*) FROM singer"),
    ("SELECT count(*) FROM singer", "SELECT count(*) FROM singer WHERE age > 40"),
    ("SELECT max(capacity) FROM stadium", "SELECT min(capacity) FROM stadium"),
])
def test_repairing_a_single_error_gives_gold_result(db, gold, pred):
    executor, _ = db
    result = run(db, gold, pred)
    assert not result.correct and result.corrected_sql is not None
    assert results_equal(executor.execute(gold), executor.execute(result.corrected_sql),
                         ordered=order_matters(gold)), result.corrected_sql


def test_edit_script_and_root_node(db):
    result = run(db, "SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer WHERE age > 40")
    assert result.root_node == "40"
    assert result.edit_script == ({"op": "relabel", "source": "Literal:40", "target": "Literal:30",
                                   "source_sql": "40", "target_sql": "30"},)
    assert result.corrected_sql == "SELECT name FROM singer WHERE age > 30"
    missing = run(db, "SELECT count(*) FROM singer WHERE country = 'France'", "SELECT count(*) FROM singer")
    assert missing.root_node is None and [op["op"] for op in missing.edit_script] == ["insert"] * 4


def test_reference_edge_reaches_from(db):
    result = run(db, "SELECT name FROM singer", "SELECT country FROM singer", alpha=2.0, sigma=1.0)
    assert result.clause_rewards == pytest.approx({"SELECT": -2.0, "FROM": -2.0 * 0.6065306597126334})


@pytest.mark.parametrize("pred,root,token", [
    ("SELECT name FROM singer WHERE age >", "WHERE", ">"),
    ("SELECT name FROM singer ORDER BY age DESC LIMIT", "LIMIT", "LIMIT"),
    ("SELECT name FROM singer WHERE (age > 3", "WHERE", "3"),
    ("SELECT name FROM singer WHERE name = 'abc", "WHERE", None),   # untokenizable: first textual difference
])
def test_unparseable_prediction(db, pred, root, token):
    result = run(db, "SELECT name FROM singer WHERE age > 20", pred)
    assert (result.correct, result.root_clause, result.root_node, result.reason) == (False, root, token, "parse_error")
    assert result.clause_rewards[root] == -1.0


def test_text_clauses_track_quotes_and_parentheses():
    sql = "SELECT a FROM t WHERE b = 'x FROM y' AND c IN (SELECT d FROM u) ORDER  BY a"
    assert [name for name, _ in text_clauses(sql)] == ["SELECT", "FROM", "WHERE", "ORDER BY"]
    assert text_clauses(sql)[2][1] == sql.index("WHERE")
    compound = "SELECT a FROM t UNION SELECT b FROM u WHERE c ORDER BY a LIMIT 1"
    assert [name for name, _ in text_clauses(compound)] == ["SELECT", "FROM", "UNION", "ORDER BY", "LIMIT"]


def test_gold_that_does_not_run_is_a_typed_error(db):
    with pytest.raises(GoldError):
        run(db, "SELECT nothing_here FROM singer", "SELECT name FROM singer")


def test_counterfactual_tuples_share_the_prefix(db):
    gold = "SELECT name FROM singer WHERE age > 30 ORDER BY name"
    pred = "SELECT name FROM singer ORDER BY name"
    result = run(db, gold, pred)
    tuples = counterfactual_tuples(Context("q", "concert_singer", "s", gold), pred, result, margin_floor=0.05)
    assert [(t.clause, t.prefix_chosen, t.chosen, t.prefix_rejected, t.rejected, t.margin) for t in tuples] == [
        ("WHERE", "SELECT name FROM singer ", "WHERE age > 30", "SELECT name FROM singer ", "ORDER BY name" + END, 1.0)]
    assert tuples[0].provenance == "counterfactual" and tuples[0].negative_sql == pred
    # A trailing WHERE left out: the state to blame is FROM followed by the end of the query.
    gold, pred = "SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer"
    tuples = counterfactual_tuples(Context("q", "concert_singer", "s", gold), pred, run(db, gold, pred),
                                   margin_floor=0.05)
    assert [(t.clause, t.prefix_chosen, t.chosen, t.prefix_rejected, t.rejected, t.margin) for t in tuples] == [
        ("WHERE", "SELECT name FROM singer ", "WHERE age > 30" + END, "SELECT name ", "FROM singer" + END, 1.0)]
