"""Canonical forms and minimum edit scripts.

References: hand-written surface rewrites (must compare equal) and real changes (must not); the
naive Zhang–Shasha recurrence on forests for edit-distance minimality.
"""
import functools
import random
import sys

import pytest

from caper_jax.sql import canonical as canon
from caper_jax.sql.canonical import LabelledNode
from caper_jax.sql.edit_script import edit_script, tree_edit_distance

SCHEMA = {
    "singer": {"singer_id": "int", "name": "text", "age": "int", "country": "text"},
    "concert": {"concert_id": "int", "singer_id": "int", "year": "text", "stadium_id": "int"},
    "stadium": {"stadium_id": "int", "name": "text", "capacity": "int"},
}


def clause_keys(sql: str) -> list[tuple[str, tuple]]:
    tree = canon.canonicalize(sql, SCHEMA).tree
    return [(slot.name, canon.canonical_key(slot)) for slot in canon.clause_slots(tree)]


SURFACE_PAIRS = [
    # aliases and qualification
    ("SELECT T1.name FROM singer AS T1 WHERE T1.age > 20", "SELECT name FROM singer WHERE age > 20"),
    ("SELECT s.name FROM singer s", "SELECT singer.name FROM singer"),
    # commuted conjuncts, redundant parentheses, flipped comparison
    ("SELECT name FROM singer WHERE age > 20 AND country = 'France'",
     "SELECT name FROM singer WHERE (country = 'France') AND (20 < age)"),
    ("SELECT name FROM singer WHERE (age > 20 OR age < 5) AND country = 'x'",
     "SELECT name FROM singer WHERE country = 'x' AND (age < 5 OR age > 20)"),
    # != and <>, keyword and identifier case
    ("SELECT name FROM singer WHERE age != 3", "select NAME from SINGER where AGE <> 3"),
    # Spider's double-quoted strings
    ('SELECT name FROM singer WHERE country = "France"', "SELECT name FROM singer WHERE country = 'France'"),
    # inner join order and ON operand order
    ("SELECT T1.name FROM singer AS T1 JOIN concert AS T2 ON T1.singer_id = T2.singer_id",
     "SELECT singer.name FROM concert JOIN singer ON singer.singer_id = concert.singer_id"),
    ("SELECT T3.name FROM singer AS T1 JOIN concert AS T2 ON T1.singer_id = T2.singer_id "
     "JOIN stadium AS T3 ON T2.stadium_id = T3.stadium_id",
     "SELECT c.name FROM stadium c JOIN concert b ON b.stadium_id = c.stadium_id "
     "JOIN singer a ON a.singer_id = b.singer_id"),
    # projection aliases and ORDER BY references to them
    ("SELECT country, count(*) AS n FROM singer GROUP BY country ORDER BY n DESC",
     "SELECT country, COUNT(*) FROM singer GROUP BY country ORDER BY COUNT(*) DESC"),
    # explicit ASC, numeric literal spelling
    ("SELECT name FROM singer ORDER BY age", "SELECT name FROM singer ORDER BY age ASC"),
    ("SELECT name FROM singer WHERE age > 20", "SELECT name FROM singer WHERE age > 20.0"),
    # subqueries, correlated or not
    ("SELECT name FROM singer WHERE singer_id IN (SELECT T2.singer_id FROM concert AS T2)",
     "SELECT s.name FROM singer AS s WHERE s.singer_id IN (SELECT singer_id FROM concert)"),
]


@pytest.mark.parametrize("a,b", SURFACE_PAIRS)
def test_surface_differences_compare_equal(a, b):
    assert clause_keys(a) == clause_keys(b)


REAL_CHANGES = [  # (a, b, the clause that differs)
    ("SELECT name FROM singer ORDER BY age DESC", "SELECT name FROM singer ORDER BY age", "ORDER BY"),
    ("SELECT DISTINCT name FROM singer", "SELECT name FROM singer", "SELECT"),
    ("SELECT T1.name FROM singer AS T1 LEFT JOIN concert AS T2 ON T1.singer_id = T2.singer_id",
     "SELECT T1.name FROM singer AS T1 JOIN concert AS T2 ON T1.singer_id = T2.singer_id", "FROM"),
    ("SELECT name FROM singer WHERE age >= 20", "SELECT name FROM singer WHERE age > 20", "WHERE"),
    ("SELECT name FROM singer WHERE age > 21", "SELECT name FROM singer WHERE age > 20", "WHERE"),
    ("SELECT name FROM singer WHERE country = 'france'", "SELECT name FROM singer WHERE country = 'France'", "WHERE"),
    # precedence: a AND (b OR c) is not (a AND b) OR c
    ("SELECT name FROM singer WHERE age > 1 AND (age < 5 OR country = 'x')",
     "SELECT name FROM singer WHERE (age > 1 AND age < 5) OR country = 'x'", "WHERE"),
    ("SELECT name FROM singer WHERE age > 1 AND age < 5", "SELECT name FROM singer WHERE age > 1 OR age < 5", "WHERE"),
    ("SELECT max(age) FROM singer", "SELECT min(age) FROM singer", "SELECT"),
    ("SELECT name FROM singer LIMIT 3", "SELECT name FROM singer LIMIT 1", "LIMIT"),
    ("SELECT name FROM singer UNION SELECT name FROM stadium",
     "SELECT name FROM singer UNION ALL SELECT name FROM stadium", None),
]


