"""Fault injection: hand-computed mutants on a tiny database, and verified negatives on Spider dev."""
import json
import random
import sqlite3

import pytest
from sqlglot import exp

from caper_jax.sql.clauses import SqlParseError, clause_of, parse_sql, render_sql, split_clauses
from caper_jax.sql.contract import END_OF_SQL as END
from caper_jax.sql.execution import Executor, Executors, order_matters
from caper_jax.sql import mutations
from caper_jax.sql.mutations import MUTATION_KINDS, RULES, compound_fault, inject_faults
from caper_jax.sql.schema import Schema
from caper_jax.sql.tuples import AnnotationSettings, Context, mutation_rewards, mutation_tuples
from tests.helpers import naive_spider_equal

TINY = """
CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, city TEXT);
CREATE TABLE u (id INTEGER PRIMARY KEY, t_id INTEGER REFERENCES t(id), score REAL);
CREATE TABLE v (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, city TEXT);
INSERT INTO t VALUES (1, 'ann', 25, 'rome'), (2, 'bob', 35, 'oslo'), (3, 'cid', 45, 'lima'),
                     (4, 'ann', 55, 'kiev');
INSERT INTO u VALUES (1, 1, 2.5), (2, 2, 3.5), (3, 2, 4.5);
INSERT INTO v VALUES (1, 'zed', 60, 'paris');
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.sqlite"
    connection = sqlite3.connect(path)
    connection.executescript(TINY)
    connection.commit()
    connection.close()
    with Executor(path) as executor:
        yield executor, Schema.from_sqlite(path), sqlite3.connect(path)


def all_negatives(tiny, sql):
    executor, schema, _ = tiny
    return inject_faults(sql, executor, schema, per_query=1000, rng=random.Random(0), max_attempts=1000)


def test_schema_reads_types_and_keys(tiny):
    _, schema, _ = tiny
    assert [(c.name, c.type, c.primary_key) for c in schema.columns_of("T")] == [
        ("id", "number", True), ("name", "text", False), ("age", "number", False),
        ("city", "text", False)]
    assert schema.column("u", "SCORE").type == "number"
    [key] = schema.foreign_keys
    assert (key.table, key.column, key.ref_table, key.ref_column) == ("u", "t_id", "t", "id")


def test_single_table_query_yields_exactly_the_hand_listed_mutants(tiny):
    sql = "SELECT name FROM t WHERE age > 30 ORDER BY name DESC LIMIT 2"  # gold: cid, bob
    # Every type-preserving single edit, and its rows; "=" marks those equal to gold (dropped).
    candidates = {
        ("column", "SELECT", "city"): "lima, oslo",  # text -> text only
        ("column", "WHERE", "id"): "",  # number -> number only
        ("column", "ORDER BY", "city"): "bob, cid",
        ("comparison", "WHERE", "age = 30"): "",
        ("comparison", "WHERE", "age <> 30"): "=",
        ("comparison", "WHERE", "age < 30"): "ann",
        ("comparison", "WHERE", "age <= 30"): "ann",
        ("comparison", "WHERE", "age >= 30"): "=",
        ("literal", "WHERE", "25"): "=",
        ("literal", "WHERE", "35"): "cid, ann",
        ("literal", "WHERE", "45"): "ann",
        ("literal", "WHERE", "55"): "",
        ("order_direction", "ORDER BY", "name ASC"): "ann, bob",
        ("limit", "LIMIT", "3"): "cid, bob, ann",
        ("limit", "LIMIT", "1"): "cid",
        ("distinct", "SELECT", "DISTINCT"): "=",
        ("table", "FROM", "v AS t"): "zed",
    }
    got = {(n.mutation, n.clause, n.root_node_sql) for n in all_negatives(tiny, sql)}
    assert got == {key for key, rows in candidates.items() if rows != "="}


def test_join_query_mutates_join_keys_aggregates_and_connectives(tiny):
    sql = ("SELECT T1.name, max(T2.score) FROM t AS T1 JOIN u AS T2 ON T1.id = T2.t_id "
           "WHERE T1.city = \"oslo\" OR T1.age < 30 GROUP BY T1.name")
    got = {(n.mutation, n.clause, n.root_node_sql) for n in all_negatives(tiny, sql)}
    assert {("aggregate", "SELECT", "MIN(T2.score)"), ("aggregate", "SELECT", "AVG(T2.score)"),
            ("aggregate", "SELECT", "SUM(T2.score)"),
            ("and_or", "WHERE", 'T1.city = "oslo" AND T1.age < 30'),
            ("literal", "WHERE", "'rome'"),  # the double-quoted "oslo" is a value, not a column
            ("join_key", "FROM", "T2.score"), ("join_key", "FROM", "T2.id")} <= got
    join_keys = {text for kind, _, text in got if kind == "join_key"}
    assert join_keys <= {"T1.age", "T2.id", "T2.score"}  # same table, same type class
    assert not {kind for kind, _, _ in got} - set(MUTATION_KINDS)


def test_rules_put_each_edit_site_where_the_catalogue_says(tiny):
    executor, schema, _ = tiny
    sql = ("SELECT DISTINCT T1.name, count(DISTINCT T2.score) FROM t AS T1 JOIN u AS T2 ON T1.id = T2.t_id "
           "WHERE T1.city = \"oslo\" AND T1.age > -5 GROUP BY T1.name ORDER BY 1 LIMIT 3")
    tree = parse_sql(sql)
    sites = mutations._Sites(tree, schema, executor, random.Random(0))
    claimed = [(rule.kind, rule.site(node)) for node in tree.walk() for rule in RULES if rule.applies(sites, node)]
    assert len({id(site) for _, site in claimed}) == len(claimed)  # no node is the site of two rules
    found = [(kind, "<the SELECT>" if isinstance(site, exp.Select) else render_sql(site)) for kind, site in claimed]
    # By hand: the ON equality is no comparison site and its columns are join keys; "oslo" names no
    # column, so it is a value; -5 is edited as a whole; ORDER BY 1 is a position and LIMIT 3 is the
    # limit's own, so neither is a literal; COUNT is no numeric aggregate but its DISTINCT toggles.
    assert sorted(found) == sorted([
        ("column", "T1.name"), ("column", "T2.score"), ("column", "T1.city"), ("column", "T1.age"),
        ("column", "T1.name"), ("join_key", "T1.id"), ("join_key", "T2.t_id"),
        ("comparison", 'T1.city = "oslo"'), ("comparison", "T1.age > -5"),
        ("literal", '"oslo"'), ("literal", "-5"), ("and_or", 'T1.city = "oslo" AND T1.age > -5'),
        ("order_direction", "1"), ("limit", "LIMIT 3"),
        ("distinct", "COUNT(DISTINCT T2.score)"), ("distinct", "<the SELECT>"),
        ("table", "t AS T1"), ("table", "u AS T2")])
    # The walk records the same sites; MUTATION_KINDS is the rules' kinds in rule order (the order
    # the random draws depend on).
    assert sorted(kind for _, kind, _ in sites.sites) == sorted(kind for kind, _ in found)
    assert MUTATION_KINDS == ("column", "join_key", "comparison", "aggregate", "literal", "and_or",
                              "order_direction", "limit", "distinct", "table")


def test_negatives_are_consistent_and_reproducible(tiny):
    executor, schema, connection = tiny
    sql = "SELECT count(DISTINCT city) FROM t WHERE name != 'bob' AND age BETWEEN 20 AND 50"
    first = inject_faults(sql, executor, schema, 5, random.Random(7))
    second = inject_faults(sql, executor, schema, 5, random.Random(7))
    assert [n.sql for n in first] == [n.sql for n in second] and len(first) == 5
    gold = connection.execute(sql).fetchall()
    for negative in first:
        assert parse_sql(negative.sql) == negative.tree
        node = negative.node  # a SELECT when DISTINCT was removed: its clause is its projections'
        assert clause_of(node.expressions[0] if isinstance(node, exp.Select) else node) == negative.clause
        assert negative.clause in {u.name for u in split_clauses(negative.sql)}
        assert connection.execute(negative.sql).fetchall() != gold


def test_compound_faults_add_one_later_fault_and_keep_the_first_as_root(tiny):
    executor, schema, connection = tiny
    sql = "SELECT name FROM t WHERE age > 30 ORDER BY name DESC LIMIT 2"
    gold = executor.execute(sql)
    order = ["SELECT", "FROM", "WHERE", "ORDER BY", "LIMIT"]
    found = 0
    for seed, first in enumerate(all_negatives(tiny, sql)):
        double = compound_fault(first, gold, executor, schema, random.Random(seed), ordered=True, max_attempts=50)
        # By hand: nothing is written after LIMIT; after WHERE and ORDER BY only ORDER BY and LIMIT
        # follow, which cannot change an empty or one-row result; SELECT and FROM have WHERE after them.
        first_rows = connection.execute(first.sql).fetchall()
        can_change = first.clause in ("SELECT", "FROM") or (first.clause != "LIMIT" and len(first_rows) >= 2)
        assert (double is not None) == can_change, (first.sql, double and double.sql)
        if double is None:
            continue
        found += 1
        first_kind, second_kind = double.mutation.split("+")
        assert first_kind == first.mutation and second_kind in MUTATION_KINDS
        assert (double.clause, double.root_node_sql) == (first.clause, first.root_node_sql)
        node = double.node
        assert (render_sql(node) if not isinstance(node, exp.Select) else "") == first.root_node_sql
        # Exactly one clause differs from the single fault's, and it is written after the root's.
        before = {u.name: u.text for u in split_clauses(first.sql)}
        after = {u.name: u.text for u in split_clauses(double.sql)}
        changed = [name for name in after if after[name] != before.get(name)]
        assert len(changed) == 1 and order.index(changed[0]) > order.index(first.clause), (first.sql, double.sql)
        rows = connection.execute(double.sql).fetchall()
        assert rows != connection.execute(sql).fetchall() and rows != connection.execute(first.sql).fetchall()
        # Propagation starts at the first fault: its clause alone carries -alpha, the later fault less.
        rewards = mutation_rewards(double, alpha=1.0, sigma=1.0, schema=schema)
        assert rewards[first.clause] == -1.0 and rewards.get(changed[0], 0.0) > -1.0
        # ...so the within-trajectory tuples prefer the wrong later clause to the root clause.
        tuples = mutation_tuples(Context("q", "tiny", "schema", sql), double, alpha=1.0, sigma=1.0,
                                 margin_floor=0.05, schema=schema, within_trajectory=True)
        within = {(t.chosen, t.rejected) for t in tuples if t.provenance.startswith("within:")}
        last = list(after)[-1]          # the last clause is written with the end of the query

        def state(name):
            return after[name] + (END if name == last else "")
        assert (state(changed[0]), state(first.clause)) in within or rewards.get(changed[0], 0.0) < -0.95
    assert found == 5


def test_inject_faults_appends_compound_faults_reproducibly(tiny):
    executor, schema, _ = tiny
    sql = "SELECT name, age FROM t WHERE city != 'oslo' AND age > 20 ORDER BY age DESC"
    first = inject_faults(sql, executor, schema, 4, random.Random(3), compound=2)
    second = inject_faults(sql, executor, schema, 4, random.Random(3), compound=2)
    assert [n.sql for n in first] == [n.sql for n in second]
    singles = [n for n in first if "+" not in n.mutation]
    doubles = [n for n in first if "+" in n.mutation]
    assert len(singles) == 4 and 1 <= len(doubles) <= 2 and first[:4] == singles   # appended after the singles
    plain = inject_faults(sql, executor, schema, 4, random.Random(3))
    assert [n.sql for n in plain] == [n.sql for n in singles]          # the single faults are unchanged
    assert all(d.mutation.split("+")[0] in {n.mutation for n in singles} for d in doubles)
    with pytest.raises(ValueError, match="compound"):
        inject_faults(sql, executor, schema, 4, random.Random(3), compound=-1)
    with pytest.raises(ValueError, match="compound"):
        AnnotationSettings(per_query=2, compound=3)


def test_clause_balance_spreads_a_querys_negatives_over_its_clauses(tiny):
    """WHERE holds most edit sites here (3 conditions); kind-balanced order follows them, clause-balanced
    order takes SELECT, FROM, WHERE and ORDER BY in turn (each site gives up to 2 alternatives)."""
    executor, schema, _ = tiny
    sql = "SELECT name, age FROM t WHERE city != 'oslo' AND age > 20 AND name != 'bob' ORDER BY age DESC"
    spread = {}
    for balance in ("kind", "clause"):
        spread[balance] = [len({n.clause for n in inject_faults(sql, executor, schema, 4, random.Random(seed),
                                                                  balance=balance)}) for seed in range(20)]
    assert min(spread["clause"]) >= 3 and sum(spread["clause"]) / 20 >= 3.5
    assert sum(spread["kind"]) / 20 <= 2.5 and min(spread["kind"]) == 1
    # Same negatives for the same seed; the default is the kind order.
    assert [n.sql for n in inject_faults(sql, executor, schema, 4, random.Random(1))] == \
        [n.sql for n in inject_faults(sql, executor, schema, 4, random.Random(1), balance="kind")]
    with pytest.raises(ValueError, match="balance"):
        inject_faults(sql, executor, schema, 4, random.Random(1), balance="node")
    with pytest.raises(ValueError, match="site_balance"):
        AnnotationSettings(site_balance="node")


def test_bad_input(tiny):
    executor, schema, _ = tiny
    with pytest.raises(SqlParseError):
        inject_faults("SELECT FROM WHERE", executor, schema, 1, random.Random(0))
    with pytest.raises(ValueError):
        inject_faults("SELECT name FROM t", executor, schema, -1, random.Random(0))
    assert inject_faults("SELECT nope FROM t", executor, schema, 3, random.Random(0)) == []


def test_spider_dev_negatives_are_verified_and_cover_95_percent(spider):
    """per_query=1 over every dev gold query with a database; each negative re-executed on a
    plain sqlite3 connection differs from gold under a brute-force Spider comparison."""
    examples = json.loads((spider / "dev.json").read_text())
    executors = Executors(spider / "database")
    references, schemas = {}, {}
    rng = random.Random(0)
    covered = total = 0
    for example in examples:
        db_id, sql = example["db_id"], example["query"]
        path = executors.db_path(db_id)
        if not path.exists():
            continue
        total += 1
        if db_id not in schemas:
            schemas[db_id] = Schema.from_sqlite(path)
            references[db_id] = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
            references[db_id].text_factory = lambda b: b.decode("utf-8", errors="replace")
        schema, reference = schemas[db_id], references[db_id]
        negatives = inject_faults(sql, executors[db_id], schema, 1, rng)
        covered += bool(negatives)
        for negative in negatives:
            gold_rows = tuple(reference.execute(sql).fetchall())
            negative_rows = tuple(reference.execute(negative.sql).fetchall())
            assert not naive_spider_equal(gold_rows, negative_rows, order_matters(sql)), negative.sql
            assert negative.mutation in MUTATION_KINDS
    executors.close()
    assert total > 900
    assert covered / total >= 0.95, (covered, total)
