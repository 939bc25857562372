"""Clause units: exact spans on the original text, written order, AST agreement, typed errors."""
import json
import random
import re

import pytest
from sqlglot import exp

from caper_jax.sql.clauses import SqlParseError, clause_of, clone_tree, parse_sql, render_sql, split_clauses
from caper_jax.sql.contract import CLAUSE_NAMES, COMPOUND_NAMES
from caper_jax.sql.execution import Executors, order_matters, results_equal


def spider_examples(spider) -> list[dict]:
    examples = json.loads((spider / "dev.json").read_text())
    present = {p.name for p in (spider / "database").iterdir()}
    return [e for e in examples if e["db_id"] in present]


def spider_queries(spider) -> list[str]:
    return [e["query"] for e in spider_examples(spider)]


def assert_reassembles(sql: str, units) -> None:
    position = 0
    for unit in units:
        assert unit.start >= position
        assert re.fullmatch(r"\s*", sql[position:unit.start]), (sql, unit)
        assert sql[unit.start:unit.end] == unit.text
        position = unit.end
    assert re.fullmatch(r"[\s;]*", sql[position:]), sql


def test_spans_are_exact_on_odd_whitespace_and_case():
    sql = "  sElEcT  name ,\n\tcount(*)\nFROM   singer AS T1 JOIN concert AS T2 ON T1.id=T2.id\n" \
          "wHeRe age>(SELECT avg(age) FROM singer)   group  BY name HAVING count(*) >= 2\n" \
          "order by  name DESC limit 3 OFFSET 1 ;  "
    units = split_clauses(sql)
    assert [u.name for u in units] == list(CLAUSE_NAMES)
    assert [u.text for u in units] == [
        "sElEcT  name ,\n\tcount(*)",
        "FROM   singer AS T1 JOIN concert AS T2 ON T1.id=T2.id",
        "wHeRe age>(SELECT avg(age) FROM singer)",
        "group  BY name",
        "HAVING count(*) >= 2",
        "order by  name DESC",
        "limit 3 OFFSET 1",
    ]
    assert_reassembles(sql, units)


def test_compound_operator_units_cover_the_right_query_and_tail_orders_the_result():
    sql = "SELECT a FROM t WHERE a > 1 UNION ALL SELECT b FROM u EXCEPT SELECT c FROM v ORDER BY 1 LIMIT 2"
    units = split_clauses(sql)
    assert [(u.name, u.text) for u in units] == [
        ("SELECT", "SELECT a"), ("FROM", "FROM t"), ("WHERE", "WHERE a > 1"),
        ("UNION ALL", "UNION ALL SELECT b FROM u"), ("EXCEPT", "EXCEPT SELECT c FROM v"),
        ("ORDER BY", "ORDER BY 1"), ("LIMIT", "LIMIT 2")]
    assert units[3].node == parse_sql("SELECT b FROM u")
    assert units[4].node == parse_sql("SELECT c FROM v")


def test_cte_is_one_unit_and_subqueries_stay_in_their_clause():
    sql = "WITH x AS (SELECT a FROM t WHERE a > 1) SELECT a FROM x WHERE a IN (SELECT b FROM u GROUP BY b)"
    units = split_clauses(sql)
    assert [u.name for u in units] == ["WITH", "SELECT", "FROM", "WHERE"]
    assert units[0].text == "WITH x AS (SELECT a FROM t WHERE a > 1)"
    assert isinstance(units[0].node, exp.With)
    assert units[3].text == "WHERE a IN (SELECT b FROM u GROUP BY b)"


def test_is_distinct_from_is_not_a_from_clause():
    units = split_clauses("SELECT a FROM t WHERE a IS NOT DISTINCT FROM 3")
    assert [u.name for u in units] == ["SELECT", "FROM", "WHERE"]


