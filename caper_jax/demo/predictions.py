"""Imperfect predictions for the demo world, each with a KNOWN root-cause clause.

A prediction is the gold query with zero, one or two realistic mistakes, or a surface-only rewrite
of it. Mistakes are edits of the sqlglot tree of the gold query; because the gold text is itself
rendered by the same generator (``render``), the predicted text differs from the gold only where
the edit is. Each mistake is verified on SQLite: it is kept only if the predicted result differs
from the gold result (bag of rows; list of rows when the gold has ORDER BY; column permutations
forgiven as in Spider's test-suite metric), and with two mistakes, only if each one alone also
changes the result — so the earlier one really is a root cause. Surface variants are kept only if
their result is identical to the gold's.

Real predictions are wrong in one place and differently spelled everywhere (aliases, qualifiers,
keyword case, conjunct and join order, ``!=``). So a share (``SURFACE_SHARE``) of the wrong
predictions is also respelled with one to three surface rewrites. A rewrite acts clause by clause
and is applied to the gold and to the wrong query alike, and it is kept only if neither result
changes (exact rows, no column permutation): the error and its root clause stay what they were,
while a text comparison with the gold now sees differences in clauses that are right. The record
keeps the rewrites (``surface``) and the gold in the same spelling (``surface_gold``), which
differs from the prediction exactly where the errors are.

Real failures also differ from gold *harmlessly* before the decisive error, in ways a text or even a
canonical comparison sees: the SELECT columns in another order, a DISTINCT that cannot matter, a
comma join with its condition in WHERE, a column the join condition makes equal to gold's,
``COUNT(key)`` for ``COUNT(*)``. A share (``HARMLESS_SHARE``) of the wrong predictions gets one such
difference (``HARMLESS_KINDS``), only in clauses written before the root clause, kept only if the
gold with it returns the gold's result and the wrong query with it still fails: the root clause is
still the error's (the annotator must see past the difference, as on real failures). The record
names it in ``harmless``; ``surface_gold`` carries it too.

And some failures are no error at all (``kind = "suspect"``, ``true_root_clause`` None, the reason
in ``suspect``): a number returned as text (``type``) -- what ``caper_jax.sql.suspects`` flags on
real failures. (The demo golds never order ambiguously, so there is no ``tie`` kind here.) A string
literal drawn there in another letter case than the data is recorded as the error it is
(``wrong_literal`` of its clause): SQLite compares strings case-sensitively.

The catalogue of mistakes (``mistake_edits``) is not ``caper_jax.sql.mutations.RULES``, on purpose.
The two answer different questions: mutations make the PRM's training negatives, every
type-preserving single edit of one node, tried lazily in an order drawn later; here a prediction
imitates a model's slip, and the catalogue holds mistakes mutations do not make (a dropped condition
or column, an extra condition, a GROUP BY column of another type class, a HAVING threshold, a LIMIT
from 1/2/3/5/10, a number moved by its column's rounding step, a LIKE pattern with another first
letter) and treats shared kinds differently (any column under a JOIN is a join key here, only those
of ON there; DISTINCT is only removed here; key columns are a class of their own). It also draws
its one variant per site while listing the sites, addressed by walk index so that edits apply to
copies of the tree. Reusing the mutation rules would change the mistakes and the sequence of random
draws, and so every prediction of the world.

Clause names follow caper_jax.sql.clauses: SELECT, FROM (with JOINs), WHERE, GROUP BY, HAVING,
ORDER BY, LIMIT of the first (or only) SELECT; in a compound query everything right of an
operator belongs to the unit named after the operator (UNION, INTERSECT, EXCEPT). A mistake inside
a subquery belongs to the clause that contains the subquery.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import random
import sqlite3
from typing import Callable, Sequence

import sqlglot
from sqlglot import exp
from sqlglot.dialects.sqlite import SQLite
from sqlglot.tokens import TokenType

from caper_jax.demo.schemas import DemoSchema
from caper_jax.sql.clauses import clause_of, compound_name
from caper_jax.sql.execution import ExecResult, results_equal
from caper_jax.sql.contract import CLAUSE_NAMES

_DIALECT = SQLite()
_COMPARISONS = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)
_NUMERIC_OPS = (exp.GT, exp.GTE, exp.LT, exp.LTE, exp.EQ, exp.NEQ)
_AGGREGATES = (exp.Avg, exp.Sum, exp.Min, exp.Max)
_MAX_FILTER_VALUES = 60  # columns with more distinct values are not used for extra conditions

PREDICTION_MIX = {"exact": 0.1, "surface": 0.2, "error": 0.45, "double_error": 0.2, "suspect": 0.05}
# Share of error / double_error predictions given one harmless difference before the root clause.
HARMLESS_SHARE = 0.4
# Share of error / double_error predictions that are also respelled, and how many rewrites they get:
# real predictions differ from gold on the surface too, not only where they are wrong.
SURFACE_SHARE = 0.5
SURFACE_COUNT_WEIGHTS = {1: 0.6, 2: 0.3, 3: 0.1}
# Rewrites that exist only for some queries (an AND, a JOIN, a <>) are tried first more often.
SURFACE_WEIGHTS = {"keyword_case": 1.0, "table_aliases": 1.0, "qualification": 1.0, "commuted_conjuncts": 3.0,
                   "commuted_join_condition": 3.0, "join_order": 3.0, "neq_spelling": 3.0}


# ----------------------------------------------------------------------------- text <-> tree

def parse(sql: str) -> exp.Expression:
    return sqlglot.parse_one(sql, read="sqlite")


def render(tree: exp.Expression) -> str:
    """sqlglot's SQLite text with ``x NOT IN`` / ``x NOT LIKE`` instead of its ``NOT x IN``."""
    return _not_after_operand(_DIALECT.generate(tree, copy=False))


