"""Counterfactual root-cause localisation of a failed prediction.

Rule, in order:

1. **Correct by execution** (``results_equal`` with Spider semantics by default, ordered iff the gold
   has ORDER BY): never blamed, whatever the text says.
2. **Does not parse**: the root clause is the clause containing sqlglot's error position (the last
   depth-0 clause keyword at or before it); with no position (e.g. an untokenizable string), the
   first clause whose text differs from gold's (whitespace- and case-insensitive); with no
   difference, SELECT. ``root_node`` is the offending token where sqlglot names one.
3. **Parses** (whether or not SQLite runs it): both queries are canonicalised
   (``caper_jax.sql.canonical``) and compared clause by clause in written order; the first
   position whose canonical forms differ -- including a clause present on one side only -- is the
   divergent clause -- except that a clause differing only in the tables its columns name is
   passed over when FROM differs (qualification copies a wrong FROM table into SELECT, which is
   written first; the FROM is the cause). The *corrected query* is the prediction's canonical AST with that clause
   replaced by gold's (inserted when the prediction lacks it, removed when gold lacks it), so it
   shares the prediction's prefix. The minimum-cost edit script from the predicted clause tree to
   the corrected one gives v* (``caper_jax.sql.edit_script``) and propagation gives clause rewards.
   A prediction that lacks the clause has no node to blame: ``root_node`` is None and the missing
   clause itself gets reward -alpha. If no canonical clause differs (mostly SQL that sqlglot
   accepts and SQLite rejects as a syntax error), rule 2's textual fallback applies.

The corrected query is returned as text in the prediction's own spelling: the prediction with the
divergent clause's span replaced by the corrected clause, rendered with the prediction's table
aliases. Both sides therefore share their text up to the divergent clause.
"""
from __future__ import annotations

import dataclasses
import re

from sqlglot import exp
from sqlglot.errors import ParseError

from caper_jax.sql import canonical as canon
from caper_jax.sql import propagation
from caper_jax.sql.canonical import (AnySchema, Canonical, ClauseSlot, LabelledNode, Position, align,
                                    position_rank, positions)
from caper_jax.sql.clauses import COMPOUND_NAMES, ClauseUnit, SqlParseError, compound_name, split_clauses
from caper_jax.sql.edit_script import EditScript, edit_script
from caper_jax.sql.execution import ExecResult, Executor, order_matters, results_equal


class GoldError(ValueError):
    """The gold query does not parse or does not run: nothing can be localised against it."""


@dataclasses.dataclass(frozen=True)
class Localization:
    correct: bool
    root_clause: str | None                 # None when correct
    clause_rewards: dict[str, float]         # prediction's clause position -> reward <= 0
    root_node: str | None                    # SQL text of v* (None: correct, or a missing clause)
    edit_script: tuple[dict, ...]            # minimum-cost edit ops, see edit_script.EditOp
    corrected_sql: str | None                # prediction with the divergent clause repaired
    reason: str                              # which rule of the module docstring applied
    pred_error_kind: str | None = None       # the prediction's execution error, if any

    def as_dict(self) -> dict:
        return {"correct": self.correct, "root_clause": self.root_clause,
                "clause_rewards": self.clause_rewards, "root_node": self.root_node,
                "edit_script": list(self.edit_script), "corrected_sql": self.corrected_sql,
                "reason": self.reason, "pred_error_kind": self.pred_error_kind}


def clause_units(sql: str) -> dict[Position, ClauseUnit]:
    """``split_clauses`` keyed by position; raises SqlParseError."""
    units = split_clauses(sql)
    return dict(zip(positions([u.name for u in units]), units))


def localize(gold_sql: str, pred_sql: str, executor: Executor, schema: AnySchema | None = None,
             *, alpha: float = 1.0, sigma: float = 1.0, reference_edges: bool = True,
             semantics: str = "spider") -> Localization:
    """Localises the root cause of ``pred_sql`` against ``gold_sql`` (see module docstring)."""
    gold_result = executor.execute(gold_sql)
    if not gold_result.ok:
        raise GoldError(f"gold query does not run ({gold_result.error_kind}): {gold_result.error}")
    pred_result = executor.execute(pred_sql)
    if pred_result.ok and results_equal(gold_result, pred_result, semantics=semantics,
                                        ordered=order_matters(gold_sql)):
        return Localization(True, None, {}, None, (), None, "execution_match")
    return localize_failed(gold_sql, pred_sql, schema, pred_result, alpha=alpha, sigma=sigma,
                           reference_edges=reference_edges)


