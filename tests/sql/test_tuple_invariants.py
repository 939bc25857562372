"""Every preference tuple the annotator emits, checked pair by pair.

References: SQLite (a query is correct because it returns gold's rows), the query texts themselves
(a state is a prefix of the query it is cut from), and hand-built tuples for each invariant.
"""
import pytest

from caper_jax.sql import invariants
from caper_jax.sql.contract import END_OF_SQL as END
from caper_jax.sql.execution import Executor, results_equal
from caper_jax.sql.localize import localize
from caper_jax.sql.schema import Schema
from caper_jax.sql.tuples import (AnnotationSettings, AnnotationSummary, Annotator, Context, PreferenceTuple,
                                  counterfactual_pairs)

GOLD = "SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id"
COMMA_JOIN = "SELECT T1.name FROM singer AS T1, singer_in_concert AS T2 WHERE T1.age = T2.singer_id"
# The comma join written right: its prefix up to WHERE is the prefix of the wrong one.
COMMA_JOIN_RIGHT = "SELECT T1.name FROM singer AS T1, singer_in_concert AS T2 WHERE T1.singer_id = T2.singer_id"


@pytest.fixture(scope="module")
def database_dir(spider):
    return spider / "database"


@pytest.fixture(scope="module")
def db(database_dir):
    path = database_dir / "concert_singer" / "concert_singer.sqlite"
    with Executor(path) as executor:
        yield executor, Schema.from_sqlite(path)


@pytest.fixture(scope="module")
def annotator(database_dir):
    a = Annotator(database_dir, AnnotationSettings())
    yield a
    a.close()


def record(gold, pred=None):
    return {"question": "q", "db_id": "concert_singer", "gold": gold, **({"pred": pred} if pred else {})}


def test_a_join_condition_written_in_where_is_blamed_in_where(db, annotator):
    executor, schema = db
    gold = executor.execute(GOLD)
    assert not results_equal(gold, executor.execute(COMMA_JOIN), ordered=False)
    assert results_equal(gold, executor.execute(COMMA_JOIN_RIGHT), ordered=False)
    # The equivalence rule join_conditions_in_from moves the condition into the canonical FROM;
    # the blame and the rewards stay in the clause the prediction wrote it in.
    loc = localize(GOLD, COMMA_JOIN, executor, schema)
    assert (loc.root_clause, loc.root_key, loc.root_node) == ("WHERE", "WHERE", "singer.age")
    assert loc.clause_rewards == {"SELECT": 0.0, "FROM": 0.0, "WHERE": -1.0}
    annotation = annotator(record(GOLD, COMMA_JOIN))
    assert annotation.tuples and not annotation.dropped
    for t in annotation.tuples:
        state = t.prefix_rejected + t.rejected
        # No pair rejects a state a correct query starts with (an unended state is a prefix).
        assert not (not t.rejected.endswith(END) and (COMMA_JOIN_RIGHT.startswith(state) or GOLD.startswith(state)))
        # The prediction's own erroneous WHERE is never preferred.
        assert "T1.age" not in t.chosen
        assert t.clause == "WHERE" and "T1.age = T2.singer_id" in t.rejected
    assert {t.provenance for t in annotation.tuples} == {"counterfactual", "within:counterfactual"}


def test_the_comma_join_prefix_is_preferred_to_the_wrong_where(annotator):
    within = [t for t in annotator(record(GOLD, COMMA_JOIN)).tuples if t.provenance.startswith("within")]
    assert [(t.prefix_chosen, t.chosen, t.rejected, t.margin) for t in within] == [
        ("", "SELECT T1.name", "WHERE T1.age = T2.singer_id" + END, 1.0),
        ("SELECT T1.name ", "FROM singer AS T1, singer_in_concert AS T2", "WHERE T1.age = T2.singer_id" + END, 1.0)]


def tup(prefix_chosen, chosen, prefix_rejected, rejected, negative, margin=1.0, provenance="counterfactual"):
    return PreferenceTuple("q", "db", "s", "WHERE", prefix_chosen, chosen, prefix_rejected, rejected, margin,
                           provenance, "gold", negative)


POSITIVE = "SELECT a FROM t WHERE b = 1"
NEGATIVE = "SELECT a FROM t WHERE b = 2"


