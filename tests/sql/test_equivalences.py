"""Equivalence rules of canonicalisation (caper_jax/sql/equivalences.py).

References: SQLite itself (each pair below returns the same rows on the real concert_singer
database, and every rewritten Spider dev gold returns its original result), and pairs that look
alike but are not equivalent (the rule must leave them apart; SQLite shows their results differ).
"""
import json

import pytest

from caper_jax.sql import canonical as canon
from caper_jax.sql import equivalences as eq
from caper_jax.sql.execution import Executor, Executors, order_matters, results_equal
from caper_jax.sql.schema import Schema


@pytest.fixture(scope="module")
def db(spider):
    path = spider / "database" / "concert_singer" / "concert_singer.sqlite"
    with Executor(path) as executor:
        yield executor, Schema.from_sqlite(path), eq.SchemaFacts.from_sqlite(path)


def keys(db, sql, rules=eq.ALL):
    _, schema, facts = db
    tree = canon.canonicalize(sql, schema, rules=rules, facts=facts).tree
    return [(slot.name, canon.canonical_key(slot)) for slot in canon.clause_slots(tree)]


def same_rows(db, a, b):
    executor = db[0]
    return results_equal(executor.execute(a), executor.execute(b), ordered=order_matters(a))


# (rule, a, b): equal with the rule, apart without it, same rows on SQLite.
EQUIVALENT = [
    ("join_conditions_in_from",
     "SELECT T1.name FROM singer AS T1, singer_in_concert AS T2 WHERE T1.singer_id = T2.singer_id AND T1.age > 30",
     "SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id WHERE T1.age > 30"),
    ("join_conditions_in_from",
     "SELECT T1.name FROM singer AS T1, singer_in_concert AS T2 WHERE T1.singer_id = T2.singer_id",
     "SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id"),
    ("equated_columns",
     "SELECT T1.concert_id, count(*) FROM concert AS T1 JOIN singer_in_concert AS T2 "
     "ON T1.concert_id = T2.concert_id GROUP BY T1.concert_id",
     "SELECT T2.concert_id, count(*) FROM concert AS T1 JOIN singer_in_concert AS T2 "
     "ON T1.concert_id = T2.concert_id GROUP BY T2.concert_id"),
    ("count_not_null", "SELECT count(singer_id) FROM singer WHERE age > 30", "SELECT count(*) FROM singer WHERE age > 30"),
    ("count_not_null",
     "SELECT T1.name, count(T2.concert_id) FROM singer AS T1 JOIN singer_in_concert AS T2 "
     "ON T1.singer_id = T2.singer_id GROUP BY T1.name",
     "SELECT T1.name, count(*) FROM singer AS T1 JOIN singer_in_concert AS T2 "
     "ON T1.singer_id = T2.singer_id GROUP BY T1.name"),
    ("redundant_distinct", "SELECT DISTINCT country, count(*) FROM singer GROUP BY country",
     "SELECT country, count(*) FROM singer GROUP BY country"),
    ("redundant_distinct", "SELECT DISTINCT name FROM singer INTERSECT SELECT name FROM stadium",
     "SELECT name FROM singer INTERSECT SELECT DISTINCT name FROM stadium"),
    ("redundant_distinct", "SELECT DISTINCT country FROM singer EXCEPT SELECT country FROM singer WHERE age > 40",
     "SELECT country FROM singer EXCEPT SELECT country FROM singer WHERE age > 40"),
    ("redundant_distinct", "SELECT name FROM stadium WHERE stadium_id IN (SELECT DISTINCT stadium_id FROM concert)",
     "SELECT name FROM stadium WHERE stadium_id IN (SELECT stadium_id FROM concert)"),
    ("redundant_distinct", "SELECT DISTINCT singer_id, name FROM singer", "SELECT singer_id, name FROM singer"),
    ("redundant_distinct", "SELECT DISTINCT max(age) FROM singer", "SELECT max(DISTINCT age) FROM singer"),
    ("select_column_order", "SELECT name, age FROM singer ORDER BY age", "SELECT age, name FROM singer ORDER BY age"),
    ("select_column_order", "SELECT name, country FROM singer UNION SELECT name, location FROM stadium",
     "SELECT country, name FROM singer UNION SELECT location, name FROM stadium"),
]


@pytest.mark.parametrize("rule,a,b", EQUIVALENT)
def test_each_rule_makes_an_equivalent_pair_meet(db, rule, a, b):
    assert same_rows(db, a, b)                                  # SQLite: the pair is equivalent
    assert keys(db, a, (rule,)) == keys(db, b, (rule,))
    assert keys(db, a, ()) != keys(db, b, ())                   # ... and only the rule makes it so
    assert keys(db, a) == keys(db, b)                           # all rules together keep it