def _not_after_operand(sql: str) -> str:
    tokens = _DIALECT.tokenize(sql)
    out, cursor = [], 0
    for i, token in enumerate(tokens):
        if token.token_type != TokenType.NOT:
            continue
        # NOT <name> [. <name>] IN|LIKE  ->  <name>[.<name>] NOT IN|LIKE
        j = i + 1
        if j < len(tokens) and tokens[j].token_type == TokenType.VAR:
            k = j + 2 if j + 2 < len(tokens) and tokens[j + 1].token_type == TokenType.DOT else j
            if k + 1 < len(tokens) and tokens[k + 1].token_type in (TokenType.IN, TokenType.LIKE):
                out.append(sql[cursor:token.start])
                out.append(sql[tokens[j].start:tokens[k].end + 1] + " NOT")
                cursor = tokens[k].end + 1
    out.append(sql[cursor:])
    return "".join(out)


# ----------------------------------------------------------------------------- execution

Rows = list[tuple]


def execute(conn: sqlite3.Connection, sql: str) -> Rows:
    return [tuple(r) for r in conn.execute(sql).fetchall()]


def same_result(gold: Rows, pred: Rows, *, ordered: bool, permute_columns: bool = True) -> bool:
    """Spider's test-suite comparison: list equality if ordered, else bag equality; the columns of
    ``pred`` may be in any order -- ``caper_jax.sql.execution.results_equal`` with ``"spider"``
    semantics, which decides exactly this (its column-permutation pruning keeps every permutation
    that can match). ``permute_columns=False`` keeps the columns in gold's order (surface rewrites
    must not even reorder them), a mode ``results_equal`` does not have."""
    if permute_columns:
        return results_equal(ExecResult(rows=tuple(gold)), ExecResult(rows=tuple(pred)), semantics="spider",
                             ordered=ordered)
    if len(gold) != len(pred):
        return False
    return list(gold) == list(pred) if ordered else collections.Counter(gold) == collections.Counter(pred)


def has_order_by(tree: exp.Expression) -> bool:
    return tree.args.get("order") is not None


def order_is_ambiguous(conn: sqlite3.Connection, tree: exp.Expression) -> bool:
    """True when two adjacent rows of an ORDER BY result tie on the sort key (within LIMIT + 1).

    The row order of ties is up to the engine, so an equivalent query could legitimately return a
    different list; such golds are not used.
    """
    order = tree.args.get("order")
    if order is None or not isinstance(tree, exp.Select):
        return False
    probe = tree.copy()
    probe.set("expressions", [o.this.copy() for o in order.expressions])
    limit = tree.args.get("limit")
    if limit is not None:
        probe.set("limit", exp.Limit(expression=exp.Literal.number(int(limit.expression.this) + 1)))
    keys = execute(conn, _DIALECT.generate(probe, copy=False))
    return any(a == b for a, b in zip(keys, keys[1:]))


# ----------------------------------------------------------------------------- schema view

@dataclasses.dataclass(frozen=True)
class SchemaInfo:
    """Column classes of a demo schema: "id" (keys), "number" or "text"."""

    columns: dict[str, dict[str, str]]  # table -> column -> class
    steps: dict[tuple[str, str], float]  # (table, column) -> rounding step of its literals

    @classmethod
    def of(cls, schema: DemoSchema) -> "SchemaInfo":
        return cls({t.name: {c.name: ("id" if c.is_key else c.spider_type) for c in t.columns}
                    for t in schema.tables},
                   {(t.name, c.name): c.step for t in schema.tables for c in t.columns})


def _scope(node: exp.Expression) -> exp.Select | None:
    return node.find_ancestor(exp.Select)


def _scope_tables(select: exp.Select) -> dict[str, str]:
    """Alias or name -> table name, for the tables of one SELECT's FROM clause."""
    tables: dict[str, str] = {}
    sources = [select.args["from_"].this] if select.args.get("from_") else []
    sources += [j.this for j in select.args.get("joins") or []]
    for source in sources:
        if isinstance(source, exp.Table):
            tables[source.alias_or_name] = source.name
            tables[source.name] = source.name
    return tables


def column_table(column: exp.Column, info: SchemaInfo) -> str | None:
    select = _scope(column)
    if select is None:
        return None
    tables = _scope_tables(select)
    if column.table:
        return tables.get(column.table)
    owners = [t for t in dict.fromkeys(tables.values()) if column.name in info.columns.get(t, {})]
    return owners[0] if len(owners) == 1 else None


# ----------------------------------------------------------------------------- written order of clauses

def clause_rank(tree: exp.Expression, clause: str) -> int:
    """Written position of a clause unit: first SELECT's clauses, then compound operators in order."""
    if clause in CLAUSE_NAMES:
        return CLAUSE_NAMES.index(clause)
    operators = []
    node = tree
    while isinstance(node, exp.SetOperation):
        operators.append(compound_name(node))
        node = node.this
    return len(CLAUSE_NAMES) + operators[::-1].index(clause)


# ----------------------------------------------------------------------------- mistakes

@dataclasses.dataclass(frozen=True)
class Edit:
    """One change to a query tree, addressed by the node's position in ``tree.walk()`` order so that
    it can be applied to any copy of the tree."""

    kind: str
    clause: str
    index: int
    action: "Action"


def apply_edits(tree: exp.Expression, edits: Sequence[Edit]) -> exp.Expression:
    copy = tree.copy()
    nodes = list(copy.walk())
    for edit in edits:
        edit.action(nodes[edit.index])
    return copy


Action = Callable[[exp.Expression], None]  # mutates the addressed node of a tree copy in place
AddEdit = Callable[..., None]  # add(kind, node, action, clause=None) inside mistake_edits