@pytest.mark.parametrize("t, positive, within, root, reason", [
    # A valid pair: both states are prefixes of their queries, cut at clause boundaries.
    (tup("SELECT a FROM t ", "WHERE b = 1" + END, "SELECT a FROM t ", "WHERE b = 2" + END, NEGATIVE),
     POSITIVE, False, None, None),
    # The rejected state is not the negative's (a text it never wrote).
    (tup("SELECT a FROM t ", "WHERE b = 1" + END, "SELECT a FROM t ", "WHERE b = 3" + END, NEGATIVE),
     POSITIVE, False, None, "rejected_not_a_state"),
    # The last clause without the end marker is not a state: the query ended there.
    (tup("SELECT a FROM t ", "WHERE b = 1" + END, "SELECT a FROM t ", "WHERE b = 2", NEGATIVE),
     POSITIVE, False, None, "rejected_not_a_state"),
    # An end marker where the query goes on.
    (tup("SELECT a FROM t ", "WHERE b = 1" + END, "SELECT a ", "FROM t" + END, NEGATIVE),
     POSITIVE, False, None, "rejected_not_a_state"),
    (tup("SELECT a FROM u ", "WHERE b = 1" + END, "SELECT a FROM t ", "WHERE b = 2" + END, NEGATIVE),
     POSITIVE, False, None, "chosen_not_a_state"),
    (tup("SELECT a FROM t ", "WHERE b = 2" + END, "SELECT a FROM t ", "WHERE b = 2" + END, NEGATIVE),
     NEGATIVE, False, None, "same_state"),
    # Equal clause texts after different prefixes (what reference edges made).
    (tup("SELECT c ", "FROM t", "SELECT a ", "FROM t", NEGATIVE), "SELECT c FROM t WHERE b = 2", False, None,
     "equal_clause_texts"),
    # A within pair whose chosen side is the clause holding v*.
    (tup("SELECT a FROM t ", "WHERE b = 2" + END, "", "SELECT a", NEGATIVE, provenance="within:x"), NEGATIVE, True,
     ("SELECT a FROM t ", "WHERE b = 2" + END), "root_on_chosen_side"),
    (tup("SELECT a FROM t ", "WHERE b = 1" + END, "SELECT a FROM t ", "WHERE b = 2" + END, NEGATIVE, margin=0.0),
     POSITIVE, False, None, "margin_out_of_range"),
    (tup("SELECT a FROM t ", "WHERE b = 1" + END, "SELECT a FROM t ", "WHERE b = 2" + END, NEGATIVE, margin=1.5),
     POSITIVE, False, None, "margin_out_of_range"),
])
def test_each_invariant_names_its_violation(t, positive, within, root, reason):
    assert invariants.violation(t, positive_sql=positive, alpha=1.0, within=within, root_state=root) == reason


def test_a_final_semicolon_and_whitespace_still_end_the_query():
    assert invariants.is_state_of("SELECT a FROM t ;  ", "SELECT a ", "FROM t" + END)
    assert not invariants.is_state_of("SELECT a FROM t WHERE b", "SELECT a ", "FROM t" + END)
    assert invariants.is_state_of("SELECT a FROM t WHERE b", "SELECT a ", "FROM t")


def test_dropped_pairs_are_counted_by_reason_in_the_summary(database_dir):
    # With reference edges a wrong SELECT column marks FROM; the FROM pair then compares the same
    # FROM text after two SELECTs: dropped, and counted.
    rec = record("SELECT name FROM singer WHERE age > 30", "SELECT country FROM singer WHERE age > 30")
    with_edges = Annotator(database_dir, AnnotationSettings(reference_edges=True))
    try:
        annotation = with_edges(rec)
    finally:
        with_edges.close()
    assert [(p.tuple.clause, p.tuple.chosen, p.tuple.rejected, p.dropped) for p in annotation.dropped] == [
        ("FROM", "FROM singer", "FROM singer", "equal_clause_texts")]
    assert all(t.chosen != t.rejected for t in annotation.tuples)
    summary, other = AnnotationSummary(), AnnotationSummary()
    summary.add(annotation)
    other.add(annotation)
    summary.merge(other)          # as a distributed build merges per-worker counts
    assert summary.as_dict()["dropped_by_reason"] == {"equal_clause_texts": 2}
    assert summary.as_dict()["tuples"] == 2 * len(annotation.tuples)


