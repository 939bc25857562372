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
