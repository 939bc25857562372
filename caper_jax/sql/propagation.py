"""Reward propagation from a root-cause node v* to clause rewards, in the clauses as written.

    r(v*) = -alpha
    r(u)  = -alpha * exp(-d(u)^2 / (2 sigma^2))   for u on v*'s dependency path, d(u) its distance
    r(u)  = 0                                      elsewhere
    r(clause) = min over the nodes written in the clause of r(u)

The dependency path is what v* feeds into or reads from, found by breadth-first search on the
query's labelled tree (``caper_jax.sql.canonical.query_tree``) along two kinds of edges, each of
length 1:

* tree edges upward, within the clause the node is written in: a node to its parent (its
  ancestors are built from it);
* reference edges (an extension beyond the paper, off by default in ``AnnotationSettings``): a
  column to the table instance it reads (in the FROM clause of its own scope or, for a correlated
  column, an enclosing one). An unqualified column resolves to the only table in scope, or with a
  schema to the table that has a column of that name.

Downward and sibling edges are not followed: a wrong literal does not make its neighbours wrong.

**Clauses as written.** The pairs are cut from the query as its author wrote it, so its rewards
are keyed by those clauses too. A canonical tree (``canonical.canonicalize``) tags each node with
the written clause that holds its text (``canonical.WRITTEN``); an equivalence rule that moves a
node keeps the tag (``FROM a, b WHERE a.x = b.y``: the condition sits in the canonical FROM, yet it
is written in WHERE and its reward goes there). A node without a tag (the clause roots, nodes a
rule created) lies in the clause of its nearest tagged ancestor, else in its canonical clause. The
upward edge from a node to a parent written in another clause is not followed: in the written
query the parent is not built from it. So with ancestor edges alone v*'s written clause gets -alpha
and every other clause 0; other clauses get a non-zero reward only through reference edges (a wrong
column in SELECT marks the FROM clause that provides its table). A tree without tags (a raw parse,
a mutant) is its own written form.
"""
from __future__ import annotations

import collections
import math

from sqlglot import exp

from caper_jax.sql.canonical import (FROM, AnySchema, LabelledNode, SchemaMapping, positions, schema_mapping,
                                    written_clause)


def node_rewards(query: LabelledNode, v_star: LabelledNode, *, alpha: float, sigma: float,
                 reference_edges: bool = False, schema: AnySchema | None = None,
                 written: dict[int, str] | None = None) -> dict[int, float]:
    """id(labelled node) -> reward for every node on v*'s dependency path (others are 0).
    ``written``: ``written_clauses(query)``, if already computed."""
    if alpha < 0 or sigma <= 0:
        raise ValueError(f"need alpha >= 0 and sigma > 0, got alpha={alpha}, sigma={sigma}")
    mapping = schema_mapping(schema) if reference_edges else None
    written = written_clauses(query) if written is None else written
    distance = {id(v_star): 0}
    queue = collections.deque([v_star])
    while queue:
        node = queue.popleft()
        parent = node.parent
        # Up within the node's written clause, or to the query root (written in no clause).
        neighbours = [parent] if parent is not None and written.get(id(parent), written.get(id(node))) \
            == written.get(id(node)) else []
        if reference_edges and isinstance(node.node, exp.Column):
            neighbours += referenced_tables(node, mapping)
        for nxt in neighbours:
            if id(nxt) not in distance:
                distance[id(nxt)] = distance[id(node)] + 1
                queue.append(nxt)
    return {k: -alpha * math.exp(-d * d / (2.0 * sigma * sigma)) for k, d in distance.items()}


def clause_rewards(query: LabelledNode, v_star: LabelledNode | None, *, alpha: float, sigma: float,
                   reference_edges: bool = False, schema: AnySchema | None = None,
                   written: dict[int, str] | None = None) -> dict[str, float]:
    """Clause position key (``Position.key``) -> min reward over the clause's nodes.

    All 0.0 when v* is None.
    """
    written = written_clauses(query) if written is None else written
    rewards = {} if v_star is None else node_rewards(
        query, v_star, alpha=alpha, sigma=sigma, reference_edges=reference_edges, schema=schema, written=written)
    out: dict[str, float] = {}
    for node in query.preorder():
        key = written.get(id(node))
        if key is not None:
            out[key] = min(out.get(key, 0.0), rewards.get(id(node), 0.0))
    return out


def written_clauses(query: LabelledNode) -> dict[int, str]:
    """id(labelled node) -> key of the clause it is written in (module docstring); the root has none."""
    out: dict[int, str] = {}
    for position, clause in zip(positions([c.label for c in query.children]), query.children):
        stack = [(clause, position.key)]
        while stack:
            node, inherited = stack.pop()
            own = written_clause(node.node) if node.node is not None else None
            key = own or inherited
            out[id(node)] = key
            stack.extend((child, key) for child in node.children)
    return out


def written_root(query: LabelledNode, v_star: LabelledNode, written: dict[int, str] | None = None) -> str | None:
    """Key of the clause v* is written in."""
    return (written_clauses(query) if written is None else written).get(id(v_star))


def referenced_tables(column: LabelledNode, schema: SchemaMapping | None = None) -> list[LabelledNode]:
    """Table nodes a column reads, searched from its own scope outwards."""
    ast = column.node
    qualifier = (ast.table or "").lower()
    scope = column.parent
    while scope is not None:
        tables = _scope_tables(scope)
        if tables:
            if qualifier:
                hits = [t for t in tables if t.node.alias_or_name.lower() == qualifier]
            elif len(tables) == 1:
                hits = tables
            else:
                hits = [t for t in tables if _has_column(schema, t.node.name, ast.name)]
            if hits:
                return hits[:1] if not qualifier and len(hits) > 1 else hits
        scope = scope.parent
    return []


def _scope_tables(scope: LabelledNode) -> list[LabelledNode]:
    """Table nodes directly in ``scope``'s FROM clause (not inside nested queries)."""
    for child in scope.children:
        if child.label == FROM and child.node is None:
            return [n for n in _preorder_shallow(child) if isinstance(n.node, exp.Table)]
    return []


def _preorder_shallow(node: LabelledNode):
    yield node
    for child in node.children:
        if not isinstance(child.node, exp.Query):
            yield from _preorder_shallow(child)


def _has_column(schema: SchemaMapping | None, table: str, column: str) -> bool:
    if not schema:
        return False
    for t, cols in schema.items():
        if t.lower() == table.lower():
            return column.lower() in {c.lower() for c in cols}
    return False