def localize_failed(gold_sql: str, pred_sql: str, schema: AnySchema | None,
                    pred_result: ExecResult, *, alpha: float, sigma: float,
                    reference_edges: bool) -> Localization:
    """Localisation of a prediction already known to be wrong."""
    try:
        gold = canon.canonicalize(gold_sql, schema)
    except canon.CanonicalizeError as e:
        raise GoldError(f"gold query does not parse: {e}") from e
    error_kind = pred_result.error_kind
    try:
        pred = canon.canonicalize(pred_sql, schema)
    except canon.CanonicalizeError as e:
        return _unparseable(gold_sql, pred_sql, e.__cause__, alpha, error_kind or "parse")

    gold_slots = _by_position(canon.clause_slots(gold.tree))
    pred_slots = _by_position(canon.clause_slots(pred.tree))
    position = divergent_position(gold_slots, pred_slots)
    if position is not None:
        return _counterfactual(position, gold, pred, gold_slots.get(position), pred_slots.get(position),
                               pred_sql, schema, alpha, sigma, reference_edges, error_kind)
    fallback = _textual_root(gold_sql, pred_sql) or "SELECT"
    rewards = {p.key: (-alpha if p.key == fallback else 0.0) for p in pred_slots}
    return Localization(False, fallback, rewards, None, (), None, "no_canonical_difference", error_kind)


def divergent_position(gold: dict[Position, ClauseSlot],
                       pred: dict[Position, ClauseSlot]) -> Position | None:
    """The first position, in written order, whose canonical clauses differ.

    Qualification makes a column carry its table, so a wrong table in FROM also changes the
    SELECT written before it. A clause that differs from gold only in which tables its columns
    name is therefore passed over when the FROM clause of the same query differs: the FROM is
    the root cause there.
    """
    from_position = Position("FROM")
    from_differs = _differs(gold.get(from_position), pred.get(from_position))
    for position in align(list(gold), list(pred)):
        g, p = gold.get(position), pred.get(position)
        if not _differs(g, p):
            continue
        if (from_differs and position_rank(position) < position_rank(from_position)
                and not _differs(g, p, qualifiers=False)):
            return from_position
        return position
    return None


def _differs(g: ClauseSlot | None, p: ClauseSlot | None, *, qualifiers: bool = True) -> bool:
    if g is None or p is None:
        return g is not p
    return canon.canonical_key(g, qualifiers=qualifiers) != canon.canonical_key(p, qualifiers=qualifiers)


def _by_position(slots: list[ClauseSlot]) -> dict[Position, ClauseSlot]:
    return dict(zip(positions([s.name for s in slots]), slots))


def _counterfactual(position: Position, gold: Canonical, pred: Canonical, g: ClauseSlot | None,
                    p: ClauseSlot | None, pred_sql: str, schema: AnySchema | None, alpha: float,
                    sigma: float, reference_edges: bool, error_kind: str | None) -> Localization:
    empty = LabelledNode(position.name, [], None)
    source = canon.clause_tree(p) if p is not None else empty
    target = canon.clause_tree(g) if g is not None else empty
    script: EditScript = edit_script(source, target)
    query = canon.query_tree(pred.tree)
    if p is None:
        v_star, root_node = None, None
    else:
        clause = dict(zip(positions([c.label for c in query.children]), query.children))[position]
        v_star = _in_query(clause, script.root_cause)
        root_node = (v_star.node.sql(dialect=canon.DIALECT) if v_star.node is not None
                     else _raw_clause_text(pred_sql, position) or _slot_sql(p))
    rewards = propagation.clause_rewards(query, v_star, alpha=alpha, sigma=sigma,
                                         reference_edges=reference_edges, schema=schema)
    if p is None:
        rewards[position.key] = -alpha      # the missing clause's position
    corrected = _corrected_sql(position, gold, pred, pred_sql)
    return Localization(False, position.name, rewards, root_node,
                        tuple(op.as_dict() for op in script.ops), corrected, "divergent_clause", error_kind)


def _in_query(clause: LabelledNode, v_star: LabelledNode | None) -> LabelledNode:
    """The query-tree node for a clause-tree node (both trees are built over the same AST)."""
    if v_star is None or v_star.node is None:
        return clause
    return canon.find_labelled(clause, v_star.node) or clause