def test_nodes_hold_exactly_their_clause():
    units = split_clauses("SELECT DISTINCT a FROM t JOIN u ON t.k = u.k WHERE a = 'x' ORDER BY a DESC")
    by_name = {u.name: u.node for u in units}
    assert by_name["SELECT"].sql() == "SELECT DISTINCT a"
    assert by_name["FROM"].args["from_"].sql() == "FROM t"
    assert [j.sql() for j in by_name["FROM"].args["joins"]] == ["JOIN u ON t.k = u.k"]
    assert by_name["WHERE"].args["where"].sql() == "WHERE a = 'x'"
    assert by_name["ORDER BY"].args["order"].sql() == "ORDER BY a DESC"
    assert all(u.node.parent is None for u in units)  # detached


@pytest.mark.parametrize("bad", ["", "   ", "SELEC a FROM t", "SELECT a FROM t; SELECT b FROM u",
                                 "DROP TABLE t", "SELECT (a FROM t"])
def test_bad_sql_raises_typed_error(bad):
    with pytest.raises(SqlParseError):
        split_clauses(bad)
    with pytest.raises(SqlParseError):
        split_clauses(bad, nodes=False)


def test_units_without_nodes_are_the_same_units(spider):
    for sql in spider_queries(spider) + ["WITH x AS (SELECT 1) SELECT * FROM x",
                                         "SELECT a FROM t EXCEPT SELECT b FROM u UNION SELECT c FROM v ORDER BY 1"]:
        spans = [(u.name, u.start, u.end, u.text) for u in split_clauses(sql)]
        assert [(u.name, u.start, u.end, u.text) for u in split_clauses(sql, nodes=False)] == spans, sql
        assert all(u.node is None for u in split_clauses(sql, nodes=False))


def test_every_spider_dev_gold_query_splits_in_written_order(spider):
    queries = spider_queries(spider)
    assert len(queries) > 900
    rank = {name: i for i, name in enumerate(CLAUSE_NAMES)}
    for sql in queries:
        units = split_clauses(sql)
        assert_reassembles(sql, units)
        for unit in units:
            assert " ".join(unit.text.upper().split()).startswith(unit.name), (sql, unit.name)
        names = [u.name for u in units]
        compound = [i for i, name in enumerate(names) if name in COMPOUND_NAMES]
        head = names[:compound[0]] if compound else names
        tail = names[compound[-1] + 1:] if compound else []
        assert head[0] == "SELECT"
        assert [rank[n] for n in head] == sorted(rank[n] for n in set(head)), sql
        assert tail in ([], ["ORDER BY"], ["LIMIT"], ["ORDER BY", "LIMIT"]), sql
        assert all(n in COMPOUND_NAMES for n in names[len(head):len(names) - len(tail)]), sql


def test_clause_of_agrees_with_spans_on_spider_dev(spider):
    """Every identifier/literal of the full tree lies in the unit whose span holds its token."""
    checked = 0
    for sql in spider_queries(spider):
        units = split_clauses(sql)
        tree = parse_sql(sql)
        for node in tree.find_all(exp.Identifier, exp.Literal):
            start = node.meta.get("start")
            if start is None:
                continue
            containing = [u.name for u in units if u.start <= start < u.end]
            assert containing == [clause_of(node)], (sql, node.sql())
            checked += 1
    assert checked > 5000


def test_rendering_leaves_the_tree_alone_and_keeps_the_result(spider):
    """render_sql skips sqlglot's defensive copy: it must not rewrite parsed trees."""
    executors = Executors(spider / "database")
    for example in spider_examples(spider):
        tree = parse_sql(example["query"])
        before = tree.copy()
        text = render_sql(tree)
        assert tree == before
        assert parse_sql(text) == tree, (example["query"], text)
        gold = executors.execute(example["db_id"], example["query"])
        assert results_equal(gold, executors.execute(example["db_id"], text), semantics="spider",
                             ordered=order_matters(example["query"])), text
    executors.close()