def _replace_with(new: exp.Expression) -> Action:
    return lambda node: node.replace(new.copy())


class ValueSource:
    """Distinct values of a column in the database, for literal mistakes."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn
        self._cache: dict[tuple[str, str], list] = {}

    def values(self, table: str, column: str) -> list:
        key = (table, column)
        if key not in self._cache:
            rows = self._conn.execute(f"SELECT DISTINCT {column} FROM {table} WHERE {column} IS NOT NULL "
                                      f"ORDER BY {column}").fetchall()
            self._cache[key] = [r[0] for r in rows]
        return self._cache[key]


def _literal(value) -> exp.Literal:
    if isinstance(value, str):
        return exp.Literal.string(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return exp.Literal.number(value)


def _compared_column(literal: exp.Literal) -> exp.Column | None:
    parent = literal.parent
    if isinstance(parent, (*_COMPARISONS, exp.Like, exp.Between)):
        column = parent.this
        return column if isinstance(column, exp.Column) else None
    return None


def mistake_edits(tree: exp.Expression, info: SchemaInfo, values: ValueSource,
                  rng: random.Random) -> list[Edit]:
    """Every single mistake this catalogue can make on ``tree`` (one random variant per site)."""
    edits: list[Edit] = []
    nodes = list(tree.walk())
    position = {id(node): i for i, node in enumerate(nodes)}  # identity: equal subtrees are distinct sites

    def add(kind: str, node: exp.Expression, action: Action, clause: str | None = None) -> None:
        edits.append(Edit(kind, clause or clause_of(node), position[id(node)], action))

    for node in nodes:
        if isinstance(node, exp.Select):
            _select_edits(node, info, values, rng, add)
        elif node.parent is None:
            continue
        elif isinstance(node, exp.Column):
            _column_edits(node, info, rng, add)
        elif isinstance(node, exp.Table) and isinstance(node.parent, exp.From):
            _table_edit(node, info, rng, add)
        elif isinstance(node, _COMPARISONS) and not node.find_ancestor(exp.Join):
            _operator_edit(node, rng, add)
        elif isinstance(node, (exp.And, exp.Or)):
            flipped = (exp.Or if isinstance(node, exp.And) else exp.And)(
                this=node.this.copy(), expression=node.expression.copy())
            add("wrong_connective", node, _replace_with(flipped))
            if isinstance(node, exp.And) and isinstance(node.parent, (exp.Where, exp.Having)):
                kept = rng.choice([node.this, node.expression])
                add("missing_condition", node, _replace_with(kept))
        elif isinstance(node, exp.Where) and not isinstance(node.this, (exp.And, exp.Or)):
            add("missing_condition", node, lambda n: n.pop())
        elif isinstance(node, exp.Literal):
            _literal_edit(node, info, values, rng, add)
        elif isinstance(node, exp.Ordered):
            add("wrong_order_direction", node, _replace_with(
                exp.Ordered(this=node.this.copy(), desc=not node.args.get("desc"), nulls_first=False)))
        elif isinstance(node, _AGGREGATES):
            other = rng.choice([a for a in _AGGREGATES if not isinstance(node, a)])
            add("wrong_aggregate", node, _replace_with(other(this=node.this.copy())))
        elif isinstance(node, exp.Distinct):
            if isinstance(node.parent, exp.Select):
                add("missing_distinct", node, lambda n: n.pop())
            elif isinstance(node.parent, exp.Count) and len(node.expressions) == 1:
                add("missing_distinct", node, _replace_with(node.expressions[0]))
    return edits


def _column_edits(node: exp.Column, info: SchemaInfo, rng: random.Random, add: AddEdit) -> None:
    table = column_table(node, info)
    if table is None:
        return
    classes = info.columns[table]
    kind_of_column = classes.get(node.name)
    in_join = node.find_ancestor(exp.Join) is not None
    in_group = isinstance(node.parent, exp.Group)
    alternatives = [c for c, k in classes.items() if k == kind_of_column and c != node.name]
    if in_group:
        alternatives = [c for c, k in classes.items() if k != "id" and c != node.name]
    if not alternatives:
        return
    new = exp.column(rng.choice(alternatives), table=node.table or None)
    kind = "wrong_join_key" if in_join else "wrong_group_by" if in_group else "wrong_column"
    add(kind, node, _replace_with(new))


def _table_edit(node: exp.Table, info: SchemaInfo, rng: random.Random, add: AddEdit) -> None:
    select = _scope(node)
    if select is None or select.args.get("joins"):
        return
    used = [c for c in select.find_all(exp.Column) if _scope(c) is select]
    if any(c.table for c in used):
        return
    needed = {c.name: info.columns[node.name].get(c.name) for c in used}
    fits = [t for t, cols in info.columns.items()
            if t != node.name and all(cols.get(c) == k for c, k in needed.items())]
    if fits:
        add("wrong_table", node, _replace_with(exp.to_table(rng.choice(fits))))


def _operator_edit(node: exp.Expression, rng: random.Random, add: AddEdit) -> None:
    right = node.expression
    if isinstance(right, exp.Literal) and right.is_string:
        choices = [exp.NEQ] if isinstance(node, exp.EQ) else [exp.EQ] if isinstance(node, exp.NEQ) else []
    else:
        choices = [op for op in _NUMERIC_OPS if not isinstance(node, op)]
        # > and >= (< and <=) differ only on ties: prefer the mistakes that flip the direction.
        flips = [op for op in choices if (op in (exp.LT, exp.LTE)) != isinstance(node, (exp.LT, exp.LTE))]
        choices = flips if rng.random() < 0.7 and flips else choices
    if choices:
        op = rng.choice(choices)
        add("wrong_operator", node, _replace_with(op(this=node.this.copy(), expression=right.copy())))


def _literal_edit(node: exp.Literal, info: SchemaInfo, values: ValueSource, rng: random.Random,
                  add: AddEdit) -> None:
    if isinstance(node.parent, exp.Limit):
        current = int(node.this)
        new = rng.choice([k for k in (1, 2, 3, 5, 10) if k != current])
        add("wrong_limit", node, _replace_with(exp.Literal.number(new)))
        return
    column = _compared_column(node)
    clause = clause_of(node)
    if column is None:
        # A threshold on an aggregate (HAVING COUNT(*) > 3): move it by a plausible amount.
        if node.is_string or not isinstance(node.parent, _COMPARISONS):
            return
        value = float(node.this)
        delta = max(1, round(abs(value) * 0.25)) * rng.choice([-2, -1, 1, 2])
        new = _literal(value + delta)
    else:
        table = column_table(column, info)
        if table is None:
            return
        if isinstance(node.parent, exp.Like):
            pattern = node.this
            letters = sorted({str(v)[:1] for v in values.values(table, column.name)} - {pattern[:1]})
            if not letters:
                return
            new = _literal(rng.choice(letters) + pattern[1:])
        elif node.is_string:
            pool = [v for v in values.values(table, column.name) if v != node.this]
            if not pool:
                return
            new = _literal(rng.choice(pool))
        else:
            # A nearby round number, as a misread or mis-copied threshold would be.
            step = info.steps.get((table, column.name), 1)
            new = _literal(float(node.this) + step * rng.choice([-4, -3, -2, -1, 1, 2, 3, 4]))
    kind = "wrong_having_threshold" if clause == "HAVING" and not node.is_string else "wrong_literal"
    add(kind, node, _replace_with(new))


def _select_edits(select: exp.Select, info: SchemaInfo, values: ValueSource, rng: random.Random,
                  add: AddEdit) -> None:
    projections = select.expressions
    if len(projections) >= 2 and _scope(select) is None:
        dropped = rng.randrange(len(projections))
        kept = [p.copy() for i, p in enumerate(projections) if i != dropped]
        add("missing_column", projections[dropped], lambda n, kept=kept: n.parent.set("expressions", kept))
    tables = _scope_tables(select)
    if _scope(select) is not None or not tables:
        return
    # An extra filter on a column of the first table: a plausible over-constraint.
    first = select.args["from_"].this
    if not isinstance(first, exp.Table):
        return
    # Not a column the query already filters on (that reads as a contradiction, not a slip), and
    # not a near-unique one such as a name (a filter on one row is not a plausible addition).
    where = select.args.get("where")
    filtered = {c.name for c in where.find_all(exp.Column)} if where is not None else set()
    candidates = [c for c, k in info.columns[first.name].items()
                  if k in ("text", "number") and c not in filtered
                  and 2 <= len(values.values(first.name, c)) <= _MAX_FILTER_VALUES]
    if not candidates:
        return
    column_name = rng.choice(candidates)
    pool = values.values(first.name, column_name)
    value = rng.choice(pool[len(pool) // 5: max(len(pool) // 5 + 1, 4 * len(pool) // 5)])
    qualifier = first.alias_or_name if select.args.get("joins") else None
    column = exp.column(column_name, table=qualifier)
    op = exp.EQ if isinstance(value, str) else rng.choice([exp.GT, exp.LT])
    condition = op(this=column, expression=_literal(value))
    clause = clause_of(projections[0])
    clause = clause if clause not in CLAUSE_NAMES else "WHERE"

    def extend(node: exp.Expression) -> None:
        where = node.args.get("where")
        if where is None:
            node.set("where", exp.Where(this=condition.copy()))
        else:
            where.set("this", exp.And(this=where.this.copy(), expression=condition.copy()))
    add("extra_condition", select, extend, clause=clause)


# ----------------------------------------------------------------------------- surface variants
#
# A surface rewrite changes the spelling of a query, never its meaning. Each is a pure function of
# one tree (or text) that acts clause by clause -- it never moves text from one clause to another --
# so applied to the gold and to a wrong prediction alike it keeps which clauses differ, and the
# first of them, the root clause. The aliasing rewrites are the only ones that read across clauses
# (a column's qualifier comes from FROM); both sides get the same aliases because errors keep the
# number and order of tables.

TreeRewrite = Callable[[exp.Expression, SchemaInfo], "exp.Expression | None"]  # None: cannot apply


def _commute_conjuncts(tree: exp.Expression, info: SchemaInfo) -> exp.Expression:
    """``a AND b`` -> ``b AND a``, for every AND."""
    copy = tree.copy()
    for node in list(copy.find_all(exp.And)):
        left, right = node.this, node.expression
        node.set("this", right)
        node.set("expression", left)
    return copy


def _commute_join_conditions(tree: exp.Expression, info: SchemaInfo) -> exp.Expression:
    """``ON a.x = b.y`` -> ``ON b.y = a.x``, for every equality inside a JOIN."""
    copy = tree.copy()
    for node in [n for n in copy.find_all(exp.EQ) if n.find_ancestor(exp.Join)]:
        left, right = node.this, node.expression
        node.set("this", right)
        node.set("expression", left)
    return copy


def _join_order(tree: exp.Expression, info: SchemaInfo) -> exp.Expression:
    """``FROM a JOIN b ON c`` -> ``FROM b JOIN a ON c`` where the first join is an inner one."""
    copy = tree.copy()
    for select in list(copy.find_all(exp.Select)):
        joins = select.args.get("joins") or []
        source = select.args["from_"].this if select.args.get("from_") else None
        if not joins or not isinstance(source, exp.Table) or not isinstance(joins[0].this, exp.Table):
            continue
        first = joins[0]
        if first.args.get("side") or first.args.get("kind") or first.args.get("on") is None:
            continue
        left, right = source, first.this
        select.args["from_"].set("this", right)
        first.set("this", left)
    return copy


def _qualification(tree: exp.Expression, info: SchemaInfo) -> exp.Expression | None:
    """Qualify the columns of one-table scopes (``book.pages``); in a join, drop the qualifier of a
    column only one of the scope's tables has. Scopes with aliases are left as written."""
    copy = tree.copy()
    for select in list(copy.find_all(exp.Select)):
        tables = [select.args["from_"].this] if select.args.get("from_") else []
        tables += [j.this for j in select.args.get("joins") or []]
        if not tables or not all(isinstance(t, exp.Table) and not t.alias for t in tables):
            continue
        columns = [c for c in select.find_all(exp.Column) if _scope(c) is select]
        if len(tables) == 1:
            owners = [column_table(c, info) for c in columns]
            if any(o is None for o in owners):
                return None
            for column, owner in zip(columns, owners):
                column.set("table", exp.to_identifier(owner))
            continue
        names = [t.name for t in tables]
        for column in columns:
            if column.table and sum(column.name in info.columns.get(t, {}) for t in names) == 1:
                column.set("table", None)
    return copy


