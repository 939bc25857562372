"""Equivalences that always hold, as small named rules over a canonical AST.

``canonical.canonicalize`` runs these after qualification and table renaming, so that two queries
that differ only by one of them compare equal clause by clause. Like sqlglot's optimizer, the rules
are a tuple a reader can list (``RULES``, ``rule_names()``) and switch (``canonicalize(...,
rules=...)``, ``localize(..., rules=...)``). Each rule rewrites the tree in place into an
*equivalent* query (it renders to SQL that returns the same rows; tests/sql/test_equivalences.py
executes every rewritten Spider dev gold and every published prediction against the original).

Rules, in the order they run:

``join_conditions_in_from``
    In a scope whose joins are all inner (no LEFT/RIGHT/FULL, no USING), a WHERE conjunct
    ``a.x = b.y`` between columns of two different table instances of that scope is a join
    condition: it moves to the ON of the scope's last join. ``FROM a, b WHERE a.x = b.y`` is then
    ``FROM a JOIN b ON a.x = b.y``. The moved conjunct keeps its ``WRITTEN`` meta (WHERE):
    blame and rewards stay in the clause the query wrote it in (``propagation``).
``equated_columns``
    In such a scope, the ON equalities between columns make classes of columns that are equal in
    every row. Every column of a class, wherever the scope reads it outside ON (SELECT, WHERE,
    GROUP BY, HAVING, ORDER BY), is replaced by the class's first member by (table, column) name,
    and the equalities themselves are rewritten as that member against each other member (a
    spanning set of one canonical shape, so ``a.x = b.y AND b.y = c.z`` meets ``a.x = b.y AND
    a.x = c.z``). ``GROUP BY T2.id`` against ``GROUP BY T1.id`` under ``ON T1.id = T2.id`` meet.
    (SQLite's comparison affinity can make ``1 = '1'`` true; then the two columns print differently.
    ``localize`` compares again without the rules when they leave no clause that differs.)
    A rewritten equality keeps where its text was written (``WRITTEN``): the clause of the
    earliest written equality on the chain it derives from.
``count_not_null``
    ``COUNT(col)`` is ``COUNT(*)`` when ``col`` cannot be NULL: declared NOT NULL or part of the
    primary key (``SchemaFacts``), read in a scope where no outer join can pad it with NULLs.
``redundant_distinct``
    DISTINCT is dropped where the rows are distinct anyway: a SELECT with GROUP BY whose
    grouping expressions all appear among its projections; a SELECT of aggregates only, without
    GROUP BY (one row); a single-table SELECT that projects the table's whole primary key; the
    operands of a UNION / INTERSECT / EXCEPT (a set operation returns distinct rows whatever its
    operands' multiplicities, and UNION ALL under it keeps which rows occur); the query of an IN
    or EXISTS subquery; and inside MIN / MAX.
``select_column_order``
    The projections of the outermost SELECT are sorted by their canonical key; in a compound
    query, those of its first operand, and every other operand's columns permuted the same way. Only where the comparison of results forgives column order: Spider's
    ``results_equal`` tries every column permutation; BIRD's set comparison does not, so
    ``rules_for("bird")`` leaves this rule out. A query whose ORDER BY or GROUP BY names an output
    column by number keeps its order.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sqlite3
from collections.abc import Callable, Iterable, Sequence

from sqlglot import exp

from caper_jax.sql.contract import CLAUSE_ORDER
from caper_jax.sql.labelled import label_tree
from caper_jax.sql.schema import affinity

# --------------------------------------------------------------------------------------------
# What the schema proves.


_CLASS_AFFINITY = {"text": "text", "number": "numeric", "time": "numeric", "boolean": "numeric",
                   "others": "none"}


@dataclasses.dataclass(frozen=True)
class SchemaFacts:
    """What the schema proves: columns that cannot be NULL, primary keys, column affinities.

    All names lower-cased. From the SQLite catalogue (``from_sqlite``: ``PRAGMA table_info`` on a
    read-only connection; NOT NULL when declared so or part of the primary key), from a
    ``caper_jax.sql.schema.Schema`` (``from_schema``: primary keys and type classes) or from a
    table -> column -> declared type mapping (``from_mapping``: affinities only). SQLite itself
    lets a non-INTEGER primary key hold NULL (a documented legacy quirk); Spider's schemas use
    primary keys as identifiers, and none of the 19 Spider dev databases holds a NULL in one.
    """
    not_null: frozenset[tuple[str, str]] = frozenset()
    primary_keys: tuple[tuple[str, tuple[str, ...]], ...] = ()
    affinities: tuple[tuple[tuple[str, str], str], ...] = ()
    _keys: dict = dataclasses.field(init=False, repr=False, compare=False)
    _affinity: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_keys", dict(self.primary_keys))
        object.__setattr__(self, "_affinity", dict(self.affinities))

    def primary_key(self, table: str) -> tuple[str, ...]:
        return self._keys.get(table.lower(), ())

    def is_not_null(self, table: str, column: str) -> bool:
        return (table.lower(), column.lower()) in self.not_null

    def affinity(self, table: str, column: str) -> str | None:
        return self._affinity.get((table.lower(), column.lower()))

    @classmethod
    def from_sqlite(cls, db_path: str | os.PathLike) -> SchemaFacts:
        return _facts_from_sqlite(str(pathlib.Path(db_path).resolve()))

    @classmethod
    def from_schema(cls, schema) -> SchemaFacts:
        keys, types = {}, {}
        for table in schema.tables:
            columns = schema.columns_of(table)
            pk = tuple(c.name.lower() for c in columns if c.primary_key)
            if pk:
                keys[table.lower()] = pk
            for c in columns:
                types[(table.lower(), c.name.lower())] = _CLASS_AFFINITY.get(c.type, "none")
        not_null = frozenset((t, c) for t, cols in keys.items() for c in cols)
        return cls(not_null, tuple(sorted(keys.items())), tuple(sorted(types.items())))

    @classmethod
    def from_mapping(cls, mapping) -> SchemaFacts:
        types = {(t.lower(), c.lower()): affinity(d) for t, cols in mapping.items() for c, d in cols.items()}
        return cls(affinities=tuple(sorted(types.items())))


@functools.lru_cache(maxsize=64)
def _facts_from_sqlite(path: str) -> SchemaFacts:
    if not os.path.isfile(path):
        return SchemaFacts()
    connection = sqlite3.connect(f"{pathlib.Path(path).as_uri()}?mode=ro", uri=True)
    connection.text_factory = lambda b: b.decode("utf-8", errors="replace")
    try:
        tables = [name for (name,) in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        not_null, keys, types = set(), {}, {}
        for table in tables:
            quoted = table.replace('"', '""')
            pk = []
            for _, name, declared, notnull, _, in_pk in connection.execute(f'PRAGMA table_info("{quoted}")'):
                types[(table.lower(), name.lower())] = affinity(declared)
                if notnull or in_pk:
                    not_null.add((table.lower(), name.lower()))
                if in_pk:
                    pk.append((in_pk, name.lower()))
            if pk:
                keys[table.lower()] = tuple(name for _, name in sorted(pk))
    except sqlite3.Error:
        return SchemaFacts()
    finally:
        connection.close()
    return SchemaFacts(frozenset(not_null), tuple(sorted(keys.items())), tuple(sorted(types.items())))


# --------------------------------------------------------------------------------------------
# The rules.

@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    apply: Callable[[exp.Expression, SchemaFacts], None]   # rewrites the tree in place
    doc: str


def _selects(tree: exp.Expression) -> list[exp.Select]:
    return list(tree.find_all(exp.Select))


def _sources(select: exp.Select) -> list[exp.Expression]:
    from_ = select.args.get("from_")
    out = [from_.this] if from_ is not None else []
    return out + [j.this for j in select.args.get("joins") or []]


def _instances(select: exp.Select) -> dict[str, str]:
    """Table instance name (alias or name) -> table name, for the tables of the scope's FROM."""
    return {s.alias_or_name: s.name for s in _sources(select) if isinstance(s, exp.Table)}


