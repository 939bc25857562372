"""Canonical forms of SQL queries: what counts as surface and what counts as an error.

Two layers, because the edit script needs an AST it can point into and the comparison needs a
form in which every surface choice has collapsed to one spelling:

1. ``canonicalize(sql, schema)`` returns a canonical *AST* (sqlglot, SQLite dialect). sqlglot's
   optimizer does the schema-aware part: ``qualify`` resolves every column to its table,
   normalises identifier case, and expands references to projection aliases. On top of that we
   leave ``*`` unexpanded (it reads whatever FROM provides, so a wrong table stays FROM's fault),
   rename each table instance to its table name (``singer AS T1`` -> ``singer``; a second instance
   of the same table in one scope becomes ``singer_2``) and drop projection aliases, which only name
   output columns and do not change the rows. SQLite reads a double-quoted word that names no
   column as a string; we turn those into string literals before ``qualify`` lowercases them.
2. ``label_tree(node)`` returns a *labelled tree* of ``LabelledNode``: one node per sqlglot
   expression, with the expression's non-expression arguments (DESC, join side/kind, operator class,
   literal value, identifier names) in its label, so that an edit of any of them has a cost. Here the
   order-free parts are put in a fixed order: AND/OR chains are flattened and sorted, ``=``/``<>``
   operands are sorted, ``a > b`` and ``b < a`` meet, redundant parentheses disappear, and a FROM
   clause made only of inner/cross joins becomes the sorted set of its tables plus the sorted
   conjunction of all its ON conditions (join order is not an error for inner joins).

``canonical_key`` of two clause trees is equal iff they differ only on the surface. If ``qualify``
cannot run (unknown table, a query SQLite would reject), we fall back to the same canonicalisation
without schema resolution, so that a prediction that does not run still gets compared.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.optimizer.normalize_identifiers import normalize_identifiers
from sqlglot.optimizer.qualify import qualify
from sqlglot.optimizer.scope import Scope, traverse_scope

from caper_jax.sql import equivalences
from caper_jax.sql.clauses import compound_name
from caper_jax.sql.contract import CLAUSE_NAMES, CLAUSE_ORDER
from caper_jax.sql.schema import Schema

DIALECT = "sqlite"
SchemaMapping = Mapping[str, Mapping[str, str]]  # table -> column -> type
AnySchema = Schema | SchemaMapping

# Clause names in written order; compound queries name their operator parts (see clause_slots).
SELECT, FROM, WHERE, GROUP_BY, HAVING, ORDER_BY, LIMIT = CLAUSE_NAMES
SLOT_ARGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (SELECT, ("distinct", "expressions")),
    (FROM, ("from_", "joins")),
    (WHERE, ("where",)),
    (GROUP_BY, ("group",)),
    (HAVING, ("having",)),
    (ORDER_BY, ("order",)),
    (LIMIT, ("limit", "offset")),
)


class CanonicalizeError(ValueError):
    """The SQL text does not parse into a single query."""


@dataclasses.dataclass(frozen=True)
class Canonical:
    tree: exp.Expression      # canonical AST
    qualified: bool           # False when schema resolution failed and the fallback was used
    aliases: dict[str, str]   # canonical table name -> alias the original query used (outer scope)


@dataclasses.dataclass(frozen=True)
class ClauseSlot:
    """One clause of a query: its name and the AST nodes that make it up, in written order."""
    name: str
    nodes: tuple[exp.Expression, ...]


@dataclasses.dataclass(frozen=True)
class Position:
    """A clause position: its name and, for names that repeat (``A UNION B UNION C``), which one."""
    name: str
    occurrence: int = 0

    @property
    def key(self) -> str:
        """``name``, or ``name#k`` for the k-th (k >= 2) clause of that name."""
        return self.name if self.occurrence == 0 else f"{self.name}#{self.occurrence + 1}"