def _table_aliases(tree: exp.Expression, info: SchemaInfo) -> exp.Expression | None:
    """Spider-style ``FROM product AS T1 JOIN supplier AS T2`` with every column qualified."""
    copy = tree.copy()
    count = 0
    for select in list(copy.find_all(exp.Select)):
        tables = [select.args["from_"].this] if select.args.get("from_") else []
        tables += [j.this for j in select.args.get("joins") or []]
        if not tables or not all(isinstance(t, exp.Table) and not t.alias for t in tables):
            continue
        columns = [c for c in select.find_all(exp.Column) if _scope(c) is select]
        owners = [column_table(c, info) for c in columns]
        if any(o is None for o in owners):
            return None
        alias = {}
        for table in tables:
            count += 1
            alias[table.name] = f"T{count}"
        for column, owner in zip(columns, owners):
            column.set("table", exp.to_identifier(alias[owner]))
        for table in tables:
            table.set("alias", exp.TableAlias(this=exp.to_identifier(alias[table.name])))
    return copy if count else None


def _lowercase(sql: str) -> str:
    out, cursor = [], 0
    for token in _DIALECT.tokenize(sql):
        if token.token_type in (TokenType.STRING, TokenType.IDENTIFIER):
            continue
        out.append(sql[cursor:token.start])
        out.append(sql[token.start:token.end + 1].lower())
        cursor = token.end + 1
    out.append(sql[cursor:])
    return "".join(out)