def _all_inner(select: exp.Select) -> bool:
    for join in select.args.get("joins") or []:
        if join.args.get("side") or join.args.get("using") or join.args.get("method"):
            return False
        if (join.args.get("kind") or "").upper() not in ("", "INNER", "CROSS"):
            return False
    return True


def _conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    if node is None:
        return []
    while isinstance(node, exp.Paren) and not isinstance(node.this, exp.Query):
        node = node.this
    if isinstance(node, exp.And):
        return _conjuncts(node.this) + _conjuncts(node.expression)
    return [node]


def _and(nodes: Sequence[exp.Expression]) -> exp.Expression | None:
    if not nodes:
        return None
    out = nodes[0]
    for node in nodes[1:]:
        out = exp.And(this=out, expression=node)
    return out


def _own_columns(select: exp.Select, node: exp.Expression) -> Iterable[exp.Column]:
    """Columns under ``node`` whose nearest enclosing SELECT is ``select``."""
    for column in list(node.find_all(exp.Column)):
        if column.find_ancestor(exp.Select) is select:
            yield column


def _column_equality(select: exp.Select, node: exp.Expression, instances: dict[str, str]
                     ) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """((table, column), (table, column)) of ``a.x = b.y`` between two instances of the scope."""
    if not isinstance(node, exp.EQ):
        return None
    left, right = node.this, node.expression
    if not (isinstance(left, exp.Column) and isinstance(right, exp.Column)):
        return None
    if left.table not in instances or right.table not in instances or left.table == right.table:
        return None
    if left.find_ancestor(exp.Select) is not select or right.find_ancestor(exp.Select) is not select:
        return None
    return (left.table, left.name), (right.table, right.name)


