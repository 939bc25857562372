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
2. ``label_tree(node)`` (``caper_jax.sql.labelled``, re-exported here) returns a *labelled tree* of
   ``LabelledNode``: one node per sqlglot expression, with the expression's non-expression arguments (DESC, join side/kind, operator class,
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
import functools
from collections.abc import Mapping, Sequence

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.optimizer.normalize_identifiers import normalize_identifiers
from sqlglot.optimizer.qualify import qualify
from sqlglot.optimizer.scope import Scope, traverse_scope
from sqlglot.schema import MappingSchema

from caper_jax.sql import equivalences
from caper_jax.sql.labelled import (  # noqa: F401  (re-exported: canonical is the public entry point)
    FROM, GROUP_BY, HAVING, LIMIT, ORDER_BY, SELECT, SLOT_ARGS, WHERE, ClauseSlot, LabelledNode,
    canonical_key, clause_slots, clause_tree, find_labelled, label_tree, query_tree,
)
from caper_jax.sql.contract import CLAUSE_ORDER, COMPOUND_NAMES
from caper_jax.sql.schema import Schema

DIALECT = "sqlite"
SchemaMapping = Mapping[str, Mapping[str, str]]  # table -> column -> type
AnySchema = Schema | SchemaMapping



class CanonicalizeError(ValueError):
    """The SQL text does not parse into a single query."""


@dataclasses.dataclass(frozen=True)
class Canonical:
    tree: exp.Expression      # canonical AST
    qualified: bool           # False when schema resolution failed and the fallback was used
    aliases: dict[str, str]   # canonical table name -> alias the original query used (outer scope)


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
    """The clause's slot in ``CLAUSE_ORDER``. Every compound unit shares one slot: their order is
    the order they are written in (``align``), not a fixed order of operator names."""
    if position.name in COMPOUND_NAMES:
        return _COMPOUND_SLOT, 0
    known = position.name in CLAUSE_ORDER
    return (CLAUSE_ORDER.index(position.name) if known else len(CLAUSE_ORDER)), position.occurrence


_COMPOUND_SLOT = CLAUSE_ORDER.index(COMPOUND_NAMES[0])


def align(left: Sequence[Position], right: Sequence[Position]) -> list[Position]:
    """Union of two position lists (each in written order) in written order.

    Clause slots follow ``CLAUSE_ORDER``; compound units keep the order each query writes them in
    (``A EXCEPT B UNION C``: EXCEPT, then UNION), one query's units inserted among the other's after
    the unit they follow; where the two disagree, ``left``'s order stands.
    """
    compounds = list(p for p in left if p.name in COMPOUND_NAMES)
    at = 0
    for position in (p for p in right if p.name in COMPOUND_NAMES):
        if position in compounds:
            at = compounds.index(position) + 1
        else:
            compounds.insert(at, position)
            at += 1
    written = {p: i for i, p in enumerate(compounds)}
    return sorted(dict.fromkeys([*left, *right]), key=lambda p: (position_rank(p), written.get(p, 0)))


def after(order: Sequence[Position], position: Position, present) -> Position | None:
    """The first position of ``order`` after ``position`` that is in ``present``."""
    if position not in order:
        return None
    return next((p for p in order[order.index(position) + 1:] if p in present), None)


def parse(sql: str) -> exp.Expression:
    """Parses one SQLite query; raises CanonicalizeError (with sqlglot's message) otherwise."""
    try:
        trees = sqlglot.parse(sql, read=DIALECT)
    except SqlglotError as e:
        raise CanonicalizeError(str(e)) from e
    except RecursionError:   # sqlglot's parser recurses per nesting level
        raise CanonicalizeError("cannot parse SQL: nested too deeply") from None
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


@functools.lru_cache(maxsize=256)
def _qualify_schema(schema: Schema) -> MappingSchema:
    """sqlglot's schema of a database for ``qualify``, built once: building it normalises every table and
    column name, which was 12 s of canonicalize's 32 s over BIRD dev's 7,569 distinct predictions when
    qualify built it anew for each query (``bench/bird_dialect.py``'s survey)."""
    return MappingSchema(schema_mapping(schema), dialect=DIALECT)