@pytest.mark.parametrize("a,b,clause", REAL_CHANGES)
def test_real_differences_compare_unequal(a, b, clause):
    ka, kb = dict(clause_keys(a)), dict(clause_keys(b))
    differing = sorted(set(ka) ^ set(kb) | {n for n in set(ka) & set(kb) if ka[n] != kb[n]})
    assert differing == ([clause] if clause else ["UNION", "UNION ALL"])


def test_clause_slots_follow_split_clauses_names():
    from caper_jax.sql.clauses import split_clauses
    sql = ("SELECT name FROM singer WHERE age > 1 GROUP BY name HAVING count(*) > 1 "
           "UNION SELECT name FROM stadium ORDER BY name LIMIT 2")
    assert [s.name for s in canon.clause_slots(canon.parse(sql))] == [u.name for u in split_clauses(sql)]


def test_unparseable_sql_raises_typed_error():
    with pytest.raises(canon.CanonicalizeError):
        canon.canonicalize("SELECT name FROM singer WHERE age >", SCHEMA)
    with pytest.raises(canon.CanonicalizeError):
        canon.canonicalize("SELECT 1; SELECT 2", SCHEMA)


def test_unknown_column_still_canonicalises():
    canonical = canon.canonicalize("SELECT nme FROM singer AS T1", SCHEMA)
    assert canonical.tree.sql() == "SELECT nme FROM singer"


# ---------------------------------------------------------------------------------------------
# Edit scripts


def tree(label: str, *children: LabelledNode) -> LabelledNode:
    node = LabelledNode(label, list(children), None)
    for c in children:
        c.parent = node
    return node


def as_tuple(node: LabelledNode) -> tuple:
    return (node.label, tuple(as_tuple(c) for c in node.children))


def naive_distance(a: tuple, b: tuple) -> int:
    """Zhang–Shasha forest recurrence, memoised, no keyroots: exponential-free for tiny trees."""
    def size(forest):
        return sum(1 + size(t[1]) for t in forest)

    @functools.lru_cache(maxsize=None)
    def forest(f, g):
        if not f:
            return size(g)
        if not g:
            return size(f)
        (lv, cv), (lw, cw) = f[-1], g[-1]
        return min(forest(f[:-1] + cv, g) + 1,
                   forest(f, g[:-1] + cw) + 1,
                   forest(cv, cw) + forest(f[:-1], g[:-1]) + (lv != lw))
    return forest((a,), (b,))


def random_tree(rng: random.Random, budget: int) -> LabelledNode:
    label = rng.choice("abc")
    children = []
    budget -= 1
    while budget > 0 and rng.random() < 0.6:
        take = rng.randint(1, budget)
        children.append(random_tree(rng, take))
        budget -= take
    return tree(label, *children)


def test_edit_distance_is_minimal_against_naive_recurrence():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)   # the naive recurrence recurses deeply; restored for the tests after this one
    try:
        _check_edit_distances_against_naive_recurrence()
    finally:
        sys.setrecursionlimit(limit)


def _check_edit_distances_against_naive_recurrence():
    rng = random.Random(0)
    for _ in range(150):
        a, b = random_tree(rng, rng.randint(1, 7)), random_tree(rng, rng.randint(1, 7))
        expected = naive_distance(as_tuple(a), as_tuple(b))
        script = edit_script(a, b)
        assert script.cost == expected == tree_edit_distance(a, b)
        assert len(script.ops) == expected    # unit costs: one op per unit of cost