def test_every_pair_of_a_few_failures_satisfies_the_invariants(annotator, db):
    # Kept pairs pass every check again from scratch; positive_sql is what the chosen state is cut from.
    cases = [(GOLD, COMMA_JOIN),
             ("SELECT name FROM singer WHERE age > 30 ORDER BY age", "SELECT name FROM singer ORDER BY age"),
             ("SELECT count(*) FROM singer WHERE country = 'France'", "SELECT count(*) FROM singer"),
             ("SELECT name FROM stadium EXCEPT SELECT T2.name FROM concert AS T1 JOIN stadium AS T2 "
              "ON T1.stadium_id = T2.stadium_id", "SELECT name FROM stadium")]
    for gold, pred in cases + [(g, None) for g, _ in cases]:
        annotation = annotator(record(gold, pred))
        assert annotation.source in ("counterfactual", "mutation") and annotation.tuples, (gold, pred)
        for t, positive in zip(annotation.tuples, annotation.positive_sql):
            within = t.provenance.startswith("within")
            assert invariants.violation(t, positive_sql=positive, alpha=1.0, within=within) is None
            assert (positive == t.negative_sql) == within


def test_counterfactual_pairs_carry_the_positive_query(db):
    executor, schema = db
    loc = localize(GOLD, COMMA_JOIN, executor, schema)
    pairs = counterfactual_pairs(Context("q", "concert_singer", "s", GOLD), COMMA_JOIN, loc, margin_floor=0.05,
                                 alpha=1.0, within_trajectory=True)
    assert [(p.tuple.provenance, p.positive_sql) for p in pairs] == [
        ("counterfactual", loc.corrected_sql), ("within:counterfactual", COMMA_JOIN),
        ("within:counterfactual", COMMA_JOIN)]
    assert results_equal(executor.execute(GOLD), executor.execute(loc.corrected_sql), ordered=False)


# --------------------------------------------------------------------------------------------
# Compound queries: written order, earliest decisive error, occurrences.

COMPOUND = "SELECT name FROM singer EXCEPT SELECT name FROM singer WHERE age > 40 UNION SELECT name FROM stadium"


def test_compound_units_are_walked_in_written_order(db, annotator):
    executor, schema = db
    # Errors in both right-hand queries: the EXCEPT, written first, is the earliest decisive one.
    both = ("SELECT name FROM singer EXCEPT SELECT name FROM singer WHERE age > 20 "
            "UNION SELECT location FROM stadium")
    loc = localize(COMPOUND, both, executor, schema)
    assert (loc.root_clause, loc.root_key, loc.reason) == ("EXCEPT", "EXCEPT", "verified")
    assert list(loc.clause_rewards) == ["SELECT", "FROM", "EXCEPT", "UNION"]
    assert loc.clause_rewards["EXCEPT"] == -1.0 and loc.clause_rewards["UNION"] == 0.0
    annotation = annotator(record(COMPOUND, both))
    assert annotation.tuples and not annotation.dropped
    # The erroneous EXCEPT is never the chosen side; every pair rejects it.
    assert all("age > 20" not in t.chosen and "age > 20" in t.rejected for t in annotation.tuples)
    # Only the UNION wrong: the UNION is the root.
    union_only = "SELECT name FROM singer EXCEPT SELECT name FROM singer WHERE age > 40 UNION SELECT location FROM stadium"
    assert localize(COMPOUND, union_only, executor, schema).root_key == "UNION"


def test_align_and_missing_states_follow_the_written_order():
    from caper_jax.sql.canonical import align, positions
    from caper_jax.sql.localize import clause_units
    from caper_jax.sql.tuples import _state_at
    written = positions(["SELECT", "FROM", "EXCEPT", "UNION"])
    shorter = positions(["SELECT", "FROM", "UNION", "ORDER BY"])
    assert [p.key for p in align(written, shorter)] == ["SELECT", "FROM", "EXCEPT", "UNION", "ORDER BY"]
    assert [p.key for p in align(shorter, written)] == ["SELECT", "FROM", "EXCEPT", "UNION", "ORDER BY"]
    units = clause_units("SELECT a FROM t UNION SELECT b FROM u ORDER BY 1")
    # EXCEPT is missing here: its state is the unit written in its place, the UNION.
    assert _state_at(units, written[2], align(written, shorter)).text == "UNION SELECT b FROM u"


