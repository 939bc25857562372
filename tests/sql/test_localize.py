"""Counterfactual localisation on a real Spider database (concert_singer).

References: SQLite itself (a prediction is wrong because its result differs; a repaired single
error gives gold's result) and hand-written cases with a known root clause.
"""
import pytest

from caper_jax.sql.contract import END_OF_SQL as END
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
    result = run(db, "SELECT name FROM singer", "SELECT country FROM singer", alpha=2.0, sigma=1.0,
                 reference_edges=True)
    assert result.clause_rewards == pytest.approx({"SELECT": -2.0, "FROM": -2.0 * 0.6065306597126334})
    # Off by default (the paper's rule): the penalty stays in the clause holding v*.
    paper = run(db, "SELECT name FROM singer", "SELECT country FROM singer", alpha=2.0, sigma=1.0)
    assert paper.clause_rewards == {"SELECT": -2.0, "FROM": 0.0}


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


# --------------------------------------------------------------------------------------------
# Execution-verified walk: an earlier difference that does not change the answer is passed over.

@pytest.mark.parametrize("gold,pred,root,harmless", [
    # an extra self-join on the key drops and duplicates no rows: WHERE is the decisive error
    ("SELECT name FROM singer WHERE age > 30",
     "SELECT T1.name FROM singer AS T1 JOIN singer AS T2 ON T1.singer_id = T2.singer_id WHERE T1.age > 40",
     "WHERE", ["FROM"]),
    # a DISTINCT no rule can prove redundant, that removes nothing on this data
    ("SELECT name FROM singer WHERE age > 30", "SELECT DISTINCT name FROM singer WHERE age > 40", "WHERE", ["SELECT"]),
    # LIKE without wildcards selects the same rows as =; the ORDER BY direction is the error
    ("SELECT name FROM singer WHERE country = 'France' ORDER BY age DESC",
     "SELECT name FROM singer WHERE country LIKE 'France' ORDER BY age ASC", "ORDER BY", ["WHERE"]),
    # a real earlier error stays the root, whatever follows
    ("SELECT name FROM singer WHERE age > 30", "SELECT country FROM singer WHERE age > 40", "SELECT", []),
])
def test_harmless_differences_are_kept_and_the_decisive_one_is_root(db, gold, pred, root, harmless):
    executor, _ = db
    result = run(db, gold, pred)
    assert (result.root_clause, list(result.harmless), result.reason) == (root, harmless, "verified"), result
    assert result.corrected_verified and result.executions >= 1
    assert results_equal(executor.execute(gold), executor.execute(result.corrected_sql),
                         ordered=order_matters(gold)), result.corrected_sql
    # the canonical comparison alone blames the first difference
    canonical = run(db, gold, pred, verify=False)
    assert canonical.root_clause == (harmless[0] if harmless else root)
    assert canonical.reason == "canonical_fallback:no_executor"


def test_corrected_query_keeps_the_harmless_prefix_and_repairs_every_later_difference(db):
    gold = "SELECT name FROM singer WHERE age > 30 ORDER BY age DESC"
    pred = "SELECT DISTINCT name FROM singer WHERE age > 40 ORDER BY age"
    result = run(db, gold, pred)
    assert result.root_clause == "WHERE" and result.harmless == ("SELECT",)
    assert result.corrected_sql == "SELECT DISTINCT name FROM singer WHERE age > 30 ORDER BY age DESC"
    assert result.corrected_verified


def test_join_rewritten_as_subquery_is_judged_by_its_where(db):
    gold = ("SELECT T2.name FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id "
            "WHERE T1.year = 2014")
    # Keeping the prediction's FROM (stadium alone) with gold's WHERE (concert.year) cannot run;
    # the prediction reads concert in its IN-subquery, so its WHERE is tried with gold's FROM.
    wrong_year = "SELECT name FROM stadium WHERE stadium_id IN (SELECT stadium_id FROM concert WHERE year = 2015)"
    result = run(db, gold, wrong_year)
    assert (result.reason, result.root_clause) == ("verified:restructured", "WHERE")
    assert result.corrected_verified
    # A FROM that lacks the table gold's WHERE needs, read nowhere else: FROM, by the canonical rule.
    missing = "SELECT name FROM stadium WHERE capacity > 5000"
    result = run(db, gold, missing)
    assert (result.reason, result.root_clause) == ("canonical_fallback:hybrid_fails", "FROM")