# What a database's schema proves (its keys and column types) for the equivalence rules, also built once.
_schema_facts = functools.lru_cache(maxsize=256)(equivalences.SchemaFacts.from_schema)


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
        tree = qualify(tree.copy(), schema=_qualify_schema(schema_arg) if isinstance(schema_arg, Schema) else schema,
                       dialect=DIALECT, validate_qualify_columns=False,
                       expand_stars=False, quote_identifiers=False, identify=False)
    except (SqlglotError, KeyError, ValueError):
        qualified = False
        tree = normalize_identifiers(tree, dialect=DIALECT)
    rules = equivalences.ALL if rules is None else rules
    if rules:
        if facts is None and isinstance(schema_arg, Schema):
            facts = _schema_facts(schema_arg)
        elif facts is None and schema_arg is not None:
            facts = equivalences.SchemaFacts.from_mapping(schema_arg)
    try:
        aliases = {canonical: written.get(alias, alias)
                   for canonical, alias in _rename_table_instances(tree).items()}
        _drop_projection_aliases(tree)
        tag_written_clauses(tree)
        if rules:
            equivalences.apply_rules(tree, facts, rules)
        _quote_qualifiers_like_their_tables(tree)
    except SqlglotError as e:
        # SQLite runs queries sqlglot cannot scope (one alias for two tables of a FROM, as a sampled
        # policy query on Spider wrote: ``FROM a AS t2 JOIN b AS t2``); with no scopes there is no
        # canonical form, so the query is handled as one the annotator cannot analyse.
        raise CanonicalizeError(f"cannot resolve the query's tables: {e}") from e
    return Canonical(tree=tree, qualified=qualified, aliases=aliases)


# meta key of the written clause (``Position.key``) that holds a node's text, set before the
# equivalence rules run: a rule that moves a node into another clause (a WHERE join condition into
# FROM) keeps it, so rewards and blame go to the clause the query was written with.
WRITTEN = equivalences.WRITTEN


def tag_written_clauses(tree: exp.Expression) -> None:
    """Marks every node of ``tree`` with the key of the top-level clause unit it is written in."""
    slots = clause_slots(tree)
    for position, slot in zip(positions([s.name for s in slots]), slots):
        for node in slot.nodes:
            for inner in node.walk():
                inner.meta[WRITTEN] = position.key


def written_clause(node: exp.Expression | None) -> str | None:
    """The written clause key of a node of a canonical tree: its own tag or its nearest tagged
    ancestor's (a node a rule created lies where the rule put it); None when untagged."""
    while node is not None:
        key = node.meta.get(WRITTEN) if node._meta is not None else None
        if key is not None:
            return key
        node = node.parent
    return None


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
    """A derived table or CTE body (or an operand of one), or an operand of a compound with its own
    ORDER BY: outer scopes read its columns by name."""
    node = select
    while isinstance(node.parent, (exp.SetOperation, exp.Subquery)):
        node = node.parent
        if isinstance(node, exp.Subquery) and isinstance(node.parent, (exp.From, exp.Join)):
            return True
        # A compound's own ORDER BY can only name its result columns, which the left operand names.
        if isinstance(node, exp.SetOperation) and node.args.get("order") is not None:
            return True
    return isinstance(node.parent, exp.CTE) or (
        isinstance(node, exp.Subquery) and isinstance(node.parent, (exp.From, exp.Join)))


def _quote_qualifiers_like_their_tables(tree: exp.Expression) -> None:
    """Quotes a column's table qualifier wherever that table is written quoted.

    Renaming instances to table names and the equivalence rules write qualifiers as plain
    identifiers; BIRD's ``"order"`` table then reads ``order.x``, SQLite's ORDER keyword, and the
    canonical form would not run.
    """
    quoted = {t.name for t in tree.find_all(exp.Table) if t.this is not None and t.this.args.get("quoted")}
    quoted |= {t.alias for t in tree.find_all(exp.Table)
               if t.args.get("alias") is not None and t.args["alias"].this is not None
               and t.args["alias"].this.args.get("quoted")}
    if not quoted:
        return
    for column in tree.find_all(exp.Column):
        qualifier = column.args.get("table")
        if isinstance(qualifier, exp.Identifier) and qualifier.name in quoted:
            qualifier.set("quoted", True)


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