def test_edit_distance_on_sql_clauses_matches_naive_recurrence():
    pairs = [("SELECT name FROM singer WHERE age > 20 AND country = 'x'",
              "SELECT name FROM singer WHERE age < 20 OR country = 'y'"),
             ("SELECT name FROM singer ORDER BY age DESC, name", "SELECT name FROM singer ORDER BY name"),
             ("SELECT count(DISTINCT name), max(age) FROM singer", "SELECT count(name) FROM singer")]
    for a, b in pairs:
        for sa, sb in zip(canon.clause_slots(canon.canonicalize(a, SCHEMA).tree),
                          canon.clause_slots(canon.canonicalize(b, SCHEMA).tree)):
            ta, tb = canon.clause_tree(sa), canon.clause_tree(sb)
            assert edit_script(ta, tb).cost == naive_distance(as_tuple(ta), as_tuple(tb))


@pytest.mark.parametrize("a,b,source,target", [
    ("SELECT name FROM singer ORDER BY age DESC", "SELECT name FROM singer ORDER BY age", "Ordered[desc]", "Ordered"),
    ("SELECT name FROM singer WHERE age > 20", "SELECT name FROM singer WHERE age >= 20", "GT", "GTE"),
    ("SELECT name FROM singer WHERE age > 20", "SELECT name FROM singer WHERE age > 30", "Literal:20", "Literal:30"),
    # (an inner join has the order-free set form, so LEFT vs inner changes shape, not one label)
    ("SELECT T1.name FROM singer AS T1 LEFT JOIN concert AS T2 ON T1.singer_id = T2.singer_id",
     "SELECT T1.name FROM singer AS T1 RIGHT JOIN concert AS T2 ON T1.singer_id = T2.singer_id",
     "Join[side=LEFT]", "Join[side=RIGHT]"),
    ("SELECT DISTINCT name FROM singer", "SELECT name FROM singer", "Distinct", None),
])
def test_non_expression_arguments_cost_one_relabel(a, b, source, target):
    ca, cb = canon.canonicalize(a, SCHEMA), canon.canonicalize(b, SCHEMA)
    ops = []
    for sa, sb in zip(canon.clause_slots(ca.tree), canon.clause_slots(cb.tree)):
        ops += edit_script(canon.clause_tree(sa), canon.clause_tree(sb)).ops
    expected = ("relabel", source, target) if target else ("delete", source, None)
    assert [(op.op, op.source, op.target) for op in ops] == [expected]


def test_root_cause_is_highest_then_leftmost_edited_node():
    # b(x, y) -> b(x', z(y)): edits touch x (relabel) and b (insertion of z hangs from b): v* = b.
    source = tree("a", tree("b", tree("x"), tree("y")), tree("c"))
    target = tree("a", tree("b", tree("q"), tree("z", tree("y"))), tree("c"))
    script = edit_script(source, target)
    assert script.cost == 2
    assert script.root_cause is source.children[0]
    # Two independent relabels: the first in pre-order wins.
    source = tree("r", tree("p"), tree("q"))
    script = edit_script(source, tree("r", tree("P"), tree("Q")))
    assert script.root_cause is source.children[0]
    assert edit_script(source, tree("r", tree("p"), tree("q"))).root_cause is None


def test_a_comment_after_the_final_semicolon_is_not_a_second_statement():
    # sqlglot parses the trailer as a bare Semicolon; SQLite runs the query.
    assert canon.parse("SELECT name FROM singer; -- done").sql() == canon.parse("SELECT name FROM singer").sql()
    with pytest.raises(canon.CanonicalizeError):
        canon.parse("SELECT 1; SELECT 2")


def test_a_schema_and_its_mapping_qualify_alike_and_the_shared_schema_stays_unchanged(spider):
    """canonicalize builds sqlglot's schema of a ``Schema`` once and shares it between queries; a mapping
    gets a fresh one per query. Without the equivalence rules (which the two forms feed different facts)
    both give the same canonical SQL for every dev gold of four databases, and a second pass over the
    same queries gives the first pass's SQL: no query leaves a mark on the shared schema."""
    import json

    from caper_jax.sql.schema import Schema

    dev = json.loads((spider / "dev.json").read_text())
    for db_id in ("car_1", "dog_kennels", "flight_2", "concert_singer"):
        schema = Schema.from_sqlite(spider / "database" / db_id / f"{db_id}.sqlite")
        mapping = {t: {c.name: c.type for c in schema.columns_of(t)} for t in schema.tables}
        golds = [e["query"] for e in dev if e["db_id"] == db_id]
        shared = [canon.canonicalize(g, schema, rules=()).tree.sql() for g in golds]
        assert shared == [canon.canonicalize(g, mapping, rules=()).tree.sql() for g in golds], db_id
        assert shared == [canon.canonicalize(g, schema, rules=()).tree.sql() for g in reversed(golds)][::-1], db_id