def _inner_scope(select: exp.Select) -> dict[str, str] | None:
    """The scope's table instances when it joins two or more of them, all inner; else None."""
    if not select.args.get("joins") or not _all_inner(select):
        return None
    instances = _instances(select)
    return instances if len(instances) >= 2 else None


def join_conditions_in_from(tree: exp.Expression, facts: SchemaFacts) -> None:
    for select in _selects(tree):
        instances = _inner_scope(select)
        where = select.args.get("where")
        if instances is None or where is None:
            continue
        conjuncts = _conjuncts(where.this)
        moved = [c for c in conjuncts if _column_equality(select, c, instances)]
        if not moved:
            continue
        kept = [c for c in conjuncts if not any(c is m for m in moved)]
        last = select.args["joins"][-1]
        on = _and(_conjuncts(last.args.get("on")) + [m.copy() for m in moved])
        last.set("on", on)
        if (last.args.get("kind") or "").upper() == "CROSS":
            last.set("kind", None)
        select.set("where", exp.Where(this=_and([c.copy() for c in kept])) if kept else None)


def equated_columns(tree: exp.Expression, facts: SchemaFacts) -> None:
    for select in _selects(tree):
        instances = _inner_scope(select)
        if instances is None:
            continue
        joins = select.args["joins"]
        conditions = [c for j in joins for c in _conjuncts(j.args.get("on"))]
        parent: dict[tuple[str, str], tuple[str, str]] = {}

        def find(x):
            while parent.get(x, x) != x:
                x = parent[x]
            return x

        equalities, others = [], []
        edges: dict[tuple[str, str], list[tuple[tuple[str, str], dict]]] = {}   # column -> (column, meta)
        for condition in conditions:
            pair = _column_equality(select, condition, instances)
            if pair is None:
                others.append(condition)
                continue
            (ta, ca), (tb, cb) = pair
            kind = facts.affinity(instances[ta], ca)
            if kind is None or kind != facts.affinity(instances[tb], cb):
                others.append(condition)     # SQLite may convert one side: equal, yet printed apart
                continue
            equalities.append(condition)
            edges.setdefault(pair[0], []).append((pair[1], condition.meta))
            edges.setdefault(pair[1], []).append((pair[0], condition.meta))
            a, b = find(pair[0]), find(pair[1])
            if a != b:
                parent[max(a, b)] = min(a, b)
        if not equalities:
            continue
        classes: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for member in {m for m in parent} | {find(m) for m in parent}:
            classes.setdefault(find(member), []).append(member)
        representative = {m: min(members) for members in classes.values() for m in members}
        for key in ("expressions", "where", "group", "having", "order"):
            value = select.args.get(key)
            for node in value if isinstance(value, list) else [value]:
                if node is None:
                    continue
                for column in list(_own_columns(select, node)):
                    target = representative.get((column.table, column.name))
                    if target is not None and target != (column.table, column.name):
                        column.set("table", exp.to_identifier(target[0]))
                        column.set("this", exp.to_identifier(target[1]))
        spanning = []
        # Each class sorted before the classes are: their member lists come from iterating a set,
        # whose order follows Python's per-process string hashing (PYTHONHASHSEED), and sorting the
        # unsorted lists ordered the ON conjuncts differently from one run to the next.
        for first, *rest in sorted(sorted(members) for members in classes.values()):
            spanning += [_with_meta(exp.EQ(this=_column(first), expression=_column(m)), _derived_meta(edges, first, m))
                         for m in rest]
        for join in joins:
            join.set("on", None)
        joins[-1].set("on", _and(spanning + [o.copy() for o in others]))
        for join in joins:
            if join.args.get("on") is not None and (join.args.get("kind") or "").upper() == "CROSS":
                join.set("kind", None)


