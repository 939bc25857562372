"""Suspect failures: predictions that fail by execution yet may answer the question.

Spider's comparison of results is exact, so some failures are not errors of the prediction: the
gold query breaks a tie arbitrarily, or prints a number as text. Preference tuples built from such
a failure teach the PRM that a right clause is wrong. ``suspect_reason`` names the first of these
that applies, or None:

``type``
    The two results are equal once every cell is read as a number where it spells one
    (``1``, ``1.0`` and ``'1'`` meet; no rounding): only the types differ.
``tie``
    The gold query orders its result (a plain SELECT with ORDER BY) and its sort keys tie where it
    matters: at the LIMIT's cut, or, without LIMIT, between rows the prediction lists in another
    order. The prediction's rows (any column order) are then rows gold would return under some
    other tie-break: every row above the tied group, and only rows of gold's unlimited result up
    to and including the tied group (the prediction may return the whole group: ``= (SELECT
    max(...))`` against ``ORDER BY ... LIMIT 1``). Found with one extra query: gold without its
    LIMIT, its sort keys appended as columns.

``gold_literal_case``
    Gold's slip, not the prediction's: a string literal of the prediction equals one of gold's up
    to letter case, and the prediction spells it as the database stores it in the column it is
    compared with, where gold's spelling is stored nowhere there (one query per spelling), and
    gold spelled as the prediction spells it returns the prediction's answer (the case is all
    that differs).

A string literal of the *prediction* that differs from the stored value only in letter case
(``'France'`` where the database holds ``'france'``) is *not* a suspect: SQLite compares strings
case-sensitively, so the query returns nothing, and writing the value as the database stores it
is exactly what a policy must learn (value grounding). Such a failure is an error of the clause
holding the literal (WHERE, mostly) and gives tuples like any other.
"""
from __future__ import annotations

import collections
import itertools
import re

from sqlglot import exp

from caper_jax.sql import canonical as canon
from caper_jax.sql.execution import ExecResult, order_matters, results_equal

REASONS = ("type", "tie", "gold_literal_case")
_NUMBER = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")
_MAX_TIE_WIDTH = 6       # column permutations tried for the tie check (6! = 720)


def suspect_reason(gold_sql: str, pred_sql: str, gold: ExecResult, pred: ExecResult, executor,
                   schema=None, *, semantics: str = "spider") -> str | None:
    """The reason a failed prediction is suspect (module docstring), or None."""
    if not (gold.ok and pred.ok):
        return None
    ordered = order_matters(gold_sql)
    if type_only(gold, pred, semantics=semantics, ordered=ordered):
        return "type"
    try:
        gold_tree = canon.canonicalize(gold_sql, schema, rules=()).tree
    except canon.CanonicalizeError:
        return None
    if _tie(gold_tree, gold, pred, executor):
        return "tie"
    if _gold_literal_case(gold_tree, pred_sql, pred, executor, schema, semantics, ordered):
        return "gold_literal_case"
    return None


def _gold_literal_case(gold_tree: exp.Expression, pred_sql: str, pred: ExecResult, executor, schema,
                       semantics: str, ordered: bool) -> bool:
    """Every literal the prediction spells otherwise than gold (up to case) is stored as the
    prediction spells it, and not as gold does, in the column it is compared with; and gold with
    the prediction's spelling returns the prediction's answer."""
    gold_spelling: dict[str, str] = {}
    for literal in gold_tree.find_all(exp.Literal):
        if literal.is_string:
            gold_spelling.setdefault(literal.this.lower(), literal.this)
    try:
        pred_tree = canon.canonicalize(pred_sql, schema, rules=()).tree
    except canon.CanonicalizeError:
        return False
    found, respelled = False, None
    for literal in (l for l in pred_tree.find_all(exp.Literal) if l.is_string):
        spelled = gold_spelling.get(literal.this.lower())
        if spelled is None or spelled == literal.this:
            continue
        column = _compared_column(literal, schema)
        if column is None or not _stored(executor, column, literal.this) or _stored(executor, column, spelled):
            return False
        found = True
        respelled = respelled or gold_tree.copy()
        for gold_literal in [l for l in respelled.find_all(exp.Literal) if l.is_string and l.this == spelled]:
            gold_literal.replace(exp.Literal.string(literal.this))
    if not found:
        return False
    result = executor.execute(respelled.sql(dialect=canon.DIALECT))
    return result.ok and results_equal(pred, result, semantics=semantics, ordered=ordered)


def _compared_column(literal: exp.Literal, schema) -> tuple[str, str] | None:
    """(table, column) a literal is compared with by =, <> or IN, its table as the schema names it."""
    parent = literal.parent
    if isinstance(parent, (exp.EQ, exp.NEQ)):
        other = parent.expression if parent.this is literal else parent.this
    elif isinstance(parent, exp.In):
        other = parent.this
    else:
        return None
    if not isinstance(other, exp.Column) or not other.table:
        return None
    table = other.table
    tables = {t.lower() for t in (getattr(schema, "tables", None) or schema or ())}
    if table.lower() not in tables:
        table = re.sub(r"_\d+$", "", table)     # a repeated instance (canonical.py: singer_2)
    return table, other.name