def positions(names: Sequence[str]) -> list[Position]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        out.append(Position(name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return out


def position_rank(position: Position) -> tuple[int, int]:
    known = position.name in CLAUSE_ORDER
    return (CLAUSE_ORDER.index(position.name) if known else len(CLAUSE_ORDER)), position.occurrence


def align(left: Sequence[Position], right: Sequence[Position]) -> list[Position]:
    """Union of two position lists in clause order."""
    return sorted(set(left) | set(right), key=position_rank)


def parse(sql: str) -> exp.Expression:
    """Parses one SQLite query; raises CanonicalizeError (with sqlglot's message) otherwise."""
    try:
        trees = sqlglot.parse(sql, read=DIALECT)
    except SqlglotError as e:
        raise CanonicalizeError(str(e)) from e
    # A comment after the final ';' parses as a bare Semicolon statement: not a second query.
    trees = [t for t in trees if t is not None and not isinstance(t, exp.Semicolon)]
    if len(trees) != 1 or not isinstance(trees[0], exp.Query):
        raise CanonicalizeError(f"expected one SELECT query, got {len(trees)} statement(s): {sql!r}")
    return trees[0]


def schema_mapping(schema: AnySchema | None) -> dict[str, dict[str, str]] | None:
    """Lower-cased table -> column -> type mapping for sqlglot, from either schema shape.

    qualify only needs names; every type is given as TEXT because declared SQLite types
    (``varchar(255)``, ``NUMBER(10,2)``, or none) are not all types sqlglot's schema accepts.
    """
    if schema is None:
        return None
    if isinstance(schema, Schema):
        return {t.lower(): {c.name.lower(): "TEXT" for c in schema.columns_of(t)} for t in schema.tables}
    return {t.lower(): {c.lower(): "TEXT" for c in cols} for t, cols in schema.items()}


def canonicalize(sql: str | exp.Expression, schema: AnySchema | None = None, *,
                 rules: Sequence[str] | None = equivalences.ALL,
                 facts: equivalences.SchemaFacts | None = None) -> Canonical:
    """Canonical AST of a query (see module docstring). Never mutates its input.

    ``schema`` is a ``caper_jax.sql.schema.Schema`` or a table -> column -> type mapping.
    ``rules`` names the equivalence rules to apply (``caper_jax.sql.equivalences``; all by default,
    ``()`` for none); ``facts`` is what they may assume about NULLs and keys (default: the primary
    keys of a ``Schema``, nothing for a mapping).
    """
    tree = parse(sql) if isinstance(sql, str) else sql.copy()
    written = {t.alias_or_name.lower(): t.alias_or_name for t in tree.find_all(exp.Table)}
    schema_arg, schema = schema, schema_mapping(schema)
    if schema:
        tree = _quoted_strings_to_literals(tree, schema)
    qualified = True
    try:
        tree = qualify(tree.copy(), schema=schema, dialect=DIALECT, validate_qualify_columns=False,
                       expand_stars=False, quote_identifiers=False, identify=False)
    except (SqlglotError, KeyError, ValueError):
        qualified = False
        tree = normalize_identifiers(tree, dialect=DIALECT)
    aliases = {canonical: written.get(alias, alias)
               for canonical, alias in _rename_table_instances(tree).items()}
    _drop_projection_aliases(tree)
    rules = equivalences.ALL if rules is None else rules
    if rules:
        if facts is None and isinstance(schema_arg, Schema):
            facts = equivalences.SchemaFacts.from_schema(schema_arg)
        elif facts is None and schema_arg is not None:
            facts = equivalences.SchemaFacts.from_mapping(schema_arg)
        equivalences.apply_rules(tree, facts, rules)
    return Canonical(tree=tree, qualified=qualified, aliases=aliases)


def _quoted_strings_to_literals(tree: exp.Expression, schema: SchemaMapping) -> exp.Expression:
    known = {c for cols in schema.values() for c in cols}
    for column in list(tree.find_all(exp.Column)):
        ident = column.this
        if (not column.table and isinstance(ident, exp.Identifier) and ident.quoted
                and ident.name.lower() not in known):
            column.replace(exp.Literal.string(ident.name))
    return tree


def _rename_table_instances(tree: exp.Expression) -> dict[str, str]:
    """Renames table aliases to table names (name_2, ... for repeats).

    A name is repeated when the same table appears twice in one scope, or in a scope and one that
    encloses it (``FROM countrylanguage AS T1 WHERE ... (SELECT ... FROM countrylanguage AS T3
    WHERE T3.code = T1.code)``: the inner instance becomes ``countrylanguage_2``, so the
    correlation survives). Scopes are named outermost first. Resolution happens per scope before
    any renaming, so correlated columns of a subquery keep pointing at the outer table. Returns
    the outer scope's canonical name -> original alias.
    """
    renames: list[tuple[exp.Expression, str]] = []
    outer_aliases: dict[str, str] = {}
    scopes = list(traverse_scope(tree)) if isinstance(tree, exp.Query) else []
    scope_maps: dict[int, dict[str, str]] = {}

    def depth(scope: Scope) -> int:
        d = 0
        while scope.parent is not None:
            scope, d = scope.parent, d + 1
        return d

    for scope in sorted(scopes, key=depth):
        mapping: dict[str, str] = {}
        taken: set[str] = set()
        ancestor = scope.parent
        while ancestor is not None:
            taken |= set(scope_maps.get(id(ancestor), {}).values())
            ancestor = ancestor.parent
        for alias, source in scope.selected_sources.items():
            _, source = source
            if not isinstance(source, exp.Table):
                continue
            canonical, k = source.name, 1
            while canonical in taken:
                k += 1
                canonical = f"{source.name}_{k}"
            taken.add(canonical)
            mapping[alias] = canonical
            renames.append((source, canonical))
            if scope.parent is None:
                outer_aliases[canonical] = source.alias_or_name
        scope_maps[id(scope)] = mapping
    column_renames: list[tuple[exp.Column, str]] = []
    for scope in scopes:
        stars = [c for c in scope.expression.find_all(exp.Column) if isinstance(c.this, exp.Star) and c.table]
        for column in list(scope.columns) + stars:
            target = _resolve(scope, column.table, scope_maps)
            if target is not None:
                column_renames.append((column, target))
    for table, canonical in renames:
        alias = None if canonical == table.name else exp.TableAlias(this=exp.to_identifier(canonical))
        table.set("alias", alias)
    for column, canonical in column_renames:
        column.set("table", exp.to_identifier(canonical))
    return outer_aliases


def _resolve(scope: Scope | None, alias: str, scope_maps: dict[int, dict[str, str]]) -> str | None:
    while scope is not None and alias:
        mapping = scope_maps.get(id(scope), {})
        if alias in mapping:
            return mapping[alias]
        if alias in scope.selected_sources:   # a derived table or CTE: keep its own alias
            return None
        scope = scope.parent
    return None


def _names_its_output(select: exp.Select) -> bool:
    """A derived table or CTE body (or an operand of one): outer scopes read its columns by name."""
    node = select
    while isinstance(node.parent, (exp.SetOperation, exp.Subquery)):
        node = node.parent
        if isinstance(node, exp.Subquery) and isinstance(node.parent, (exp.From, exp.Join)):
            return True
    return isinstance(node.parent, exp.CTE) or (
        isinstance(node, exp.Subquery) and isinstance(node.parent, (exp.From, exp.Join)))


def _drop_projection_aliases(tree: exp.Expression) -> None:
    """Drops projection aliases, first replacing ORDER BY references to them by their expression.

    The aliases of a derived table or CTE stay: the enclosing query reads those columns by name.
    """
    for select in list(tree.find_all(exp.Select)):
        if _names_its_output(select):
            continue
        named = {e.alias: e.this for e in select.expressions if isinstance(e, exp.Alias)}
        order = select.args.get("order")
        if order is not None and named:
            for column in list(order.find_all(exp.Column)):
                if not column.table and column.name in named and column.find_ancestor(exp.Select) is select:
                    column.replace(named[column.name].copy())
        select.set("expressions", [e.this if isinstance(e, exp.Alias) else e for e in select.expressions])


# --------------------------------------------------------------------------------------------
# Clause slots of a (canonical or raw) AST.

def clause_slots(tree: exp.Expression) -> list[ClauseSlot]:
    """The clauses of a query in written order.

    Names and order follow ``caper_jax.sql.clauses.split_clauses``: a leading CTE list is "WITH";
    a compound query ``A UNION B`` is its left part's clauses, then one unit named after the
    operator ("UNION", "UNION ALL", "INTERSECT", "EXCEPT") whose node is the whole right part, then
    the ORDER BY / LIMIT that apply to the compound result. Nested queries stay inside the clause
    that contains them.
    """
    if isinstance(tree, exp.Subquery):
        tree = tree.this
    with_ = [ClauseSlot("WITH", (tree.args["with_"],))] if tree.args.get("with_") else []
    if isinstance(tree, exp.SetOperation):
        slots = with_ + clause_slots(tree.this) + [ClauseSlot(compound_name(tree), (tree.expression,))]
        for slot_name, args in SLOT_ARGS[-2:]:
            nodes = _slot_nodes(tree, args)
            if nodes:
                slots.append(ClauseSlot(slot_name, nodes))
        return slots
    slots = with_
    for name, args in SLOT_ARGS:
        nodes = _slot_nodes(tree, args)
        if nodes:
            slots.append(ClauseSlot(name, nodes))
    return slots


def _slot_nodes(tree: exp.Expression, args: Sequence[str]) -> tuple[exp.Expression, ...]:
    nodes: list[exp.Expression] = []
    for arg in args:
        value = tree.args.get(arg)
        if isinstance(value, list):
            nodes.extend(v for v in value if isinstance(v, exp.Expression))
        elif isinstance(value, exp.Expression):
            nodes.append(value)
    return tuple(nodes)


# --------------------------------------------------------------------------------------------
# Labelled trees: the surface-free form that comparisons and edit scripts work on.

@dataclasses.dataclass(eq=False)
class LabelledNode:
    label: str
    children: list["LabelledNode"]
    node: exp.Expression | None          # the AST node it stands for (None for synthetic nodes)
    parent: "LabelledNode | None" = None

    def preorder(self) -> Iterator["LabelledNode"]:
        yield self
        for child in self.children:
            yield from child.preorder()

    def key(self) -> tuple:
        return (self.label, tuple(c.key() for c in self.children))

    def size(self) -> int:
        return sum(1 for _ in self.preorder())


_SYMMETRIC = (exp.EQ, exp.NEQ, exp.NullSafeEQ, exp.NullSafeNEQ)
_FLIPPED = {exp.GT: exp.LT, exp.LT: exp.GT, exp.GTE: exp.LTE, exp.LTE: exp.GTE}
_INNER_KINDS = {"", "INNER", "CROSS"}


def label_tree(node: exp.Expression) -> LabelledNode:
    """Labelled tree of an AST node (queries get one child per clause, see clause_slots)."""
    root = _label(node)
    _link_parents(root)
    return root


def clause_tree(slot: ClauseSlot) -> LabelledNode:
    """Labelled tree of one clause: a synthetic root named after the clause over its nodes."""
    root = _clause_label(slot)
    _link_parents(root)
    return root


def canonical_key(node: exp.Expression | ClauseSlot, *, qualifiers: bool = True) -> tuple:
    """Equal for two clauses (or nodes) iff they differ only on the surface.

    ``qualifiers=False`` also ignores which table a column is read from: comparing SELECT this way
    tells a wrong column from a right column whose table the (later) FROM clause got wrong.
    """
    key = (clause_tree(node) if isinstance(node, ClauseSlot) else label_tree(node)).key()
    return key if qualifiers else _without_qualifiers(key)


_QUALIFIER = re.compile(r"(?<=[\[,])table=[^,\]]*,?")


def _without_qualifiers(key: tuple) -> tuple:
    label, children = key
    if label.startswith("Column["):
        label = _QUALIFIER.sub("", label).replace(",]", "]").replace("[]", "")
    return (label, tuple(_without_qualifiers(c) for c in children))


def _link_parents(root: LabelledNode) -> None:
    for n in root.preorder():
        for c in n.children:
            c.parent = n


def _clause_label(slot: ClauseSlot) -> LabelledNode:
    if slot.name == FROM:
        inner = [n for n in slot.nodes[1:] if isinstance(n, exp.Join)]
        if len(inner) == len(slot.nodes) - 1 and all(_is_inner(j) for j in inner):
            tables = [_label(slot.nodes[0].this if isinstance(slot.nodes[0], exp.From) else slot.nodes[0])]
            tables += [_label(j.this) for j in inner]
            conditions = [c for j in inner if j.args.get("on") for c in _flatten(j.args["on"], exp.And)]
            children = sorted(tables, key=LabelledNode.key)
            if conditions:
                children.append(_nary("And", conditions, None))
            return LabelledNode(FROM, children, None)
    return LabelledNode(slot.name, [_label(n) for n in slot.nodes], None)


def _is_inner(join: exp.Join) -> bool:
    return (not join.args.get("side") and (join.args.get("kind") or "").upper() in _INNER_KINDS
            and not join.args.get("using"))


def _flatten(node: exp.Expression, kind: type[exp.Expression]) -> list[exp.Expression]:
    node = _unparen(node)
    if isinstance(node, kind):
        return _flatten(node.this, kind) + _flatten(node.expression, kind)
    return [node]


def _unparen(node: exp.Expression) -> exp.Expression:
    while isinstance(node, exp.Paren) and not isinstance(node.this, exp.Query):
        node = node.this
    return node


def _nary(label: str, operands: list[exp.Expression], node: exp.Expression | None) -> LabelledNode:
    return LabelledNode(label, sorted((_label(o) for o in operands), key=LabelledNode.key), node)


def _label(node: exp.Expression) -> LabelledNode:
    node = _unparen(node)
    if isinstance(node, (exp.And, exp.Or)):
        return _nary(type(node).__name__, _flatten(node, type(node)), node)
    if isinstance(node, exp.Select) or (isinstance(node, exp.SetOperation) and node.args.get("order")):
        return LabelledNode(_own_label(node), [_clause_label(s) for s in clause_slots(node)], node)
    if isinstance(node, _SYMMETRIC):
        return _nary(type(node).__name__, [node.this, node.expression], node)
    if type(node) in _FLIPPED:
        left, right = _label(node.this), _label(node.expression)
        if right.key() < left.key():    # b < a  ==  a > b
            return LabelledNode(_FLIPPED[type(node)].__name__, [right, left], node)
        return LabelledNode(type(node).__name__, [left, right], node)
    children = [_label(c) for c in _child_expressions(node)]
    return LabelledNode(_own_label(node), children, node)


def _child_expressions(node: exp.Expression) -> list[exp.Expression]:
    out = []
    for key, value in node.args.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, exp.Expression) and not _folded(node, key, v):
                out.append(v)
    return out


def _folded(parent: exp.Expression, key: str, value: exp.Expression) -> bool:
    """Identifiers and plain table aliases are part of their parent's label, not nodes."""
    if isinstance(value, exp.Identifier):
        return True
    return isinstance(value, exp.TableAlias) and not value.args.get("columns")


def _own_label(node: exp.Expression) -> str:
    if isinstance(node, exp.Literal):
        return f"Literal:{node.this!r}" if node.is_string else f"Literal:{_number(node.this)}"
    if isinstance(node, exp.Identifier):
        return f"Identifier:{node.name}"
    parts = []
    for key, value in sorted(node.args.items()):
        if isinstance(node, exp.Ordered) and key == "nulls_first":
            # SQLite sorts NULLs first ascending, last descending; only a deviation is written.
            if bool(value) != (not node.args.get("desc")):
                parts.append(f"nulls_first={bool(value)}")
            continue
        if isinstance(value, exp.Identifier):
            parts.append(f"{key}={value.name}")
        elif isinstance(value, exp.TableAlias) and not value.args.get("columns"):
            if not (isinstance(node, exp.Table) and value.name == node.name):
                parts.append(f"{key}={value.name}")
        elif isinstance(value, bool):
            if value and key not in ("big_int",):
                parts.append(key)
        elif isinstance(value, (str, int, float)) and value != "":
            parts.append(f"{key}={str(value).upper() if key in ('side', 'kind') else value}")
    if isinstance(node, exp.Anonymous):
        parts = [p.lower() for p in parts]
    name = type(node).__name__
    return f"{name}[{','.join(parts)}]" if parts else name


def _number(text: str) -> str:
    try:
        value = float(text)
    except ValueError:
        return text
    return repr(int(value)) if value.is_integer() and "e" not in text.lower() else repr(value)


def query_tree(tree: exp.Expression) -> LabelledNode:
    """Labelled tree of a whole query: a root over one synthetic node per clause (clause_slots)."""
    root = LabelledNode("Query", [_clause_label(s) for s in clause_slots(tree)], tree)
    _link_parents(root)
    return root


def find_labelled(root: LabelledNode, node: exp.Expression) -> LabelledNode | None:
    """The labelled node standing for ``node``, or for its nearest ancestor that has one.

    Parentheses, identifiers and the inner links of an AND/OR chain have no labelled node of their
    own; they resolve to the node that absorbed them.
    """
    by_id = {id(n.node): n for n in root.preorder() if n.node is not None}
    while node is not None:
        if id(node) in by_id:
            return by_id[id(node)]
        node = node.parent
    return None
