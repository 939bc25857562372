"""Fault injection: type-preserving single-node mutations of a correct query, verified by execution.

A correct query yields preference tuples by breaking it on purpose: one editable node is replaced by
a plausible, same-typed alternative, and the mutant is kept only when it parses, executes without
error and its result differs from the gold result under the run's semantics (``semantics``: Spider's
by default; BIRD compares row sets, so a reordering or a DISTINCT toggle that leaves the set of rows
is no negative there). The mutated node is the
root cause v* that reward propagation starts from.

Catalogue (``MUTATION_KINDS``; the rules themselves are data, ``RULES``: each names its kind, the
nodes it applies to and the edits it proposes; docs/sql.md lists them and says how to add one):

=================  ==========================================================================
column             a column → another column of the same type class from a table in scope
join_key           a column of a JOIN ... ON condition → another same-typed column of its table
comparison         = != < <= > >= → another of them
aggregate          MAX MIN AVG SUM → another (MAX ↔ MIN only for text and time)
literal            a value → another value of the compared column, read from the database
                   (numbers without a column: ±1); LIKE patterns keep their wildcards
and_or             AND ↔ OR
order_direction    ASC ↔ DESC
limit              LIMIT n → n ± 1
distinct           SELECT ↔ SELECT DISTINCT; COUNT(x) ↔ COUNT(DISTINCT x)
table              a FROM/JOIN table → another table holding every column read through it
                   (same names and type classes); the old name stays as alias
=================  ==========================================================================

Spider writes string values in double quotes, which SQLite reads as identifiers that fall back to
strings; a double-quoted identifier that names no column in scope is therefore treated as a string
literal.

Speed: candidates are applied to the gold tree in place, rendered and reverted; only accepted
mutants are copied. Kinds are visited round-robin in a random order so the negatives of one query
cover different kinds of fault.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable, Iterator

from sqlglot import exp

from caper_jax.sql.clauses import SqlParseError, clause_of, clone_tree, parse_sql, render_sql, split_clauses
from caper_jax.sql.execution import ExecResult, Executor, order_matters, results_equal
from caper_jax.sql.schema import Column, Schema

_COMPARISONS = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)
_NUMERIC_AGGREGATES = (exp.Max, exp.Min, exp.Avg, exp.Sum)
_ORDER_AGGREGATES = (exp.Max, exp.Min)
_VALUE_SAMPLE = 30  # distinct values read per column for literal mutations
_ALTERNATIVES_PER_SITE = 2  # candidates tried per edit site before moving on
SITE_BALANCES = ("kind", "clause")


@dataclasses.dataclass(frozen=True, eq=False)
class Negative:
    sql: str  # the mutant, rendered by sqlglot (render_sql)
    tree: exp.Expression  # its AST (parse_sql(sql) == tree)
    node: exp.Expression  # v*: the mutated node inside tree (the Select, for a removed DISTINCT)
    clause: str  # name of the clause unit that holds node (see clauses.split_clauses)
    mutation: str  # one of MUTATION_KINDS; "first+second" for a compound fault (compound_fault)
    root_node_sql: str  # SQL of v* in the mutant ("" when DISTINCT was removed)
    gold_node_sql: str  # SQL of the gold node it replaced ("" when DISTINCT was added)
    result: ExecResult  # the mutant's (different) execution result


@dataclasses.dataclass(frozen=True)
class _Edit:
    """One candidate: set ``owner.args[key]`` (``index`` into a list arg) to ``make()``.

    The replacement is built only when the edit is tried: most candidates never are.
    """
    kind: str
    owner: exp.Expression
    key: str
    index: int | None
    make: Callable[[], exp.Expression | None]

    def swap(self, value):
        """Puts value in place and returns what was there (swap back to revert)."""
        current = self.owner.args.get(self.key)
        old = current if self.index is None else current[self.index]
        self.owner.set(self.key, value, index=self.index)
        return old


def _replace(kind: str, node: exp.Expression, make: Callable[[], exp.Expression]) -> _Edit:
    index = node.index if isinstance(node.parent.args.get(node.arg_key), list) else None
    return _Edit(kind, node.parent, node.arg_key, index, make)


class _Scopes:
    """Resolves columns of one query to schema columns through the FROM/JOIN tables of each SELECT."""

    def __init__(self, schema: Schema):
        self.schema = schema
        self._tables: dict[int, dict[str, str]] = {}
        self._resolved: dict[int, tuple[exp.Select, str, Column] | None] = {}

    def tables(self, select: exp.Select) -> dict[str, str]:
        """alias (or name), lower-cased → schema table name, for the tables a SELECT reads."""
        key = id(select)
        if key not in self._tables:
            sources = [select.args.get("from_")] + list(select.args.get("joins") or [])
            mapping = {}
            for source in sources:
                table = source.this if source is not None else None
                if isinstance(table, exp.Table) and self.schema.has_table(table.name):
                    mapping[(table.alias_or_name).lower()] = self.schema.table_name(table.name)
            self._tables[key] = mapping
        return self._tables[key]

    def resolve(self, column: exp.Column) -> tuple[exp.Select, str, Column] | None:
        """(SELECT whose scope holds it, alias key, schema column), or None when unknown/ambiguous."""
        key = id(column)  # gold nodes only: sites are expanded while the tree is unmutated
        if key not in self._resolved:
            self._resolved[key] = self._resolve(column)
        return self._resolved[key]

    def _resolve(self, column: exp.Column) -> tuple[exp.Select, str, Column] | None:
        select = column.find_ancestor(exp.Select)
        name = column.name
        while select is not None:
            tables = self.tables(select)
            if column.table:
                table = tables.get(column.table.lower())
                if table is not None:
                    found = self.schema.column(table, name)
                    return (select, column.table.lower(), found) if found else None
            else:
                matches = [(alias, self.schema.column(t, name)) for alias, t in tables.items()
                           if self.schema.column(t, name) is not None]
                if len(matches) == 1:
                    return select, matches[0][0], matches[0][1]
                if len(matches) > 1:
                    return None
            select = select.find_ancestor(exp.Select)
        return None


def _in_join_condition(node: exp.Expression) -> bool:
    while node.parent is not None:
        if node.arg_key == "on" and isinstance(node.parent, exp.Join):
            return True
        node = node.parent
    return False


def _is_string_value(column: exp.Column, scopes: _Scopes) -> bool:
    identifier = column.this
    return (not column.table and isinstance(identifier, exp.Identifier) and identifier.quoted
            and scopes.resolve(column) is None)


def _column_node(name: str, qualifier: str | None) -> exp.Column:
    return exp.Column(this=exp.to_identifier(name),
                      table=exp.to_identifier(qualifier) if qualifier else None)


class _Sites:
    """Candidate edits of one gold tree, grouped by kind, produced lazily per site."""

    def __init__(self, tree: exp.Expression, schema: Schema, executor: Executor, rng: random.Random):
        self.tree, self.schema, self.executor, self.rng = tree, schema, executor, rng
        self.scopes = _Scopes(schema)
        # Lazy edit sites in tree order, each with its kind and the clause unit its edits change.
        self.sites: list[tuple[str | None, str, Callable[[], list[_Edit]]]] = []
        for node in tree.walk():
            self._collect(node)

    def _collect(self, node: exp.Expression) -> None:
        """Asks every rule about one node of the walk; each rule that applies adds one site."""
        for rule in RULES:
            if rule.applies(self, node):
                site = rule.site(node)
                make = functools.partial(rule.edits, self, site, rule.kind)
                self.sites.append((_site_clause(site), rule.kind, make))

    def _column_edits(self, column: exp.Column, kind: str, *, own_table_only: bool) -> list[_Edit]:
        resolved = self.scopes.resolve(column)
        if resolved is None:
            return []
        select, alias, current = resolved
        tables = self.scopes.tables(select)
        aliases = [alias] if own_table_only else list(tables)
        edits = []
        for candidate_alias in aliases:
            for candidate in self.schema.columns_of(tables[candidate_alias]):
                if candidate.type != current.type or candidate == current:
                    continue
                owners = [a for a, t in tables.items() if self.schema.column(t, candidate.name)]
                qualify = bool(column.table) or len(owners) > 1
                qualifier = _original_alias(select, candidate_alias) if qualify else None
                edits.append(_replace(kind, column,
                                      lambda c=candidate.name, q=qualifier: _column_node(c, q)))
        return edits

    def _aggregate_edits(self, node: exp.Expression, kind: str) -> list[_Edit]:
        argument = node.this
        type_ = None
        if isinstance(argument, exp.Column):
            resolved = self.scopes.resolve(argument)
            type_ = resolved[2].type if resolved else None
        choices = _NUMERIC_AGGREGATES if type_ in (None, "number") else _ORDER_AGGREGATES
        return [_replace(kind, node, lambda c=cls: c(this=clone_tree(argument)))
                for cls in choices if not isinstance(node, cls)]

    def _compared_column(self, value: exp.Expression) -> Column | None:
        """The schema column a value is compared with (=, <, IN, BETWEEN, LIKE, ...)."""
        parent = value.parent
        while isinstance(parent, (exp.Paren, exp.Neg, exp.Tuple)):
            parent = parent.parent
        if parent is None:
            return None
        sides = (parent.args.get("this"), parent.args.get("expression"))
        column = next((c for c in sides if isinstance(c, exp.Column) and c is not value), None)
        if column is None:
            return None
        resolved = self.scopes.resolve(column)
        return resolved[2] if resolved else None

    def _values(self, column: Column) -> list:
        table = column.table.replace('"', '""')
        name = column.name.replace('"', '""')
        result = self.executor.execute(
            f'SELECT DISTINCT "{name}" FROM "{table}" WHERE "{name}" IS NOT NULL LIMIT {_VALUE_SAMPLE}')
        return [row[0] for row in result.rows] if result.ok else []

    def _literal_edits(self, node: exp.Expression, kind: str, text: str, is_string: bool) -> list[_Edit]:
        column = self._compared_column(node)
        pattern = isinstance(node.parent, exp.Like) and "%" in text
        values = []
        if column is not None:
            for value in self._values(column):
                if isinstance(value, bytes):
                    continue
                if pattern and isinstance(value, str):
                    value = f"%{value}%"
                if str(value) != text:
                    values.append(value)
        elif not is_string:
            try:
                number = float(text) if any(c in text for c in ".eE") else int(text)
            except ValueError:  # e.g. a hex literal: leave it alone
                return []
            values = [number + 1, number - 1]
        edits = []
        for value in values:
            if is_string or isinstance(value, str):
                new = exp.Literal.string(str(value))
            else:
                new = exp.Literal.number(value)
            edits.append(_replace(kind, node, lambda n=new: n))
        return edits

    def _limit_edits(self, limit: exp.Limit, kind: str) -> list[_Edit]:
        literal = limit.expression
        n = int(literal.this)
        return [_replace(kind, literal, lambda m=m: exp.Literal.number(m))
                for m in (n + 1, n - 1) if m > 0]

    def _table_edits(self, table: exp.Table, kind: str) -> list[_Edit]:
        select = table.find_ancestor(exp.Select)
        if select is None:
            return []
        alias = table.alias_or_name.lower()
        needed = set()
        for column in select.find_all(exp.Column):
            resolved = self.scopes.resolve(column)
            if resolved is not None and resolved[0] is select and resolved[1] == alias:
                needed.add((resolved[2].name.lower(), resolved[2].type))
        in_scope = {t.lower() for t in self.scopes.tables(select).values()}
        edits = []
        for other in self.schema.tables:
            if other.lower() in in_scope:
                continue
            if all((c := self.schema.column(other, name)) is not None and c.type == type_
                   for name, type_ in needed):
                new = exp.Table(this=exp.to_identifier(other),
                                alias=exp.TableAlias(this=exp.to_identifier(table.alias_or_name)))
                edits.append(_replace(kind, table, lambda n=new: n))
        return edits

    def edits(self, balance: str = "kind") -> Iterator[_Edit]:
        """Round-robin over sites, a few alternatives per site; then the rest.

        ``balance="kind"``: over mutation kinds in random order. ``balance="clause"``: over clauses
        in random order and, within a clause, over its kinds — so a query's few negatives spread
        over its clauses instead of following where the editable nodes are (WHERE has most).
        """
        if balance not in SITE_BALANCES:
            raise ValueError(f"balance={balance!r}; expected one of {SITE_BALANCES}")
        by_kind = {k: [(c, m) for c, kind, m in self.sites if kind == k] for k in MUTATION_KINDS}
        by_kind = {k: self.rng.sample(v, len(v)) for k, v in by_kind.items() if v}
        if balance == "kind":
            rounds = [iter([m for _, m in reversed(by_kind[k])])
                      for k in self.rng.sample(list(by_kind), len(by_kind))]
        else:
            by_clause: dict[str | None, dict[str, list]] = {}
            for kind, sites in by_kind.items():
                for clause, make in sites:
                    by_clause.setdefault(clause, {}).setdefault(kind, []).append(make)
            clauses = sorted(by_clause, key=str)
            rounds = [_round_robin(by_clause[c], self.rng) for c in self.rng.sample(clauses, len(clauses))]
        leftovers: list[_Edit] = []
        while rounds:
            for queue in list(rounds):
                make = next(queue, None)
                if make is None:
                    rounds.remove(queue)
                    continue
                alternatives = make()
                self.rng.shuffle(alternatives)
                yield from alternatives[:_ALTERNATIVES_PER_SITE]
                leftovers.extend(alternatives[_ALTERNATIVES_PER_SITE:])
        yield from leftovers


# ----------------------------------------------------------------------------- the catalogue


@dataclasses.dataclass(frozen=True)
class MutationRule:
    """One mutation kind at one sort of node: where it applies and which edits it proposes.

    ``applies(sites, node)`` is asked about every node of the gold tree's walk; when it holds, the
    rule adds one edit site there (sites stay in walk order). ``site(node)`` is the node the edits
    change, when that is not the walked node itself (a negated number is edited as a whole).
    ``edits(sites, site, kind)`` lists the candidate edits, each tagged ``kind``; it is called only
    when the site's turn comes (most sites never get one).
    """
    kind: str
    applies: Callable[[_Sites, exp.Expression], bool]
    edits: Callable[[_Sites, exp.Expression, str], list[_Edit]]
    site: Callable[[exp.Expression], exp.Expression] = lambda node: node


def _column_role(sites: _Sites, node: exp.Expression) -> str | None:
    """What a column node is to the catalogue: a double-quoted string value ("literal"), a key of a
    JOIN ... ON condition ("join_key"), any other column ("column"); None for ``*`` and non-columns.
    One role per column, so exactly one of the three column rules applies to it."""
    if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
        return None
    if _is_string_value(node, sites.scopes):
        return "literal"
    return "join_key" if _in_join_condition(node) else "column"


def _is_plain_literal(node: exp.Expression) -> bool:
    # ORDER BY 1 / GROUP BY 1 are column positions, and LIMIT/OFFSET numbers have their own rule.
    return isinstance(node, exp.Literal) and not node.find_ancestor(exp.Limit, exp.Offset, exp.Order, exp.Group)


def _other_comparisons(sites: _Sites, node: exp.Expression, kind: str) -> list[_Edit]:
    return [_replace(kind, node, lambda c=cls: _rebuild(c, node)) for cls in _COMPARISONS
            if not isinstance(node, cls)]


def _toggled_count_distinct(sites: _Sites, node: exp.Count, kind: str) -> list[_Edit]:
    return [_replace(kind, node, lambda: exp.Count(
        this=clone_tree(node.this.expressions[0]) if isinstance(node.this, exp.Distinct)
        else exp.Distinct(expressions=[clone_tree(node.this)])))]


def _toggled_select_distinct(sites: _Sites, node: exp.Select, kind: str) -> list[_Edit]:
    return [_Edit(kind, node, "distinct", None, lambda: None if node.args.get("distinct") else exp.Distinct())]


def _swapped_connective(sites: _Sites, node: exp.Expression, kind: str) -> list[_Edit]:
    other = exp.Or if isinstance(node, exp.And) else exp.And
    return [_replace(kind, node, lambda: _rebuild(other, node))]


def _flipped_direction(sites: _Sites, node: exp.Ordered, kind: str) -> list[_Edit]:
    return [_replace(kind, node, lambda: _flip(node))]


# Every rule is asked about every node; the conditions are disjoint (distinct node classes, and one
# ``_column_role`` per column), so a node is one site at most. MUTATION_KINDS lists the kinds in the
# order they first appear here, and that order is part of the random draws (``_Sites.edits`` samples
# the kinds in it): reordering rules changes which negatives a seed gives. A new kind is one rule.
RULES: tuple[MutationRule, ...] = (
    MutationRule("column", lambda sites, node: _column_role(sites, node) == "column",
                 lambda sites, node, kind: sites._column_edits(node, kind, own_table_only=False)),
    MutationRule("join_key", lambda sites, node: _column_role(sites, node) == "join_key",
                 lambda sites, node, kind: sites._column_edits(node, kind, own_table_only=True)),
    MutationRule("comparison", lambda sites, node: isinstance(node, _COMPARISONS) and not _in_join_condition(node),
                 _other_comparisons),
    MutationRule("aggregate", lambda sites, node: isinstance(node, _NUMERIC_AGGREGATES),
                 lambda sites, node, kind: sites._aggregate_edits(node, kind)),
    # Spider's double-quoted strings parse as columns that name nothing in scope.
    MutationRule("literal", lambda sites, node: _column_role(sites, node) == "literal",
                 lambda sites, node, kind: sites._literal_edits(node, kind, node.name, True)),
    MutationRule("literal", lambda sites, node: _is_plain_literal(node) and not isinstance(node.parent, exp.Neg),
                 lambda sites, node, kind: sites._literal_edits(node, kind, node.this, node.is_string)),
    # -5 is one value: the edits replace the negation, not the 5 under it.
    MutationRule("literal", lambda sites, node: _is_plain_literal(node) and isinstance(node.parent, exp.Neg),
                 lambda sites, node, kind: sites._literal_edits(node, kind, "-" + node.this.this, False),
                 site=lambda node: node.parent),
    MutationRule("and_or", lambda sites, node: isinstance(node, (exp.And, exp.Or)), _swapped_connective),
    MutationRule("order_direction", lambda sites, node: isinstance(node, exp.Ordered), _flipped_direction),
    MutationRule("limit", lambda sites, node: isinstance(node, exp.Limit) and isinstance(node.expression, exp.Literal)
                 and node.expression.is_int,
                 lambda sites, node, kind: sites._limit_edits(node, kind)),
    MutationRule("distinct", lambda sites, node: isinstance(node, exp.Count) and node.this is not None
                 and not isinstance(node.this, exp.Star), _toggled_count_distinct),
    MutationRule("distinct", lambda sites, node: isinstance(node, exp.Select), _toggled_select_distinct),
    MutationRule("table", lambda sites, node: isinstance(node, exp.Table)
                 and isinstance(node.parent, (exp.From, exp.Join)) and sites.schema.has_table(node.name),
                 lambda sites, node, kind: sites._table_edits(node, kind)),
)
MUTATION_KINDS: tuple[str, ...] = tuple(dict.fromkeys(rule.kind for rule in RULES))


def _round_robin(queues: dict[str, list], rng: random.Random) -> Iterator:
    """The items of several non-empty queues (each taken from its end), one queue after another in
    a random order, until all are empty."""
    order = rng.sample(list(queues), len(queues))
    while order:
        for key in list(order):
            if queues[key]:
                yield queues[key].pop()
            else:
                order.remove(key)


def _site_clause(node: exp.Expression) -> str | None:
    """The clause unit a site's edits change (a SELECT's DISTINCT belongs to its projection list)."""
    if isinstance(node, exp.Select):
        node = node.expressions[0]
    try:
        return clause_of(node)
    except ValueError:
        return None


def _rebuild(cls: type, node: exp.Binary) -> exp.Binary:
    """The same operands under another binary operator."""
    return cls(this=clone_tree(node.this), expression=clone_tree(node.expression))


def _flip(ordered: exp.Ordered) -> exp.Ordered:
    """ASC ↔ DESC with SQLite's default NULL placement for the new direction (NULLs smallest)."""
    desc = not ordered.args.get("desc")
    return exp.Ordered(this=clone_tree(ordered.this), desc=desc, nulls_first=not desc)