# meta key of the written clause that holds a node's text (set by canonical.tag_written_clauses).
WRITTEN = "written_clause"


def _derived_meta(edges: dict, first: tuple[str, str], member: tuple[str, str]) -> dict:
    """The meta of the written equality a rewritten ``first = member`` derives from: of the equalities
    on the path that joins the two, the one written earliest (a wrong join key in ON is FROM's even
    when a WHERE condition completes the chain)."""
    came: dict = {first: None}
    queue = [first]
    while queue and member not in came:
        node = queue.pop(0)
        for nxt, meta in edges.get(node, ()):
            if nxt not in came:
                came[nxt] = (node, meta)
                queue.append(nxt)
    metas, node = [], member
    while came.get(node) is not None:
        node, meta = came[node]
        metas.append(meta)
    return min(metas, key=_written_rank, default={})


def _written_rank(meta: dict) -> tuple[int, int]:
    name, _, number = str(meta.get(WRITTEN, "")).partition("#")
    rank = CLAUSE_ORDER.index(name) if name in CLAUSE_ORDER else len(CLAUSE_ORDER)
    return rank, int(number or 1)


def _with_meta(node: exp.Expression, meta: dict | None) -> exp.Expression:
    """``node`` and every node under it with ``meta`` (where the equality it rewrites was written:
    canonical.WRITTEN keeps a moved join condition blamed in its own clause)."""
    if meta:
        for inner in node.walk():
            inner.meta.update(meta)
    return node


def _column(ref: tuple[str, str]) -> exp.Column:
    return exp.Column(this=exp.to_identifier(ref[1]), table=exp.to_identifier(ref[0]))


def _preserved_tables(select: exp.Select) -> set[str]:
    """Instances no outer join can pad with NULLs: all of them in an inner scope; else the first
    table when every join is a LEFT join or inner."""
    if _all_inner(select):
        return set(_instances(select))
    for join in select.args.get("joins") or []:
        if (join.args.get("side") or "").upper() not in ("", "LEFT") or join.args.get("using"):
            return set()
    first = _sources(select)[:1]
    return {first[0].alias_or_name} if first and isinstance(first[0], exp.Table) else set()


def count_not_null(tree: exp.Expression, facts: SchemaFacts) -> None:
    if not facts.not_null:
        return
    for count in list(tree.find_all(exp.Count)):
        column = count.this
        if not isinstance(column, exp.Column):
            continue
        select = count.find_ancestor(exp.Select)
        if select is None or column.find_ancestor(exp.Select) is not select:
            continue
        instances = _instances(select)
        if column.table not in instances or column.table not in _preserved_tables(select):
            continue
        if facts.is_not_null(instances[column.table], column.name):
            count.set("this", exp.Star())


def _key(node: exp.Expression) -> tuple:
    return label_tree(node).key()


def _rows_distinct(select: exp.Select, facts: SchemaFacts) -> bool:
    projections = select.expressions
    group = select.args.get("group")
    if group is not None:
        keys = {_key(p) for p in projections}
        return bool(group.expressions) and all(_key(g) in keys for g in group.expressions)
    if projections and all(isinstance(p, exp.AggFunc) for p in projections):
        return True
    sources = _sources(select)
    if len(sources) == 1 and isinstance(sources[0], exp.Table):
        pk = facts.primary_key(sources[0].name)
        named = {p.name.lower() for p in projections
                 if isinstance(p, exp.Column) and p.table in ("", sources[0].alias_or_name)}
        return bool(pk) and set(pk) <= named
    return False


def _under_set_operation(select: exp.Select) -> bool:
    node, parent = select, select.parent
    while isinstance(parent, (exp.SetOperation, exp.Subquery)):
        if isinstance(parent, exp.SetOperation) and node.arg_key in ("this", "expression"):
            if not isinstance(parent, exp.Union) or parent.args.get("distinct", True):
                return True
        node, parent = parent, parent.parent
    return False