def _replace_tokens(sql: str, token_type: TokenType, text: str) -> str:
    out, cursor = [], 0
    for token in _DIALECT.tokenize(sql):
        if token.token_type == token_type:
            out.append(sql[cursor:token.start] + text)
            cursor = token.end + 1
    out.append(sql[cursor:])
    return "".join(out)


# Applied in this order: structure first, then names, then spelling of the rendered text.
TREE_REWRITES: dict[str, TreeRewrite] = {
    "commuted_conjuncts": _commute_conjuncts, "commuted_join_condition": _commute_join_conditions,
    "join_order": _join_order, "table_aliases": _table_aliases, "qualification": _qualification}
TEXT_REWRITES: dict[str, Callable[[str], str]] = {
    "neq_spelling": lambda sql: _replace_tokens(sql, TokenType.NEQ, "!="), "keyword_case": _lowercase}
SURFACE_KINDS = tuple(TREE_REWRITES) + tuple(TEXT_REWRITES)
_NAMING = frozenset({"table_aliases", "qualification"})   # two ways to name columns: use one


def rewrite_surface(tree: exp.Expression, names: Sequence[str], info: SchemaInfo) -> str | None:
    """The text of ``tree`` with the named surface rewrites applied, or None when one cannot apply."""
    unknown = set(names) - set(SURFACE_KINDS)
    if unknown:
        raise ValueError(f"unknown surface rewrites {sorted(unknown)}; known: {SURFACE_KINDS}")
    for name in TREE_REWRITES:
        if name in names:
            tree = TREE_REWRITES[name](tree, info)
            if tree is None:
                return None
    text = render(tree)
    for name in TEXT_REWRITES:
        if name in names:
            text = TEXT_REWRITES[name](text)
    return text


def surface_variants(tree: exp.Expression, gold: str, info: SchemaInfo) -> dict[str, str]:
    """Each single rewrite that changes the text of ``tree``, keyed by name."""
    variants = {name: rewrite_surface(tree, (name,), info) for name in SURFACE_KINDS}
    return {name: text for name, text in variants.items() if text is not None and text != gold}


def _weighted_order(names: Sequence[str], rng: random.Random) -> list[str]:
    """A weighted random order: rewrites that exist only for some queries come first more often, so
    they are not drowned by those that apply to every query."""
    return sorted(names, key=lambda n: rng.random() ** (1 / SURFACE_WEIGHTS.get(n, 1.0)), reverse=True)


# ----------------------------------------------------------------------------- harmless differences
#
# Each takes a tree and returns a changed copy (None: does not apply). Unlike a surface rewrite a
# harmless difference changes what a clause says, not only how it is spelled, yet not the answer
# (checked on SQLite for every prediction). Paired with the clauses it touches: it is used only in
# front of a root clause written after all of them.

def _outer(tree: exp.Expression) -> exp.Select | None:
    return tree if isinstance(tree, exp.Select) else None