# Pairs a careless rule would merge; SQLite shows their results differ.
NOT_EQUIVALENT = [
    # an outer join: columns are not equated, COUNT(col) counts only matched rows
    ("SELECT T1.name, count(T2.concert_id) FROM singer AS T1 LEFT JOIN singer_in_concert AS T2 "
     "ON T1.singer_id = T2.singer_id GROUP BY T1.name",
     "SELECT T1.name, count(*) FROM singer AS T1 LEFT JOIN singer_in_concert AS T2 "
     "ON T1.singer_id = T2.singer_id GROUP BY T1.name"),
    # equal under SQLite's affinity (text '1' = integer 1), printed apart: no substitution
    ("SELECT T1.stadium_id FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id",
     "SELECT T2.stadium_id FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id"),
    # DISTINCT that removes rows; DISTINCT under UNION ALL
    ("SELECT DISTINCT country FROM singer", "SELECT country FROM singer"),
    ("SELECT DISTINCT country FROM singer UNION ALL SELECT location FROM stadium",
     "SELECT country FROM singer UNION ALL SELECT location FROM stadium"),
    # COUNT over a key column of an outer join's padded side, and over a nullable column
    ("SELECT count(T2.concert_id) FROM singer AS T1 LEFT JOIN concert AS T2 ON T1.age = T2.concert_id",
     "SELECT count(*) FROM singer AS T1 LEFT JOIN concert AS T2 ON T1.age = T2.concert_id"),
    ("SELECT count(T2.stadium_id) FROM singer AS T1 LEFT JOIN concert AS T2 ON T1.age = T2.concert_id",
     "SELECT count(*) FROM singer AS T1 LEFT JOIN concert AS T2 ON T1.age = T2.concert_id"),
]


@pytest.mark.parametrize("a,b", NOT_EQUIVALENT)
def test_rules_keep_inequivalent_pairs_apart(db, a, b):
    executor = db[0]
    ra, rb = executor.execute(a), executor.execute(b)
    assert ra.ok and rb.ok and ra.rows != rb.rows
    assert keys(db, a) != keys(db, b)


def test_column_order_is_kept_where_the_comparison_sees_it(db):
    a, b = "SELECT name, age FROM singer", "SELECT age, name FROM singer"
    assert keys(db, a, eq.rules_for("spider")) == keys(db, b, eq.rules_for("spider"))
    assert keys(db, a, eq.rules_for("bird")) != keys(db, b, eq.rules_for("bird"))
    assert "select_column_order" not in eq.rules_for("bird")
    # ORDER BY an output column's number: the order is meaningful
    assert keys(db, "SELECT name, age FROM singer ORDER BY 1") != keys(db, "SELECT age, name FROM singer ORDER BY 1")


def test_rules_are_listed_switchable_and_checked():
    assert eq.rule_names() == tuple(r.name for r in eq.RULES) == eq.ALL
    assert all(r.doc for r in eq.RULES)
    with pytest.raises(ValueError, match="unknown equivalence rules"):
        canon.canonicalize("SELECT 1", rules=("no_such_rule",))


def test_facts_come_from_the_sqlite_catalogue(db, tmp_path):
    facts = db[2]
    assert facts.is_not_null("singer", "Singer_ID") and not facts.is_not_null("singer", "age")
    assert facts.primary_key("singer_in_concert") == ("concert_id", "singer_id")
    assert facts.affinity("concert", "stadium_id") == "text" and facts.affinity("stadium", "stadium_id") == "numeric"
    assert eq.SchemaFacts.from_sqlite(tmp_path / "missing.sqlite") == eq.SchemaFacts()


def test_rewritten_spider_dev_golds_return_their_results(spider):
    """Every gold query, canonicalised with all rules and rendered, returns the gold's result."""
    examples = [e for e in json.loads((spider / "dev.json").read_text()) if e["db_id"] != "wta_1"]
    schemas, changed = {}, 0
    with Executors(spider / "database") as executors:
        for e in examples:
            db_id = e["db_id"]
            if db_id not in schemas:
                schemas[db_id] = Schema.from_sqlite(executors.db_path(db_id))
            facts = eq.SchemaFacts.from_sqlite(executors.db_path(db_id))
            plain = canon.canonicalize(e["query"], schemas[db_id], rules=()).tree.sql(dialect="sqlite")
            rewritten = canon.canonicalize(e["query"], schemas[db_id], facts=facts).tree.sql(dialect="sqlite")
            changed += plain != rewritten
            gold = executors.execute(db_id, e["query"])
            assert results_equal(gold, executors.execute(db_id, rewritten), ordered=order_matters(e["query"])), \
                (e["query"], rewritten)
    assert changed > 300        # the rules do rewrite a good share of them