def test_equivalence_rules_can_be_switched_off(db):
    gold = "SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id WHERE T1.age > 30"
    pred = "SELECT T1.name FROM singer AS T1, singer_in_concert AS T2 WHERE T1.singer_id = T2.singer_id AND T1.age > 40"
    assert run(db, gold, pred).root_clause == "WHERE"
    plain = run(db, gold, pred, rules=(), verify=False)
    assert plain.root_clause == "FROM"      # the comma join differs from JOIN ... ON without the rule


# --------------------------------------------------------------------------------------------
# Suspect failures.

@pytest.mark.parametrize("gold,pred,suspect", [
    # 2014 holds three concerts: LIMIT 1 cuts inside the tie
    ("SELECT concert_id FROM concert ORDER BY year LIMIT 1",
     "SELECT concert_id FROM concert WHERE year = 2014 ORDER BY concert_id DESC LIMIT 1", "tie"),
    ("SELECT concert_id FROM concert ORDER BY year LIMIT 1",
     "SELECT concert_id FROM concert WHERE year = (SELECT min(year) FROM concert)", "tie"),
    ("SELECT name, age FROM singer ORDER BY age", "SELECT name, CAST(age AS TEXT) FROM singer ORDER BY age", "type"),
    # gold's slip: the prediction spells the value as the database stores it ('France'), gold not
    ("SELECT name FROM singer WHERE country = 'france'", "SELECT name FROM singer WHERE country = 'France'",
     "gold_literal_case"),
    # real errors (the prediction's literal in another case than the data: SQLite compares
    # case-sensitively, it is a WHERE error of value grounding)
    ("SELECT name FROM singer WHERE country = 'France'", "SELECT name FROM singer WHERE country = 'france'", None),
    ("SELECT concert_id FROM concert ORDER BY year LIMIT 1",
     "SELECT concert_id FROM concert ORDER BY year DESC LIMIT 1", None),
    ("SELECT concert_id FROM concert ORDER BY year LIMIT 1",
     "SELECT concert_id FROM concert WHERE year = 2014 ORDER BY concert_id DESC LIMIT 2", None),
    ("SELECT name, age FROM singer ORDER BY age DESC", "SELECT name, age FROM singer ORDER BY age", None),
    ("SELECT name FROM singer WHERE country = 'France'", "SELECT name FROM singer WHERE country = 'Netherlands'", None),
    ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer WHERE age > 40", None),
])
def test_suspect_failures(db, gold, pred, suspect):
    result = run(db, gold, pred)
    assert not result.correct and result.suspect == suspect, result
    assert result.as_dict()["suspect"] == suspect


def test_suspect_failures_give_no_tuples_by_default(spider, tmp_path):
    from caper_jax.sql.tuples import AnnotationSettings, Annotator
    record = {"db_id": "concert_singer", "question": "q",
              "gold": "SELECT name, age FROM singer ORDER BY age",
              "pred": "SELECT name, CAST(age AS TEXT) FROM singer ORDER BY age"}
    default = Annotator(spider / "database")(record)
    assert default.tuples == [] and default.negatives_by_kind == {"suspect:type": 1}
    kept = Annotator(spider / "database", AnnotationSettings(suspect_tuples=True))(record)
    assert kept.tuples and kept.tuples_by_kind == {"suspect:type": len(kept.tuples)}
    wrong = Annotator(spider / "database")({**record, "pred": "SELECT name, age FROM singer ORDER BY age DESC"})
    assert wrong.tuples and wrong.negatives_by_kind == {"counterfactual": 1}


def test_a_literal_in_another_case_than_the_data_is_a_where_error(db, spider):
    from caper_jax.sql.tuples import Annotator
    executor, _ = db
    gold = "SELECT name FROM singer WHERE country = 'France'"
    pred = "SELECT name FROM singer WHERE country = 'france'"
    assert executor.execute(gold).rows and not executor.execute(pred).rows   # SQLite: case matters
    result = run(db, gold, pred)
    assert (result.root_clause, result.suspect, result.root_node) == ("WHERE", None, "'france'")
    annotation = Annotator(spider / "database")({"db_id": "concert_singer", "question": "q", "gold": gold,
                                                 "pred": pred})
    assert annotation.negatives_by_kind == {"counterfactual": 1}
    assert [(t.provenance, t.clause, t.chosen, t.rejected) for t in annotation.tuples][0] == (
        "counterfactual", "WHERE", "WHERE country = 'France'" + END, "WHERE country = 'france'" + END)