def _raw_clause_text(sql: str, position: Position) -> str | None:
    try:
        unit = clause_units(sql).get(position)
    except SqlParseError:
        return None
    return unit.text if unit is not None else None


def _slot_sql(slot: ClauseSlot) -> str:
    return " ".join(n.sql(dialect=canon.DIALECT) for n in slot.nodes)


# --------------------------------------------------------------------------------------------
# The corrected query.

def _corrected_sql(position: Position, gold: Canonical, pred: Canonical, pred_sql: str) -> str | None:
    """Prediction text with the divergent clause replaced by gold's, in the prediction's aliases."""
    repaired = _repair(pred.tree, gold.tree, position)
    rendered = _with_aliases(repaired, pred.aliases).sql(dialect=canon.DIALECT)
    try:
        new_units, old_units = clause_units(rendered), clause_units(pred_sql)
    except SqlParseError:
        return rendered
    new, old = new_units.get(position), old_units.get(position)
    if old is not None and new is not None:
        return pred_sql[:old.start] + new.text + pred_sql[old.end:]
    if old is not None:         # gold lacks the clause: drop it
        return (pred_sql[:old.start].rstrip() + " " + pred_sql[old.end:].lstrip()).strip()
    if new is not None:         # the prediction lacks it: insert before the next clause
        later = [u for p, u in old_units.items() if position_rank(p) > position_rank(position)]
        at = min((u.start for u in later), default=len(pred_sql.rstrip().rstrip(";").rstrip()))
        return (pred_sql[:at].rstrip() + " " + new.text + " " + pred_sql[at:].lstrip()).strip()
    return rendered


def _repair(pred_tree: exp.Expression, gold_tree: exp.Expression, position: Position) -> exp.Expression:
    """Copy of pred's canonical tree with gold's clause at ``position`` (set, replaced or removed)."""
    repaired = pred_tree.copy()
    if position.name in COMPOUND_NAMES:
        return _repair_compound(repaired, gold_tree, position)
    owner, keys = _owner(repaired, position)
    gold_owner, _ = _owner(gold_tree, position)
    for key in keys:
        value = gold_owner.args.get(key)
        if isinstance(value, list):
            owner.set(key, [v.copy() for v in value])
        else:
            owner.set(key, value.copy() if isinstance(value, exp.Expression) else value)
    return repaired


def _owner(tree: exp.Expression, position: Position) -> tuple[exp.Expression, tuple[str, ...]]:
    """The node holding a clause's arguments, and the argument keys of that clause.

    WITH, and ORDER BY / LIMIT of a compound query, belong to the query root; every other clause
    to the first (leftmost) SELECT.
    """
    if position.name == "WITH":
        return tree, ("with_",)
    keys = dict(canon.SLOT_ARGS)[position.name]
    if isinstance(tree, exp.SetOperation) and position.name in ("ORDER BY", "LIMIT"):
        return tree, keys
    while isinstance(tree, exp.SetOperation):
        tree = tree.this
    return tree, keys


def _repair_compound(pred: exp.Expression, gold: exp.Expression, position: Position) -> exp.Expression:
    p = _nth(_operators(pred), position)
    g = _nth(_operators(gold), position)
    if p is not None and g is not None:       # replace the right-hand query
        p.set("expression", g.expression.copy())
        return pred
    if p is not None:                         # gold has no such operator: keep its left side
        if p is pred:
            return p.this
        p.replace(p.this)
        return pred
    return type(g)(this=pred, expression=g.expression.copy(), distinct=g.args.get("distinct"))


def _nth(operators: list[exp.SetOperation], position: Position) -> exp.SetOperation | None:
    named = [o for o in operators if compound_name(o) == position.name]
    return named[position.occurrence] if position.occurrence < len(named) else None


def _operators(tree: exp.Expression) -> list[exp.SetOperation]:
    out = []
    while isinstance(tree, exp.SetOperation):
        out.append(tree)
        tree = tree.this
    return out[::-1]