def _stored(executor, column: tuple[str, str], value: str) -> bool:
    table, name = ('"' + part.replace('"', '""') + '"' for part in column)
    literal = "'" + value.replace("'", "''") + "'"
    result = executor.execute(f"SELECT 1 FROM {table} WHERE {name} = {literal} LIMIT 1")
    return result.ok and bool(result.rows)


# --------------------------------------------------------------------------------------------

def _number(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and _NUMBER.match(value):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _as_numbers(result: ExecResult) -> ExecResult:
    return ExecResult(rows=tuple(tuple(_number(v) for v in row) for row in result.rows), columns=result.columns)


def type_only(gold: ExecResult, pred: ExecResult, *, semantics: str = "spider", ordered: bool) -> bool:
    """Whether the two results are equal once every cell that spells a number is read as one."""
    return results_equal(_as_numbers(gold), _as_numbers(pred), semantics=semantics, ordered=ordered)


# --------------------------------------------------------------------------------------------

def tie_equivalent(gold_tree: exp.Expression, gold: ExecResult, other: ExecResult, executor) -> bool:
    """Whether ``other`` is gold's result under another break of the ties in gold's ORDER BY
    (``tie`` in the module docstring); ``gold_tree`` is gold's canonical tree."""
    return gold.ok and other.ok and _tie(gold_tree, gold, other, executor)


def _tie(gold_tree: exp.Expression, gold: ExecResult, pred: ExecResult, executor) -> bool:
    if not isinstance(gold_tree, exp.Select) or gold_tree.args.get("order") is None:
        return False
    if gold_tree.args.get("offset") is not None or not gold.rows or not pred.rows:
        return False
    width = len(gold.rows[0])
    if len(pred.rows[0]) != width or width > _MAX_TIE_WIDTH:
        return False
    limit = gold_tree.args.get("limit")
    n = None
    if limit is not None:
        value = limit.expression if isinstance(limit, exp.Limit) else None
        if not (isinstance(value, exp.Literal) and value.is_int):
            return False
        n = int(value.this)
    order = gold_tree.args["order"].expressions
    probe = gold_tree.copy()
    probe.set("limit", None)
    probe.set("expressions", list(probe.expressions) + [o.this.copy() for o in probe.args["order"].expressions])
    result = executor.execute(probe.sql(dialect=canon.DIALECT))
    if not result.ok or not result.rows:
        return False
    rows = [(r[:width], r[width:]) for r in result.rows]
    if n is not None:
        if n <= 0 or n >= len(rows):
            return False
        cut = rows[n - 1][1]
        if rows[n][1] != cut:
            return False            # no tie at the cut: gold's rows are the only right ones
        above = collections.Counter(v for v, k in rows[:n] if k != cut)   # sorted: strictly above the tie
        tied = collections.Counter(v for v, k in rows if k == cut)
        return any(_fits_cut(p, n, above, tied) for p in _permutations(pred.rows, width))
    if len(pred.rows) != len(rows):
        return False
    keys: dict[tuple, set] = {}
    for values, key in rows:
        keys.setdefault(values, set()).add(key)
    if all(len(ks) == 1 for ks in keys.values()) and len({k for _, k in rows}) == len(rows):
        return False                # every sort key distinct: one right order
    directions = [bool(o.args.get("desc")) for o in order]
    gold_bag = collections.Counter(v for v, _ in rows)
    for permuted in _permutations(pred.rows, width):
        if collections.Counter(permuted) != gold_bag:
            continue
        if _consistent_order(permuted, keys, directions):
            return True
    return False


def _permutations(rows: tuple[tuple, ...], width: int):
    for perm in itertools.permutations(range(width)):
        yield [tuple(row[j] for j in perm) for row in rows]


def _fits_cut(pred_rows: list[tuple], n: int, above: collections.Counter, tied: collections.Counter) -> bool:
    """``n`` rows of another tie-break (every row above the tie, the rest from the tied group),
    or every row through the tied group (``= (SELECT max(...))`` against ``LIMIT n``)."""
    bag = collections.Counter(pred_rows)
    if bag == above + tied:
        return True
    rest = bag - above
    return len(pred_rows) == n and not (above - bag) and not (rest - tied)


def _sort_value(value):
    """SQLite's order of storage classes: NULL < numbers < text < blobs."""
    if value is None:
        return (0, 0)
    if isinstance(value, (int, float)):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    return (3, bytes(value))


def _consistent_order(rows: list[tuple], keys: dict[tuple, set], directions: list[bool]) -> bool:
    """Whether ``rows`` is sorted by gold's keys (each row's key set; any of them may hold)."""
    def bound(key: tuple):
        return tuple((-1 if d else 1, _sort_value(v)) for v, d in zip(key, directions))

    def less_or_equal(a: tuple, b: tuple) -> bool:
        for (sa, va), (sb, vb) in zip(bound(a), bound(b)):
            if va != vb:
                return (va < vb) if sa > 0 else (va > vb)
        return True

    previous: set | None = None
    for row in rows:
        options = keys.get(row)
        if not options:
            return False
        if previous is not None:
            options = {k for k in options if any(less_or_equal(p, k) for p in previous)}
            if not options:
                return False
        previous = options
    return True


__all__ = ["REASONS", "suspect_reason", "tie_equivalent", "type_only"]