def test_a_column_of_a_table_gold_lacks_is_read_where_gold_holds_it(db):
    # The prediction reads singer_id through an extra join with singer; kept with gold's FROM
    # (singer_in_concert alone) the column is read from there: SELECT and FROM are harmless.
    gold = "SELECT singer_id FROM singer_in_concert WHERE concert_id = 1"
    pred = ("SELECT T1.singer_id FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id "
            "WHERE T2.concert_id = 2")
    result = run(db, gold, pred)
    assert (result.root_clause, result.harmless, result.reason) == ("WHERE", ("SELECT", "FROM"), "verified")
    assert run(db, gold, pred, verify=False).root_clause == "FROM"


def test_a_missing_distinct_is_judged_on_the_predictions_own_rows(db):
    gold = ("SELECT DISTINCT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id "
            "WHERE T1.age > 30")
    # One table, no duplicates: the DISTINCT gold needs for its join cannot matter here. The
    # prediction's FROM lacks the join its IN-subquery stands for: a restructuring, not an error
    # (FROM singer begins a correct query); its WHERE (age > 40) is the earliest decisive error.
    single = "SELECT name FROM singer WHERE singer_id IN (SELECT singer_id FROM singer_in_concert) AND age > 40"
    result = run(db, gold, single)
    assert (result.root_clause, result.harmless, result.reason) == ("WHERE", ("SELECT",), "verified:restructured")
    right = "SELECT name FROM singer WHERE singer_id IN (SELECT singer_id FROM singer_in_concert) AND age > 30"
    assert run(db, gold, right).correct
    # The prediction's own join repeats singers (one row per concert): the missing DISTINCT is the error.
    joined = ("SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id "
              "WHERE T1.age > 40")
    assert run(db, gold, joined).root_clause == "SELECT"


def test_a_runaway_prediction_is_localised_in_bounded_time(spider):
    """The unbounded recursive CTE is harmless alone (gold's later clauses never read it); the FROM that
    joins it is the earliest decisive error. Bounded: the localiser's CPU time (SQLite runs in this
    thread and is interrupted after ``timeout_s`` of wall time, so a loaded machine does not inflate it)
    stays far below what running the runaway once per hybrid without the interrupt would take."""
    import time
    path = spider / "database" / "concert_singer" / "concert_singer.sqlite"
    gold = "SELECT name FROM singer WHERE age > 30"
    pred = ("WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) "
            "SELECT name FROM singer AS T1 JOIN r ON T1.age > r.x WHERE T1.age > 40")
    with Executor(path, timeout_s=0.3) as executor:
        start = time.process_time()
        result = localize(gold, pred, executor, Schema.from_sqlite(path))
        cpu = time.process_time() - start
    assert not result.correct and result.pred_error_kind in ("timeout", "too_many_rows")
    assert result.root_clause == "FROM", result
    assert cpu < 5.0, cpu


def test_a_query_sqlglot_cannot_scope_is_localised_by_its_text(db):
    """SQLite runs one alias for two tables (a sampled policy query on Spider wrote ``AS t2`` twice);
    sqlglot cannot resolve its scopes, so it has no canonical form: the annotator blames the first
    clause whose text differs from gold's instead of stopping on sqlglot's OptimizeError."""
    from caper_jax.sql import canonical

    gold = ("SELECT T2.name FROM singer_in_concert AS T1 JOIN singer AS T2 ON T1.singer_id = T2.singer_id "
            "WHERE T1.concert_id = 1")
    pred = "SELECT name FROM singer_in_concert AS t2 JOIN singer AS t2 ON concert_id = 1"
    executor, _ = db
    assert executor.execute(pred).ok   # SQLite runs it (18 rows)
    with pytest.raises(canonical.CanonicalizeError, match="cannot resolve the query's tables"):
        canonical.canonicalize(pred)
    result = run(db, gold, pred)
    assert (result.correct, result.root_clause, result.reason) == (False, "SELECT", "parse_error")
    assert result.clause_rewards["SELECT"] == -1.0