def _original_alias(select: exp.Select, alias_key: str) -> str | None:
    """The alias (or table name) as written, for the alias key of a table in the SELECT."""
    sources = [select.args.get("from_")] + list(select.args.get("joins") or [])
    for source in sources:
        if source is not None and isinstance(source.this, exp.Table) \
                and source.this.alias_or_name.lower() == alias_key:
            return source.this.alias_or_name
    return None


def _path(node: exp.Expression) -> list[tuple[str, int | None]]:
    steps = []
    while node.parent is not None:
        is_list = isinstance(node.parent.args.get(node.arg_key), list)
        steps.append((node.arg_key, node.index if is_list else None))
        node = node.parent
    return steps[::-1]


def _follow(root: exp.Expression, path: list[tuple[str, int | None]]) -> exp.Expression:
    node = root
    for key, index in path:
        node = node.args[key] if index is None else node.args[key][index]
    return node


def inject_faults(sql: str, executor: Executor, schema: Schema, per_query: int,
                  rng: random.Random, *, max_attempts: int | None = None,
                  gold_result: ExecResult | None = None, compound: int = 0,
                  balance: str = "kind", semantics: str = "spider") -> list[Negative]:
    """Up to ``per_query`` verified negatives of a correct query (fewer if none are found).

    A negative parses, executes OK and differs from the gold result under ``semantics`` ("spider":
    ordered iff gold has ORDER BY; "bird": as sets of rows, ``execution.results_equal``). Returns [] when the gold query itself fails to execute. At most
    ``max_attempts`` (default ``8 * per_query``) mutants are executed.

    With ``compound > 0`` the negatives are offered, in order, a second fault in a clause written
    after theirs (``compound_fault``) until ``compound`` such double faults are found; they are
    appended after the single ones. ``balance`` is the order edit sites are tried in
    (``_Sites.edits``): round-robin over mutation kinds, or over clauses.
    """
    if per_query < 0:
        raise ValueError(f"per_query must be >= 0, got {per_query}")
    if compound < 0:
        raise ValueError(f"compound must be >= 0, got {compound}")
    tree = parse_sql(sql)
    gold = gold_result if gold_result is not None else executor.execute(sql)
    if not gold.ok or per_query == 0:
        return []
    ordered = order_matters(sql)
    budget = max_attempts if max_attempts is not None else 8 * per_query
    seen = {render_sql(tree)}
    negatives: list[Negative] = []
    for edit in _Sites(tree, schema, executor, rng).edits(balance):
        if len(negatives) >= per_query or budget <= 0:
            break
        executed, mutant = _apply_and_verify(edit, tree, executor, seen, (gold,), ordered, semantics)
        budget -= executed
        if mutant is None:
            continue
        node = _follow(mutant.tree, mutant.path)
        # A removed DISTINCT leaves its SELECT as v*; the clause is that SELECT's projection list.
        clause = clause_of(node.expressions[0] if isinstance(node, exp.Select) else node)
        negatives.append(Negative(
            sql=mutant.sql, tree=mutant.tree, node=node, clause=clause, mutation=edit.kind,
            root_node_sql=render_sql(node) if mutant.new is not None else "",
            gold_node_sql=render_sql(mutant.old) if isinstance(mutant.old, exp.Expression) else "",
            result=mutant.result))
    compounds: list[Negative] = []
    for negative in negatives:
        if len(compounds) >= compound:
            break
        second = compound_fault(negative, gold, executor, schema, rng, ordered=ordered, semantics=semantics)
        if second is not None:
            compounds.append(second)
    return negatives + compounds