def _column_order(tree: exp.Expression, info: SchemaInfo) -> exp.Expression | None:
    """The outer SELECT's columns in another order (the comparison of results forgives it)."""
    select = _outer(tree)
    if select is None or len(select.expressions) < 2:
        return None
    copy = tree.copy()
    expressions = copy.expressions
    copy.set("expressions", expressions[1:] + expressions[:1])
    return copy


def _redundant_distinct(tree: exp.Expression, info: SchemaInfo) -> exp.Expression | None:
    """DISTINCT on a SELECT whose GROUP BY keys it projects: its rows are distinct anyway."""
    select = _outer(tree)
    group = select.args.get("group") if select is not None else None
    if group is None or select.args.get("distinct"):
        return None
    projected = {p.sql() for p in select.expressions}
    if not all(g.sql() in projected for g in group.expressions):
        return None
    copy = tree.copy()
    copy.set("distinct", exp.Distinct())
    return copy


def _count_key(tree: exp.Expression, info: SchemaInfo) -> exp.Expression | None:
    """``COUNT(*)`` as ``COUNT(key)`` of the first table (a primary key: never NULL)."""
    select = _outer(tree)
    if select is None or select.args.get("from_") is None or not isinstance(select.args["from_"].this, exp.Table):
        return None
    first = select.args["from_"].this
    keys = [c for c, k in info.columns.get(first.name, {}).items() if k == "id"]
    if not keys or any(j.args.get("side") for j in select.args.get("joins") or []):
        return None
    copy = tree.copy()
    counts = [c for c in copy.expressions if isinstance(c, exp.Count) and isinstance(c.this, exp.Star)]
    if not counts:
        return None
    qualifier = first.alias_or_name if select.args.get("joins") else None
    counts[0].set("this", exp.column(keys[0], table=qualifier))
    return copy


def _equated_column(tree: exp.Expression, info: SchemaInfo) -> exp.Expression | None:
    """A SELECT column that an inner join's ``ON a = b`` makes equal to another, read from the other."""
    select = _outer(tree)
    joins = select.args.get("joins") if select is not None else None
    if not joins or any(j.args.get("side") for j in joins):
        return None
    pairs = {}
    for join in joins:
        on = join.args.get("on")
        if isinstance(on, exp.EQ) and isinstance(on.this, exp.Column) and isinstance(on.expression, exp.Column):
            pairs[on.this.sql()] = on.expression
            pairs[on.expression.sql()] = on.this
    copy = tree.copy()
    for projection in copy.expressions:
        if isinstance(projection, exp.Column) and projection.sql() in pairs:
            projection.replace(pairs[projection.sql()].copy())
            return copy
    return None


def _comma_join(tree: exp.Expression, info: SchemaInfo) -> exp.Expression | None:
    """``FROM a JOIN b ON c`` as ``FROM a, b WHERE c``."""
    select = _outer(tree)
    joins = select.args.get("joins") if select is not None else None
    if not joins or any(j.args.get("side") or j.args.get("on") is None for j in joins):
        return None
    copy = tree.copy()
    conditions = []
    for join in copy.args["joins"]:
        conditions.append(join.args["on"])
        join.set("on", None)
        join.set("kind", None)          # renders as a comma
    where = copy.args.get("where")
    if where is not None:
        conditions.append(where.this)
    condition = conditions[0]
    for other in conditions[1:]:
        condition = exp.And(this=condition, expression=other)
    copy.set("where", exp.Where(this=condition))
    return copy


HARMLESS_KINDS: dict[str, tuple[TreeRewrite, tuple[str, ...]]] = {
    "column_order": (_column_order, ("SELECT",)), "redundant_distinct": (_redundant_distinct, ("SELECT",)),
    "count_key": (_count_key, ("SELECT",)), "equated_column": (_equated_column, ("SELECT",)),
    "comma_join": (_comma_join, ("FROM", "WHERE"))}


def _literal_case(tree: exp.Expression, rng: random.Random) -> exp.Expression | None:
    """A string literal compared with ``=`` in another letter case."""
    copy = tree.copy()
    literals = [l for l in copy.find_all(exp.Literal) if l.is_string and isinstance(l.parent, exp.EQ)
                and any(ch.isalpha() for ch in l.this)]
    if not literals:
        return None
    literal = rng.choice(literals)
    spellings = {literal.this.upper(), literal.this.lower(), literal.this.title()} - {literal.this}
    if not spellings:
        return None
    literal.replace(exp.Literal.string(rng.choice(sorted(spellings))))
    return copy


def _number_as_text(tree: exp.Expression, rng: random.Random) -> exp.Expression | None:
    """A numeric output column returned as text (``CAST(x AS TEXT)``): equal values, other type.
    Any aggregate or plain column qualifies; a text column casts to itself and is refused by the
    caller, which keeps only a variant whose result differs from gold's."""
    select = _outer(tree)
    if select is None:
        return None
    copy = tree.copy()
    candidates = [p for p in copy.expressions if isinstance(p, (exp.Count, exp.Sum, exp.Max, exp.Min, exp.Column))]
    if not candidates:
        return None
    node = rng.choice(candidates)
    node.replace(exp.Cast(this=node.copy(), to=exp.DataType.build("TEXT")))
    return copy


SUSPECT_KINDS: dict[str, Callable[[exp.Expression, random.Random], "exp.Expression | None"]] = {
    "literal_case": _literal_case, "type": _number_as_text}


# ----------------------------------------------------------------------------- predictions

@dataclasses.dataclass(frozen=True)
class Prediction:
    pred: str
    kind: str  # exact | surface | error | double_error
    error_kind: str
    true_root_clause: str | None
    errors: tuple[dict, ...]
    surface: tuple[str, ...]   # surface rewrites in the prediction (SURFACE_KINDS names)
    surface_gold: str          # the gold spelled with the same rewrites: the prediction minus its errors
    harmless: tuple[str, ...] = ()   # harmless differences before the root (HARMLESS_KINDS names)
    suspect: str | None = None       # kind "suspect": why it fails without an error