def test_a_missing_operator_is_the_root_when_the_query_before_it_is_gold_s(db, annotator):
    executor, schema = db
    missing = "SELECT name FROM singer EXCEPT SELECT name FROM singer WHERE age > 40"
    loc = localize(COMPOUND, missing, executor, schema)
    assert (loc.root_clause, loc.root_node, loc.clause_rewards) == (
        "UNION", None, {"SELECT": 0.0, "FROM": 0.0, "EXCEPT": 0.0, "UNION": -1.0})
    aligned = [t for t in annotator(record(COMPOUND, missing)).tuples if t.provenance == "counterfactual"]
    # The query ended where the UNION belonged: its last unit, with the end, is rejected.
    assert [(t.prefix_chosen, t.chosen, t.prefix_rejected, t.rejected) for t in aligned] == [
        (missing + " ", "UNION SELECT stadium.name FROM stadium" + END,
         "SELECT name FROM singer ", "EXCEPT SELECT name FROM singer WHERE age > 40" + END)]


def test_a_compound_written_as_a_filter_is_blamed_on_that_where(db):
    executor, schema = db
    gold = "SELECT country FROM singer EXCEPT SELECT country FROM singer WHERE age > 40"
    pred = "SELECT country FROM singer WHERE age <= 40"
    gold_rows, pred_rows = executor.execute(gold), executor.execute(pred)
    assert not results_equal(gold_rows, pred_rows, ordered=False)
    # With gold's EXCEPT added after it the prediction's WHERE gives gold's rows, so the walk alone
    # would pass it and blame the missing EXCEPT; the prediction answers with that WHERE.
    hybrid = executor.execute(pred + " EXCEPT SELECT country FROM singer WHERE age > 40")
    assert results_equal(gold_rows, hybrid, ordered=False)
    loc = localize(gold, pred, executor, schema)
    assert (loc.root_clause, loc.reason) == ("WHERE", "verified:compound_as_filter")
    assert loc.clause_rewards == {"SELECT": 0.0, "FROM": 0.0, "WHERE": -1.0}
    assert loc.corrected_verified
    # Without a WHERE of its own the missing operator stays the root.
    assert localize(gold, "SELECT country FROM singer", executor, schema).root_clause == "EXCEPT"


def test_a_parse_error_is_blamed_on_its_own_occurrence(db):
    executor, schema = db
    gold = "SELECT name FROM singer WHERE age > 40 UNION SELECT name FROM stadium UNION SELECT concert_name FROM concert"
    broken = ("SELECT name FROM singer WHERE age > 40 UNION SELECT name FROM stadium "
              "UNION SELECT concert_name FROM concert WHERE (year")
    loc = localize(gold, broken, executor, schema)
    assert (loc.reason, loc.root_clause, loc.root_key) == ("parse_error", "UNION", "UNION#2")
    assert loc.clause_rewards == {"SELECT": 0.0, "FROM": 0.0, "WHERE": 0.0, "UNION": 0.0, "UNION#2": -1.0}


# --------------------------------------------------------------------------------------------
# Fault injection under the run's semantics.

@pytest.mark.parametrize("gold, kind", [
    ("SELECT name, age FROM singer ORDER BY age DESC", "order_direction"),   # no LIMIT: same set of rows
    ("SELECT DISTINCT country FROM singer", "distinct"),                     # duplicates: same set
])
def test_mutations_are_verified_under_the_runs_semantics(db, database_dir, gold, kind):
    import random

    from caper_jax.sql.mutations import inject_faults
    executor, schema = db
    spider = inject_faults(gold, executor, schema, 20, random.Random(0), max_attempts=200, semantics="spider")
    bird = inject_faults(gold, executor, schema, 20, random.Random(0), max_attempts=200, semantics="bird")
    assert kind in {n.mutation for n in spider} and kind not in {n.mutation for n in bird}
    gold_rows = executor.execute(gold)
    assert all(not results_equal(gold_rows, executor.execute(n.sql), semantics="bird", ordered=False) for n in bird)
    # The Annotator passes its semantics on.
    with_bird = Annotator(database_dir, AnnotationSettings(semantics="bird", per_query=20, max_attempts=200))
    try:
        kinds = set(with_bird(record(gold)).negatives_by_kind)
    finally:
        with_bird.close()
    assert kinds and kind not in kinds


