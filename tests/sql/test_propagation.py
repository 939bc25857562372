"""Reward propagation and tuple margins, against values computed by hand."""
import math

import pytest
from sqlglot import exp

from caper_jax.sql import canonical as canon
from caper_jax.sql import propagation
from caper_jax.sql.clauses import parse_sql
from caper_jax.sql.contract import END_OF_SQL as END
from caper_jax.sql.execution import ExecResult
from caper_jax.sql.mutations import Negative
from caper_jax.sql.tuples import Context, aligned_tuples, mutation_pairs, mutation_rewards, mutation_tuples

SQL = "SELECT T1.name FROM singer AS T1 WHERE T1.age > 20"


def query_and_node(sql: str, find):
    tree = parse_sql(sql)
    query = canon.query_tree(tree)
    return query, canon.find_labelled(query, find(tree))


def literal_20(tree):
    return tree.find(exp.Literal)


def column(name, table=None):
    def find(tree):
        return next(c for c in tree.find_all(exp.Column) if c.name == name and (table is None or c.table == table))
    return find


def test_penalty_decays_along_ancestors():
    alpha, sigma = 2.0, 0.5
    query, v = query_and_node(SQL, literal_20)
    rewards = propagation.node_rewards(query, v, alpha=alpha, sigma=sigma)
    gt, where_node, where_clause = v.parent, v.parent.parent, v.parent.parent.parent
    # d = 0, 1, 2, 3, 4 -> -alpha * exp(-d^2 / (2 sigma^2)) = -2 * exp(-2 d^2)
    assert rewards[id(v)] == pytest.approx(-2.0)
    assert rewards[id(gt)] == pytest.approx(-2.0 * math.exp(-2.0))
    assert rewards[id(where_node)] == pytest.approx(-2.0 * math.exp(-8.0))
    assert rewards[id(where_clause)] == pytest.approx(-2.0 * math.exp(-18.0))
    assert rewards[id(query)] == pytest.approx(-2.0 * math.exp(-32.0))
    sibling = gt.children[0] if gt.children[1] is v else gt.children[1]
    assert id(sibling) not in rewards      # no downward or sideways edges
    assert propagation.clause_rewards(query, v, alpha=alpha, sigma=sigma) == {
        "SELECT": 0.0, "FROM": 0.0, "WHERE": -2.0}


def test_reference_edge_marks_the_table_a_column_reads():
    query, v = query_and_node(SQL, column("name"))
    on = propagation.clause_rewards(query, v, alpha=1.0, sigma=1.0, reference_edges=True)
    off = propagation.clause_rewards(query, v, alpha=1.0, sigma=1.0)     # the paper's rule: ancestors only
    assert on == pytest.approx({"SELECT": -1.0, "FROM": -math.exp(-0.5), "WHERE": 0.0})
    assert off == {"SELECT": -1.0, "FROM": 0.0, "WHERE": 0.0}


def test_correlated_column_reaches_the_outer_table():
    sql = ("SELECT name FROM singer AS T1 WHERE EXISTS "
           "(SELECT 1 FROM concert AS T2 WHERE T2.singer_id = T1.singer_id)")
    query, v = query_and_node(sql, column("singer_id", "T1"))
    rewards = propagation.node_rewards(query, v, alpha=1.0, sigma=1.0, reference_edges=True)
    tables = {n.node.name: n for n in query.preorder() if isinstance(n.node, exp.Table)}
    assert rewards[id(tables["singer"])] == pytest.approx(-math.exp(-0.5))
    assert id(tables["concert"]) not in rewards


def test_unqualified_column_resolves_through_the_schema():
    sql = "SELECT name FROM singer JOIN concert ON singer.singer_id = concert.singer_id"
    schema = {"singer": {"singer_id": "int", "name": "text"}, "concert": {"singer_id": "int", "year": "text"}}
    query, v = query_and_node(sql, column("name"))
    rewards = propagation.node_rewards(query, v, alpha=1.0, sigma=1.0, schema=schema, reference_edges=True)
    tables = {n.node.name: n for n in query.preorder() if isinstance(n.node, exp.Table)}
    assert id(tables["singer"]) in rewards and id(tables["concert"]) not in rewards