class Predictor:
    """Makes one verified prediction per gold query of one database."""

    def __init__(self, conn: sqlite3.Connection, schema: DemoSchema, mix: dict[str, float] | None = None,
                 max_tries: int = 24, surface_share: float = SURFACE_SHARE):
        self.conn = conn
        self.info = SchemaInfo.of(schema)
        self.values = ValueSource(conn)
        mix = dict(PREDICTION_MIX if mix is None else mix)
        unknown = set(mix) - set(PREDICTION_MIX)
        if unknown or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
            raise ValueError(f"prediction mix must weight {sorted(PREDICTION_MIX)} (>= 0, not all 0); got {mix}")
        if not 0.0 <= surface_share <= 1.0:
            raise ValueError(f"surface_share must be in [0, 1], got {surface_share}")
        self.mix = mix
        self.max_tries = max_tries
        self.surface_share = surface_share

    def predict(self, gold: str, rng: random.Random) -> Prediction:
        kinds = [k for k in PREDICTION_MIX if self.mix.get(k, 0) > 0]
        kind = rng.choices(kinds, weights=[self.mix[k] for k in kinds])[0]
        tree = parse(gold)
        gold_rows = execute(self.conn, gold)
        ordered = has_order_by(tree)
        # Fall back along double -> single -> surface -> exact when a query admits no such variant.
        fallbacks = {"double_error": ["double_error", "error", "surface", "exact"],
                     "error": ["error", "surface", "exact"], "surface": ["surface", "exact"], "exact": ["exact"],
                     "suspect": ["suspect", "error", "surface", "exact"]}
        for attempt in fallbacks[kind]:
            made = getattr(self, f"_{attempt}")(tree, gold, gold_rows, ordered, rng)
            if made is not None:
                return made
        raise AssertionError("unreachable: an exact prediction always exists")

    # Each maker takes (gold tree, gold text, gold rows, ordered?, rng) and returns None when the
    # query admits no prediction of its kind.
    def _exact(self, tree: exp.Expression, gold: str, gold_rows: Rows, ordered: bool,
               rng: random.Random) -> Prediction:
        return Prediction(gold, "exact", "exact", None, (), (), gold)

    def _surface(self, tree: exp.Expression, gold: str, gold_rows: Rows, ordered: bool,
                 rng: random.Random) -> Prediction | None:
        variants = surface_variants(tree, gold, self.info)
        for name in _weighted_order(list(variants), rng):
            if self._result_equal(variants[name], gold_rows, ordered):
                return Prediction(variants[name], "surface", f"surface:{name}", None, (), (name,), variants[name])
        return None

    def _error(self, tree: exp.Expression, gold: str, gold_rows: Rows, ordered: bool,
               rng: random.Random) -> Prediction | None:
        edits = mistake_edits(tree, self.info, self.values, rng)
        by_kind = collections.defaultdict(list)
        for edit in edits:
            by_kind[edit.kind].append(edit)
        kinds = sorted(by_kind)
        for _ in range(self.max_tries):
            if not kinds:
                return None
            edit = rng.choice(by_kind[rng.choice(kinds)])
            pred = self._changes_result(tree, [edit], gold, gold_rows, ordered)
            if pred is not None:
                return self._wrong(tree, gold, gold_rows, ordered, "error", [edit], pred, rng)
        return None

    def _double_error(self, tree: exp.Expression, gold: str, gold_rows: Rows, ordered: bool,
                      rng: random.Random) -> Prediction | None:
        edits = _kind_balanced(mistake_edits(tree, self.info, self.values, rng), rng)
        nodes = list(tree.walk())
        good: list[Edit] = []  # single mistakes verified to change the result on their own
        tries = 0
        for edit in edits:
            if tries >= self.max_tries:
                break
            tries += 1
            if self._changes_result(tree, [edit], gold, gold_rows, ordered) is None:
                continue
            for other in good:
                if other.kind == edit.kind or not _disjoint(nodes[other.index], nodes[edit.index]):
                    continue
                first, second = sorted((other, edit), key=lambda e: (clause_rank(tree, e.clause), e.index))
                pred = self._changes_result(tree, [first, second], gold, gold_rows, ordered)
                if pred is not None:
                    return self._wrong(tree, gold, gold_rows, ordered, "double_error", [first, second], pred, rng)
            good.append(edit)
        return None

    def _wrong(self, tree: exp.Expression, gold: str, gold_rows: Rows, ordered: bool, kind: str,
               edits: list[Edit], pred: str, rng: random.Random) -> Prediction:
        """A verified wrong prediction; with probability ``HARMLESS_SHARE`` with one harmless difference
        before its root clause, with probability ``surface_share`` also in another spelling."""
        gold_tree, wrong_tree = tree, apply_edits(tree, edits)
        harmless: tuple[str, ...] = ()
        if rng.random() < HARMLESS_SHARE:
            made = self._harmless(tree, wrong_tree, edits[0].clause, gold_rows, ordered, rng)
            if made is not None:
                harmless, gold_tree, wrong_tree = made
                gold, pred = render(gold_tree), render(wrong_tree)
        surface, surface_gold = (), gold
        if rng.random() < self.surface_share:
            blocked = {"qualification"} if any(e.kind == "wrong_table" for e in edits) else set()
            surface, surface_gold, pred = self._respell(gold_tree, wrong_tree, gold, gold_rows, ordered,
                                                        blocked, pred, rng)
        errors = tuple({"kind": e.kind, "clause": e.clause} for e in edits)
        return Prediction(pred, kind, "+".join(e.kind for e in edits), edits[0].clause, errors, surface,
                          surface_gold, harmless)

    def _harmless(self, tree: exp.Expression, wrong: exp.Expression, root: str, gold_rows: Rows, ordered: bool,
                  rng: random.Random) -> tuple[tuple[str], exp.Expression, exp.Expression] | None:
        """One harmless difference in clauses before ``root``, applied to the gold and the wrong
        query alike: kept if the gold keeps its result and the wrong query still fails."""
        wrong_rows = execute(self.conn, render(wrong))
        for name in rng.sample(list(HARMLESS_KINDS), len(HARMLESS_KINDS)):
            rewrite, touched = HARMLESS_KINDS[name]
            if not all(clause_rank(tree, root) > clause_rank(tree, c) for c in touched if c in CLAUSE_NAMES):
                continue
            new_gold, new_wrong = rewrite(tree, self.info), rewrite(wrong, self.info)
            if new_gold is None or new_wrong is None or render(new_gold) == render(tree):
                continue
            try:
                rows_gold = execute(self.conn, render(new_gold))
                rows_wrong = execute(self.conn, render(new_wrong))
            except sqlite3.Error:
                continue
            if (same_result(gold_rows, rows_gold, ordered=ordered)
                    and not same_result(gold_rows, rows_wrong, ordered=ordered)
                    and same_result(wrong_rows, rows_wrong, ordered=ordered)):
                return (name,), new_gold, new_wrong
        return None

    def _suspect(self, tree: exp.Expression, gold: str, gold_rows: Rows, ordered: bool,
                 rng: random.Random) -> Prediction | None:
        """A failure that is no error: a literal in another case than the data, or a number as text."""
        # A number as text first: it is the one failure here without an error (a literal's case
        # is a wrong literal, below); the draw of the order is kept for the random stream.
        for name in sorted(rng.sample(list(SUSPECT_KINDS), len(SUSPECT_KINDS)), key=lambda n: n != "type"):
            changed = SUSPECT_KINDS[name](tree, rng)
            if changed is None:
                continue
            pred = render(changed)
            try:
                rows = execute(self.conn, pred)
            except sqlite3.Error:
                continue
            if pred != gold and not same_result(gold_rows, rows, ordered=ordered):
                if name == "literal_case":
                    # SQLite compares strings case-sensitively: a value spelled otherwise than the
                    # data is a wrong literal of its clause (value grounding), not a suspect.
                    clause = next(clause_of(b) for a, b in zip(tree.walk(), changed.walk())
                                  if isinstance(b, exp.Literal) and a.this != b.this)
                    return Prediction(pred, "error", "wrong_literal", clause,
                                      ({"kind": "wrong_literal", "clause": clause},), (), gold)
                return Prediction(pred, "suspect", f"suspect:{name}", None, (), (), gold, (), name)
        return None

    def _respell(self, gold_tree: exp.Expression, wrong: exp.Expression, gold: str, gold_rows: Rows,
                 ordered: bool, blocked: set[str], pred: str, rng: random.Random) -> tuple[tuple[str, ...], str, str]:
        """(rewrites, gold respelled, prediction respelled): up to a drawn number of surface rewrites,
        each kept only if it changes the gold's text and leaves both the gold's and the prediction's
        result exactly as they were -- so the error, and where it is, stay the same. ``blocked``:
        rewrites not to use (a wrong table copied into qualifiers would make SELECT, written
        before FROM, differ as well)."""
        pred_rows = execute(self.conn, pred)
        count = rng.choices(list(SURFACE_COUNT_WEIGHTS), weights=list(SURFACE_COUNT_WEIGHTS.values()))[0]
        chosen: tuple[str, ...] = ()
        for name in _weighted_order(SURFACE_KINDS, rng):
            if len(chosen) == count:
                break
            if name in blocked or (name in _NAMING and _NAMING & set(chosen)):
                continue
            names = chosen + (name,)
            new_gold, new_pred = rewrite_surface(gold_tree, names, self.info), rewrite_surface(wrong, names, self.info)
            if new_gold is None or new_pred is None or new_gold == gold:
                continue
            if self._result_equal(new_gold, gold_rows, ordered) and self._result_equal(new_pred, pred_rows, ordered):
                chosen, gold, pred = names, new_gold, new_pred
        return chosen, gold, pred

    def _changes_result(self, tree: exp.Expression, edits: Sequence[Edit], gold: str, gold_rows: Rows,
                        ordered: bool) -> str | None:
        """The predicted text if the edits run and change the result, else None."""
        try:
            pred = render(apply_edits(tree, edits))
            rows = execute(self.conn, pred)
        except (sqlite3.Error, sqlglot.errors.SqlglotError):
            return None
        if pred == gold or same_result(gold_rows, rows, ordered=ordered):
            return None
        return pred

    def _result_equal(self, pred: str, gold_rows: Rows, ordered: bool) -> bool:
        try:
            rows = execute(self.conn, pred)
        except sqlite3.Error:
            return False
        return same_result(gold_rows, rows, ordered=ordered, permute_columns=False)


def _kind_balanced(edits: list[Edit], rng: random.Random) -> list[Edit]:
    """Edits interleaved kind by kind, so kinds with many sites (columns) do not crowd out the rest."""
    by_kind = collections.defaultdict(list)
    for edit in edits:
        by_kind[edit.kind].append(edit)
    queues = [by_kind[k] for k in sorted(by_kind)]
    for queue in queues:
        rng.shuffle(queue)
    rng.shuffle(queues)
    return [e for group in itertools.zip_longest(*queues) for e in group if e is not None]


def _disjoint(a: exp.Expression, b: exp.Expression) -> bool:
    return a is not b and not any(n is b for n in a.walk()) and not any(n is a for n in b.walk())