def compound_fault(negative: Negative, gold: ExecResult, executor: Executor, schema: Schema,
                   rng: random.Random, *, ordered: bool, max_attempts: int = 8,
                   semantics: str = "spider") -> Negative | None:
    """``negative`` with a second fault in a clause written after its own, or None.

    Why: a wrong query often holds more than one error, and its root cause is the earliest one
    (the annotator's earliest divergent clause). Single faults never show a model a clause that
    is wrong yet not to blame; these do. v* stays the first fault, so propagation and the
    tuples treat the second as a downstream symptom. The double mutant must execute and differ
    from both the gold and the single mutant (the second fault changes the result too).
    """
    names = [unit.name for unit in split_clauses(negative.sql)]
    if negative.clause not in names:
        return None
    first_rank = names.index(negative.clause)
    tree = clone_tree(negative.tree)
    first_path = _path(negative.node)
    seen = {negative.sql}
    for edit in _Sites(tree, schema, executor, rng).edits():
        if max_attempts <= 0:
            break
        clause = _edit_clause(edit)
        if clause not in names or names.index(clause) <= first_rank:
            continue
        executed, mutant = _apply_and_verify(edit, tree, executor, seen, (gold, negative.result), ordered,
                                             semantics)
        max_attempts -= executed
        if mutant is not None:
            return dataclasses.replace(negative, sql=mutant.sql, tree=mutant.tree,
                                       node=_follow(mutant.tree, first_path),
                                       mutation=f"{negative.mutation}+{edit.kind}", result=mutant.result)
    return None