def _membership_only(select: exp.Select) -> bool:
    """The query of ``x IN (...)`` or ``EXISTS (...)``: only which rows occur matters."""
    parent = select.parent
    if isinstance(parent, exp.Subquery):
        parent = parent.parent
    return isinstance(parent, (exp.In, exp.Exists))


def redundant_distinct(tree: exp.Expression, facts: SchemaFacts) -> None:
    for select in _selects(tree):
        if not isinstance(select.args.get("distinct"), exp.Distinct) or select.args["distinct"].args.get("on"):
            continue
        if _under_set_operation(select) or _membership_only(select) or _rows_distinct(select, facts):
            select.set("distinct", None)
    for node in list(tree.find_all(exp.Max, exp.Min)):
        if isinstance(node.this, exp.Distinct) and len(node.this.expressions) == 1:
            node.set("this", node.this.expressions[0])


def _is_star(node: exp.Expression) -> bool:
    return isinstance(node, exp.Star) or (isinstance(node, exp.Column) and isinstance(node.this, exp.Star))


def _names_by_number(node: exp.Expression) -> bool:
    for key in ("order", "group"):
        clause = node.args.get(key)
        if clause is not None and any(isinstance(e.this if isinstance(e, exp.Ordered) else e, exp.Literal)
                                      for e in clause.expressions):
            return True
    return False


def _operands(tree: exp.Expression) -> list[exp.Expression]:
    if isinstance(tree, exp.Subquery):
        return _operands(tree.this)
    if isinstance(tree, exp.SetOperation):
        return _operands(tree.this) + _operands(tree.expression)
    return [tree]


def select_column_order(tree: exp.Expression, facts: SchemaFacts) -> None:
    operands = _operands(tree)
    if not all(isinstance(o, exp.Select) for o in operands) or _names_by_number(tree):
        return
    width = len(operands[0].expressions)
    if width < 2 or any(len(o.expressions) != width or _names_by_number(o) for o in operands):
        return
    if any(_is_star(p) for o in operands for p in o.expressions):
        return      # * expands to columns in table order; keep its place among the others
    # The first operand's projections sorted; every operand of a compound permuted alike, so
    # that its columns still line up.
    order = sorted(range(width), key=lambda i: _key(operands[0].expressions[i]))
    for operand in operands:
        expressions = operand.expressions
        operand.set("expressions", [expressions[i] for i in order])


RULES: tuple[Rule, ...] = (
    Rule("join_conditions_in_from", join_conditions_in_from,
         "WHERE a.x = b.y between two tables of an inner-join scope -> ON of its last join"),
    Rule("equated_columns", equated_columns,
         "columns equated by inner-join conditions -> the class's first column; one spanning set of equalities"),
    Rule("count_not_null", count_not_null, "COUNT(col) -> COUNT(*) for a NOT NULL / primary-key column"),
    Rule("redundant_distinct", redundant_distinct,
         "drop DISTINCT where rows are distinct anyway (GROUP BY keys projected, one aggregate row, "
         "whole primary key, set-operation operands, IN/EXISTS subqueries, MIN/MAX)"),
    Rule("select_column_order", select_column_order,
         "sort the outer SELECT's projections (Spider semantics only: results_equal forgives column order)"),
)
ALL: tuple[str, ...] = tuple(r.name for r in RULES)


def rule_names() -> tuple[str, ...]:
    return ALL


def rules_for(semantics: str) -> tuple[str, ...]:
    """The rules that are equivalences under a result comparison (``spider`` or ``bird``)."""
    if semantics == "spider":
        return ALL
    return tuple(name for name in ALL if name != "select_column_order")


def apply_rules(tree: exp.Expression, facts: SchemaFacts | None = None,
                names: Sequence[str] | None = ALL) -> exp.Expression:
    """Applies the named rules (all by default, in ``RULES`` order) to ``tree`` in place."""
    names = ALL if names is None else tuple(names)
    unknown = set(names) - set(ALL)
    if unknown:
        raise ValueError(f"unknown equivalence rules {sorted(unknown)}; known: {ALL}")
    facts = facts or SchemaFacts()
    for rule in RULES:
        if rule.name in names:
            rule.apply(tree, facts)
    return tree


__all__ = ["ALL", "RULES", "Rule", "SchemaFacts", "apply_rules", "rule_names", "rules_for"]