def _with_aliases(tree: exp.Expression, aliases: dict[str, str]) -> exp.Expression:
    """Renames the outer scope's canonical table names back to the prediction's aliases."""
    tree = tree.copy()
    renames = {name: alias for name, alias in aliases.items() if alias.lower() != name}
    if not renames:
        return _unqualify_single_table(tree)
    outer = tree if not isinstance(tree, exp.SetOperation) else None
    if outer is None:
        return tree
    for table in outer.find_all(exp.Table):
        if table.find_ancestor(exp.Select) is outer:
            canonical = table.alias_or_name
            if canonical in renames:
                table.set("alias", exp.TableAlias(this=exp.to_identifier(renames[canonical])))
    for column in outer.find_all(exp.Column):
        if column.table in renames:
            column.set("table", exp.to_identifier(renames[column.table]))
    return tree


def _unqualify_single_table(tree: exp.Expression) -> exp.Expression:
    """``singer.name`` -> ``name`` in a single-table SELECT whose prediction used no aliases."""
    for select in [tree] if isinstance(tree, exp.Select) else []:
        tables = [t for t in select.find_all(exp.Table) if t.find_ancestor(exp.Select) is select]
        if len(tables) != 1:
            continue
        name = tables[0].alias_or_name
        for column in select.find_all(exp.Column):
            if column.table == name and column.find_ancestor(exp.Select) is select:
                column.set("table", None)
    return tree


# --------------------------------------------------------------------------------------------
# Predictions that do not parse.

_CLAUSE_KEYWORD = re.compile(
    r"\b(SELECT|FROM|WHERE|GROUP\s+BY|HAVING|ORDER\s+BY|LIMIT|UNION\s+ALL|UNION|INTERSECT|EXCEPT)\b",
    re.IGNORECASE)


def text_clauses(sql: str) -> list[tuple[str, int]]:
    """(clause name, start offset) of every clause unit, by depth-0 keywords, without parsing.

    Units and names follow ``split_clauses``. Works on text sqlglot cannot parse or even
    tokenize: quotes and parentheses are tracked by hand.
    """
    starts: list[tuple[str, int]] = []
    depth, i, quote, in_compound = 0, 0, None, False
    while i < len(sql):
        ch = sql[i]
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"`":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif depth == 0 and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            m = _CLAUSE_KEYWORD.match(sql, i)
            if m:
                name = " ".join(m.group(1).upper().split())
                # As in split_clauses: a compound unit runs to the next operator or ORDER BY/LIMIT.
                if name in COMPOUND_NAMES:
                    in_compound = True
                if not in_compound or name in COMPOUND_NAMES or name in ("ORDER BY", "LIMIT"):
                    starts.append((name, i))
                i = m.end()
                continue
        i += 1
    return starts


def _unparseable(gold_sql: str, pred_sql: str, error: BaseException | None, alpha: float,
                 error_kind: str) -> Localization:
    clauses = text_clauses(pred_sql)
    offset, token = _error_offset(pred_sql, error)
    root = None
    if offset is not None and clauses:
        before = [name for name, start in clauses if start <= offset]
        root = before[-1] if before else clauses[0][0]
    root = root or _textual_root(gold_sql, pred_sql) or "SELECT"
    keys = [p.key for p in positions([name for name, _ in clauses])] or [root]
    rewards = {k: (-alpha if k == root else 0.0) for k in keys}
    rewards.setdefault(root, -alpha)
    return Localization(False, root, rewards, token, (), None, "parse_error", error_kind)


def _error_offset(sql: str, error: BaseException | None) -> tuple[int | None, str | None]:
    if not isinstance(error, ParseError) or not error.errors:
        return None, None
    first = error.errors[0]
    line, col, token = first.get("line"), first.get("col"), first.get("highlight")
    if not line or not col:
        return None, token
    lines = sql.split("\n")
    start = sum(len(s) + 1 for s in lines[:line - 1]) + col - len(token or "")
    return max(0, min(start, len(sql))), token


def _textual_root(gold_sql: str, pred_sql: str) -> str | None:
    """First clause whose whitespace/case-normalised text differs between the two queries."""
    def units(sql: str) -> dict[Position, str]:
        found = text_clauses(sql)
        names = positions([n for n, _ in found])
        ends = [s for _, s in found[1:]] + [len(sql)]
        return {p: " ".join(sql[s:e].lower().split()).rstrip(";") for p, (_, s), e in zip(names, found, ends)}
    g, p = units(gold_sql), units(pred_sql)
    for position in align(list(g), list(p)):
        if g.get(position) != p.get(position):
            return position.name
    return None