def test_set_logic_written_in_one_query_is_blamed_where_the_prediction_writes_it(db):
    executor, schema = db
    # Gold's INTERSECT written as a join: the join decides which rows come out (here it repeats
    # singers with several concerts), not the missing operator.
    gold = "SELECT singer_id FROM singer INTERSECT SELECT singer_id FROM singer_in_concert"
    join = ("SELECT T1.singer_id FROM singer AS T1 JOIN singer_in_concert AS T2 "
            "ON T1.singer_id = T2.singer_id")
    assert not results_equal(executor.execute(gold), executor.execute(join), ordered=False)
    assert results_equal(executor.execute(gold), executor.execute(join + " INTERSECT SELECT singer_id FROM "
                                                                         "singer_in_concert"), ordered=False)
    assert localize(gold, join, executor, schema).root_clause == "FROM"
    # The reverse: gold's OR split into an INTERSECT of two queries; the first WHERE is one operand
    # of gold's condition, so the operator that split it is the root.
    gold = "SELECT count(*) FROM singer WHERE country = 'France' OR age > 40"
    split = ("SELECT count(*) FROM singer WHERE country = 'France' "
             "INTERSECT SELECT count(*) FROM singer WHERE age > 40")
    assert not results_equal(executor.execute(gold), executor.execute(split), ordered=False)
    loc = localize(gold, split, executor, schema)
    assert (loc.root_clause, loc.reason) == ("INTERSECT", "verified:filter_as_compound")
    # A first WHERE that is no piece of gold's condition stays the root.
    other = ("SELECT count(*) FROM singer WHERE country = 'Netherlands' "
             "INTERSECT SELECT count(*) FROM singer WHERE age > 40")
    assert localize(gold, other, executor, schema).root_clause == "WHERE"


def _localise_failure(gold, pred, executor, schema):
    """``localize`` of a prediction that SQLite shows fails against gold (else the case tests nothing)."""
    assert not results_equal(executor.execute(gold), executor.execute(pred), ordered=False)
    return localize(gold, pred, executor, schema)


def test_a_filter_written_as_an_operator_is_blamed_on_the_operator(db):
    executor, schema = db
    # Gold's NOT IN written as EXCEPT, the first operand without a WHERE of its own: the operator
    # carries the whole filter (and drops gold's duplicate countries).
    gold = "SELECT country FROM singer WHERE singer_id NOT IN (SELECT singer_id FROM singer_in_concert WHERE concert_id = 1)"
    pred = ("SELECT country FROM singer EXCEPT SELECT T1.country FROM singer AS T1 JOIN singer_in_concert AS T2 "
            "ON T1.singer_id = T2.singer_id WHERE T2.concert_id = 1")
    loc = _localise_failure(gold, pred, executor, schema)
    assert (loc.root_clause, loc.reason) == ("EXCEPT", "verified:filter_as_compound")


def test_a_wrong_join_key_completed_by_a_where_condition_is_blamed_in_from(db):
    executor, schema = db
    # equated_columns rewrites the class {age, stadium_id, singer_id} as age = singer_id and
    # age = stadium_id; the first derives from the ON (stadium_id = age, wrong) and the WHERE
    # (stadium_id = singer_id, right): it is blamed where the earliest of them is written.
    gold = "SELECT T2.name FROM stadium AS T1 JOIN singer AS T2 ON T1.stadium_id = T2.singer_id"
    pred = ("SELECT T2.name FROM stadium AS T1 JOIN singer AS T2 ON T1.stadium_id = T2.age "
            "WHERE T1.stadium_id = T2.singer_id")
    loc = _localise_failure(gold, pred, executor, schema)
    assert (loc.root_clause, loc.root_node) == ("FROM", "singer.age = singer.singer_id")
    # The same wrong condition written alone in WHERE is the WHERE's.
    assert localize(gold, "SELECT T2.name FROM stadium AS T1, singer AS T2 WHERE T1.stadium_id = T2.age",
                    executor, schema).root_clause == "WHERE"