def test_bad_parameters_are_refused():
    query, v = query_and_node(SQL, literal_20)
    with pytest.raises(ValueError):
        propagation.node_rewards(query, v, alpha=1.0, sigma=0.0)


def negative(gold: str, sql: str, find, mutation: str) -> Negative:
    tree = parse_sql(sql)
    node = find(tree)
    return Negative(sql=sql, tree=tree, node=node, clause="SELECT" if node.find_ancestor(exp.Where) is None else "WHERE",
                    mutation=mutation, root_node_sql=node.sql(), gold_node_sql="", result=ExecResult())


def test_mutation_tuples_margins_and_floor():
    gold = "SELECT name FROM singer WHERE age > 20"
    neg = negative(gold, "SELECT country FROM singer WHERE age > 20", column("country"), "column")
    # The paper's rule: the penalty stays in v*'s clause.
    assert mutation_rewards(neg, alpha=1.0, sigma=1.0) == {"SELECT": -1.0, "FROM": 0.0, "WHERE": 0.0}
    context = Context("q", "db", "schema", gold)
    tuples = mutation_tuples(context, neg, alpha=1.0, sigma=1.0, margin_floor=0.05)
    assert [(t.clause, t.prefix_chosen, t.chosen, t.prefix_rejected, t.rejected, t.margin) for t in tuples] == [
        ("SELECT", "", "SELECT name", "", "SELECT country", 1.0)]
    assert all(t.provenance == "mutation:column" and t.negative_sql == neg.sql for t in tuples)


def test_reference_edges_give_no_pair_whose_two_clauses_are_equal():
    gold = "SELECT name FROM singer WHERE age > 20"
    neg = negative(gold, "SELECT country FROM singer WHERE age > 20", column("country"), "column")
    assert mutation_rewards(neg, alpha=1.0, sigma=1.0, reference_edges=True) == pytest.approx(
        {"SELECT": -1.0, "FROM": -math.exp(-0.5), "WHERE": 0.0})
    context = Context("q", "db", "schema", gold)
    pairs = mutation_pairs(context, neg, alpha=1.0, sigma=1.0, margin_floor=0.05, reference_edges=True,
                           within_trajectory=True)
    # The FROM pair compares "FROM singer" with "FROM singer" after different SELECTs: dropped, by name.
    dropped = [(p.tuple.clause, p.tuple.chosen, p.tuple.rejected, p.dropped) for p in pairs if p.dropped]
    assert dropped == [("FROM", "FROM singer", "FROM singer", "equal_clause_texts")]
    kept = [p.tuple for p in pairs if p.dropped is None]
    assert [(t.provenance, t.chosen, t.rejected, round(t.margin, 6)) for t in kept] == [
        ("mutation:column", "SELECT name", "SELECT country", 1.0),
        ("within:column", "FROM singer", "SELECT country", round(1 - math.exp(-0.5), 6)),
        ("within:column", "WHERE age > 20" + END, "SELECT country", 1.0)]
    # A floor above exp(-1/2) never reaches the FROM pair at all.
    assert [t.clause for t in mutation_tuples(context, neg, alpha=1.0, sigma=1.0, margin_floor=0.7,
                                              reference_edges=True)] == ["SELECT"]


def test_identical_states_never_become_tuples():
    context = Context("q", "db", "s", "SELECT a FROM t WHERE b = 1")
    # The FROM state is identical on both sides (same prefix, same text): no tuple, whatever its margin.
    tuples = aligned_tuples(context, positive_sql="SELECT a FROM t WHERE b = 1", positive_rewards={},
                            negative_sql="SELECT a FROM t WHERE b = 2",
                            negative_rewards={"FROM": -0.6, "WHERE": -1.0}, margin_floor=0.05,
                            provenance="counterfactual")
    assert [(t.clause, t.rejected, t.margin) for t in tuples] == [("WHERE", "WHERE b = 2" + END, 1.0)]
    with pytest.raises(ValueError):
        aligned_tuples(context, positive_sql="SELECT a FROM t", positive_rewards={}, negative_sql="SELECT b FROM t",
                       negative_rewards={}, margin_floor=0.0, provenance="x")