@dataclasses.dataclass(frozen=True)
class _Mutant:
    sql: str
    tree: exp.Expression          # a copy: the tree the edit was tried on is reverted
    path: list[tuple[str, int | None]]   # to the edited node (its owner when the edit removed it)
    new: exp.Expression | None
    old: Any
    result: ExecResult


def _apply_and_verify(edit: _Edit, tree: exp.Expression, executor: Executor, seen: set[str],
                      references: tuple[ExecResult, ...], ordered: bool,
                      semantics: str = "spider") -> tuple[bool, _Mutant | None]:
    """Tries ``edit`` on ``tree`` (reverted before returning): (whether the mutant was new and so
    executed, the mutant if it runs and differs from every reference result under ``semantics``)."""
    new = edit.make()
    old = edit.swap(new)
    try:
        sql = render_sql(tree)
        if sql in seen:
            return False, None
        seen.add(sql)
        result = executor.execute(sql)
        if not result.ok or any(results_equal(r, result, semantics=semantics, ordered=ordered) for r in references):
            return True, None
        return True, _Mutant(sql, clone_tree(tree), _path(new if new is not None else edit.owner), new, old, result)
    finally:
        edit.swap(old)


def _edit_clause(edit: _Edit) -> str | None:
    """The clause unit an edit would change (None when it lies in none, e.g. inside WITH)."""
    current = edit.owner.args.get(edit.key)
    node = current[edit.index] if edit.index is not None else current
    if isinstance(edit.owner, exp.Select) and edit.key == "distinct":
        node = edit.owner.expressions[0]          # (SELECT ↔ SELECT DISTINCT) belongs to SELECT
    try:
        return clause_of(node) if isinstance(node, exp.Expression) else None
    except ValueError:
        return None


__all__ = ["MUTATION_KINDS", "RULES", "SITE_BALANCES", "MutationRule", "Negative",
           "SqlParseError", "compound_fault", "inject_faults", "render_sql"]