def test_nested_units_follow_their_holder_with_depth():
    sql = ("SELECT a FROM t WHERE a IN (SELECT b FROM (select c from v where c>1) AS x GROUP BY b) "
           "AND EXISTS (SELECT 1 FROM u) ORDER BY a")
    units = split_clauses(sql, nested=True)
    assert [(u.depth, u.name, u.text) for u in units] == [
        (0, "SELECT", "SELECT a"), (0, "FROM", "FROM t"),
        (0, "WHERE", "WHERE a IN (SELECT b FROM (select c from v where c>1) AS x GROUP BY b) "
                     "AND EXISTS (SELECT 1 FROM u)"),
        (1, "SELECT", "SELECT b"), (1, "FROM", "FROM (select c from v where c>1) AS x"),
        (2, "SELECT", "select c"), (2, "FROM", "from v"), (2, "WHERE", "where c>1"),
        (1, "GROUP BY", "GROUP BY b"), (1, "SELECT", "SELECT 1"), (1, "FROM", "FROM u"),
        (0, "ORDER BY", "ORDER BY a")]
    assert all(sql[u.start:u.end] == u.text for u in units)


def test_nested_units_on_spider_dev_keep_top_level_units_and_exact_spans(spider):
    nested_queries = 0
    for sql in spider_queries(spider):
        top = split_clauses(sql)
        units = split_clauses(sql, nested=True)
        assert [u for u in units if u.depth == 0] == top
        assert all(sql[u.start:u.end] == u.text for u in units)
        for holder, unit in zip(units, units[1:]):
            if unit.depth > holder.depth:  # first unit of a subquery lies inside its holder
                assert unit.depth == holder.depth + 1 and holder.start < unit.start < holder.end
        nested_queries += any(u.depth for u in units)
    assert nested_queries > 50  # 83 of the dev queries have subqueries


def test_clone_tree_is_an_independent_equal_copy(spider):
    for sql in spider_queries(spider):
        tree = parse_sql(sql)
        clone = clone_tree(tree)
        assert clone == tree and clone is not tree
        for original, copied in zip(tree.walk(), clone.walk()):
            assert copied is not original
            assert (copied.parent is None) == (original.parent is None)
            assert copied.arg_key == original.arg_key
        assert render_sql(clone) == render_sql(tree)


_QUOTED = re.compile(r"('[^']*'|\"[^\"]*\")")
_KEYWORDS = re.compile(r"\b(select|from|where|group|by|having|order|limit|join|on|union|intersect|except|"
                       r"and|or|as|desc|asc|distinct|count|not|in)\b", re.IGNORECASE)


def perturb(sql: str, rng: random.Random) -> str:
    """Random whitespace runs and keyword case outside quotes; the query means the same."""
    parts = _QUOTED.split(sql)
    for i in range(0, len(parts), 2):
        part = re.sub(r"\s+", lambda m: "".join(rng.choice(" \t\n") for _ in range(rng.randint(1, 3))),
                      parts[i])
        parts[i] = _KEYWORDS.sub(lambda m: "".join(c.upper() if rng.random() < 0.5 else c.lower()
                                                   for c in m.group(0)), part)
    return "".join(parts)


def test_spans_stay_exact_under_random_whitespace_and_case(spider):
    rng = random.Random(0)
    for sql in spider_queries(spider):
        noisy = perturb(sql, rng)
        original, units = split_clauses(sql), split_clauses(noisy)
        assert [u.name for u in units] == [u.name for u in original]
        assert_reassembles(noisy, units)
        for unit, reference in zip(units, original):
            assert " ".join(unit.text.lower().split()) == " ".join(reference.text.lower().split())


def test_sql_nested_too_deeply_is_a_parse_error_not_a_recursion_error():
    """sqlglot recurses once per nesting level: 3,000 parentheses in a candidate raised RecursionError
    through ``verify`` (rerank and localize), which stopped the whole run with a traceback."""
    import sys

    from caper_jax.sql import canonical

    deep = "SELECT " + "(" * 3000 + "name" + ")" * 3000 + " FROM singer"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)   # Python's default (test_canonical raises it for the whole process)
    try:
        with pytest.raises(SqlParseError, match="nested too deeply"):
            split_clauses(deep)
        with pytest.raises(canonical.CanonicalizeError, match="nested too deeply"):
            canonical.parse(deep)
    finally:
        sys.setrecursionlimit(limit)
    assert [u.name for u in split_clauses("SELECT " + "(" * 50 + "name" + ")" * 50 + " FROM singer")] == ["SELECT", "FROM"]
