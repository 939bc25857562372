"""Counterfactual root-cause localisation of a failed prediction.

Rule, in order:

1. **Correct by execution** (``results_equal`` with Spider semantics by default, ordered iff the gold
   has ORDER BY): never blamed, whatever the text says.
2. **Does not parse**: the root clause is the clause containing sqlglot's error position (the last
   depth-0 clause keyword at or before it); with no position (e.g. an untokenizable string), the
   first clause whose text differs from gold's (whitespace- and case-insensitive); with no
   difference, SELECT. ``root_node`` is the offending token where sqlglot names one.
3. **Parses** (whether or not SQLite runs it): both queries are canonicalised
   (``caper_jax.sql.canonical``, with the equivalence rules of ``caper_jax.sql.equivalences``)
   and their clause positions aligned in written order; the *divergent* positions are those whose
   canonical forms differ (a clause present on one side only included). The root is the first
   *decisive* one, verified by execution: walking the divergent positions in order, the *hybrid*
   of position d keeps the prediction's clauses up to d and repairs every later divergent clause
   to gold's; if it executes to gold's answer (``_same_answer``: ``results_equal``, or equal up to
   the types of equal values, or another break of the ties of gold's ORDER BY) d is harmless and
   kept, else d is the root (``reason="verified"``). A hybrid that does not run is retried keeping
   the next divergent clauses too; where none runs (a join rewritten as a subquery, scopes that do
   not line up), the canonical comparison decides among the clauses left
   (``"canonical_fallback:hybrid_fails"``): the first of them -- except that a clause differing
   only in the tables its columns name is passed over when FROM differs (qualification copies a
   wrong FROM table into SELECT, which is written first; the FROM is the cause). Without an
   executor, the canonical comparison alone (``"canonical_fallback:no_executor"``).
   docs/annotation.md section 2 states the rule in full.

   The *corrected query* is the prediction's canonical AST with the root and every later
   divergent clause repaired to gold's (inserted when the prediction lacks it, removed when gold
   lacks it), the harmless ones before it kept; it executes to gold's answer
   (``corrected_verified``). The minimum-cost edit script from the predicted root clause to gold's
   gives v* (``caper_jax.sql.edit_script``) and propagation gives clause rewards. A prediction that
   lacks the clause has no node to blame: ``root_node`` is None and the missing clause itself gets
   reward -alpha. If no canonical clause differs (mostly SQL that sqlglot accepts and SQLite
   rejects as a syntax error), rule 2's textual fallback applies.
4. **Suspect**: every failure also gets ``suspect`` (``caper_jax.sql.suspects``): None, or why
   it may answer the question all the same (``tie``, ``type``, ``gold_literal_case``). A
   prediction's literal spelled in another letter case than the data is an error (of its clause).

The corrected query is returned as text in the prediction's own spelling where that runs to gold's
answer: the prediction with the repaired clauses' spans replaced, rendered with the prediction's
table aliases. Both sides then share their text up to the root clause.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from sqlglot import exp
from sqlglot.errors import ParseError, SqlglotError

from caper_jax.sql import canonical as canon
from caper_jax.sql import equivalences, propagation
from caper_jax.sql.canonical import (AnySchema, Canonical, ClauseSlot, LabelledNode, Position, align,
                                    position_rank, positions)
from caper_jax.sql.clauses import ClauseUnit, SqlParseError, compound_name, split_clauses
from caper_jax.sql.contract import COMPOUND_NAMES
from caper_jax.sql.edit_script import EditScript, edit_script
from caper_jax.sql.execution import ExecResult, Executor, order_matters, results_equal
from caper_jax.sql.schema import Schema
from caper_jax.sql.suspects import suspect_reason, tie_equivalent, type_only


class GoldError(ValueError):
    """The gold query does not parse or does not run: nothing can be localised against it."""


@dataclasses.dataclass(frozen=True)
class Localization:
    correct: bool
    root_clause: str | None                 # None when correct
    clause_rewards: dict[str, float]         # prediction's clause position -> reward <= 0
    root_node: str | None                    # SQL text of v* (None: correct, or a missing clause)
    edit_script: tuple[dict, ...]            # minimum-cost edit ops, see edit_script.EditOp
    corrected_sql: str | None                # prediction with the root and later divergent clauses repaired
    reason: str                              # which rule of the module docstring applied
    pred_error_kind: str | None = None       # the prediction's execution error, if any
    suspect: str | None = None               # why the failure may not be an error (suspects.py), or None
    harmless: tuple[str, ...] = ()           # divergent clauses kept: harmless here, by execution
    corrected_verified: bool = False         # corrected_sql executes to gold's result
    executions: int = 0                      # queries executed beyond gold and prediction
    root_key: str | None = None              # Position.key of the root clause as written ("UNION#2")

    def as_dict(self) -> dict:
        return {"correct": self.correct, "root_clause": self.root_clause,
                "clause_rewards": self.clause_rewards, "root_node": self.root_node,
                "edit_script": list(self.edit_script), "corrected_sql": self.corrected_sql,
                "reason": self.reason, "pred_error_kind": self.pred_error_kind, "suspect": self.suspect,
                "harmless": list(self.harmless), "corrected_verified": self.corrected_verified,
                "executions": self.executions, "root_key": self.root_key}


def clause_units(sql: str) -> dict[Position, ClauseUnit]:
    """``split_clauses`` keyed by position; raises SqlParseError."""
    units = split_clauses(sql)
    return dict(zip(positions([u.name for u in units]), units))


class _Counting:
    """An executor wrapper that counts the queries asked of it (the extra executions)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.count = 0

    def execute(self, sql: str) -> ExecResult:
        self.count += 1
        return self.executor.execute(sql)


def localize(gold_sql: str, pred_sql: str, executor: Executor, schema: AnySchema | None = None,
             *, alpha: float = 1.0, sigma: float = 1.0, reference_edges: bool = False,
             semantics: str = "spider", rules: Sequence[str] | None = None, verify: bool = True,
             suspects: bool = True) -> Localization:
    """Localises the root cause of ``pred_sql`` against ``gold_sql`` (see module docstring).

    ``rules``: the equivalence rules of canonicalisation (default ``equivalences.rules_for
    (semantics)``; ``()`` for none). ``verify=False`` skips the execution-verified walk (the
    canonical comparison alone); ``suspects=False`` skips the suspect checks.
    """
    gold_result = executor.execute(gold_sql)
    if not gold_result.ok:
        raise GoldError(f"gold query does not run ({gold_result.error_kind}): {gold_result.error}")
    pred_result = executor.execute(pred_sql)
    ordered = order_matters(gold_sql)
    if pred_result.ok and results_equal(gold_result, pred_result, semantics=semantics, ordered=ordered):
        return Localization(True, None, {}, None, (), None, "execution_match")
    rules = equivalences.rules_for(semantics) if rules is None else tuple(rules)
    facts = equivalences.SchemaFacts.from_sqlite(executor.db_path) if hasattr(executor, "db_path") else None
    counting = _Counting(executor)
    found = localize_failed(gold_sql, pred_sql, schema, pred_result, alpha=alpha, sigma=sigma,
                            reference_edges=reference_edges, executor=counting if verify else None,
                            gold_result=gold_result, semantics=semantics, rules=rules, facts=facts)
    suspect = None
    if suspects:
        suspect = suspect_reason(gold_sql, pred_sql, gold_result, pred_result, counting, schema,
                                 semantics=semantics)
    return dataclasses.replace(found, suspect=suspect, executions=counting.count)


def localize_failed(gold_sql: str, pred_sql: str, schema: AnySchema | None,
                    pred_result: ExecResult, *, alpha: float, sigma: float,
                    reference_edges: bool, executor=None, gold_result: ExecResult | None = None,
                    semantics: str = "spider", rules: Sequence[str] | None = None,
                    facts: equivalences.SchemaFacts | None = None) -> Localization:
    """Localisation of a prediction already known to be wrong.

    With an ``executor`` (and ``gold_result``) the divergent clauses are walked and verified by
    execution (module docstring, rule 3); without one, the canonical comparison alone decides.
    """
    rules = equivalences.rules_for(semantics) if rules is None else tuple(rules)
    try:
        gold = canon.canonicalize(gold_sql, schema, rules=rules, facts=facts)
    except canon.CanonicalizeError as e:
        raise GoldError(f"gold query does not parse: {e}") from e
    error_kind = pred_result.error_kind
    try:
        pred = canon.canonicalize(pred_sql, schema, rules=rules, facts=facts)
    except canon.CanonicalizeError as e:
        return _unparseable(gold_sql, pred_sql, e.__cause__, alpha, error_kind or "parse")

    gold_slots = _by_position(canon.clause_slots(gold.tree))
    pred_slots = _by_position(canon.clause_slots(pred.tree))
    divergent = divergent_positions(gold_slots, pred_slots)
    if not divergent and rules:
        # The equivalences left no clause that differs, yet the results differ (SQLite's type
        # affinity can make equated columns print apart): compare the plain canonical forms.
        gold = canon.canonicalize(gold_sql, schema, rules=())
        pred = canon.canonicalize(pred_sql, schema, rules=())
        gold_slots = _by_position(canon.clause_slots(gold.tree))
        pred_slots = _by_position(canon.clause_slots(pred.tree))
        divergent = divergent_positions(gold_slots, pred_slots)
    if not divergent:
        fallback = _textual_root(gold_sql, pred_sql) or Position("SELECT")
        rewards = {p.key: (-alpha if p == fallback else 0.0) for p in pred_slots}
        rewards.setdefault(fallback.key, -alpha)
        return Localization(False, fallback.name, rewards, None, (), None, "no_canonical_difference", error_kind,
                            root_key=fallback.key)

    if executor is None or gold_result is None:
        walk = _Walk(canonical_root(gold_slots, pred_slots, divergent), (), None, "canonical_fallback:no_executor")
    else:
        walk = _verified_walk(gold, pred, gold_slots, pred_slots, divergent, executor, gold_result,
                              order_matters(gold_sql), semantics, schema, pred_result)
        if walk.reason.startswith("canonical_fallback") and rules:
            # A rule can make the prediction's clause name a table gold's FROM lacks (an equated
            # column's representative): walk the plain canonical forms, whose hybrids verify the
            # same surface differences by execution instead.
            plain_gold = canon.canonicalize(gold_sql, schema, rules=())
            plain_pred = canon.canonicalize(pred_sql, schema, rules=())
            plain_gold_slots = _by_position(canon.clause_slots(plain_gold.tree))
            plain_pred_slots = _by_position(canon.clause_slots(plain_pred.tree))
            plain_divergent = divergent_positions(plain_gold_slots, plain_pred_slots)
            if plain_divergent:
                plain = _verified_walk(plain_gold, plain_pred, plain_gold_slots, plain_pred_slots,
                                       plain_divergent, executor, gold_result, order_matters(gold_sql),
                                       semantics, schema, pred_result)
                if plain.reason == "verified":
                    walk = dataclasses.replace(plain, reason="verified:without_rules")
                    gold, pred, gold_slots, pred_slots = plain_gold, plain_pred, plain_gold_slots, plain_pred_slots
                    divergent = plain_divergent
    if walk.reason == "verified" and walk.root == Position("FROM") and executor is not None:
        # A FROM that leaves out a table the prediction reads in a WHERE/HAVING subquery instead is
        # a restructuring, not yet an error: the subquery is tried as the fallback tries it.
        left = divergent[divergent.index(walk.root):]
        restructured = _restructured_root(walk.root, gold, pred, left, executor, gold_result, semantics,
                                          order_matters(gold_sql), schema)
        if restructured is not None and restructured != walk.root:
            walk = _Walk(restructured, walk.kept, None, "verified:restructured", walk.repair_also + (walk.root,))
    walk = _compound_as_filter(walk, gold, pred, gold_slots, pred_slots, divergent)
    position = walk.root
    at = divergent.index(position) if position in divergent else None
    repaired = [p for i, p in enumerate(divergent)
                if (i >= at if at is not None else position_rank(p) >= position_rank(position))
                or p in walk.repair_also]
    corrected, verified = _corrected(walk, gold, pred, pred_sql, repaired, executor, gold_result,
                                     order_matters(gold_sql), semantics)
    found = _counterfactual(position, gold, pred, gold_slots.get(position), pred_slots.get(position),
                            pred_sql, schema, alpha, sigma, reference_edges, error_kind)
    return dataclasses.replace(found, corrected_sql=corrected, corrected_verified=verified, reason=walk.reason,
                               harmless=tuple(p.key for p in walk.kept))


def divergent_positions(gold: dict[Position, ClauseSlot], pred: dict[Position, ClauseSlot]) -> list[Position]:
    """Every position, in written order, whose canonical clauses differ (or exist on one side)."""
    return [p for p in align(list(gold), list(pred)) if _differs(gold.get(p), pred.get(p))]


def divergent_position(gold: dict[Position, ClauseSlot],
                       pred: dict[Position, ClauseSlot]) -> Position | None:
    """The canonical root: the first divergent position in written order (``canonical_root``)."""
    divergent = divergent_positions(gold, pred)
    return canonical_root(gold, pred, divergent) if divergent else None


def canonical_root(gold: dict[Position, ClauseSlot], pred: dict[Position, ClauseSlot],
                   candidates: Sequence[Position]) -> Position:
    """The first of ``candidates`` (divergent positions in written order).

    Qualification makes a column carry its table, so a wrong table in FROM also changes the
    SELECT written before it. A clause that differs from gold only in which tables its columns
    name is therefore passed over when the FROM clause of the same query differs: the FROM is
    the root cause there.
    """
    from_position = Position("FROM")
    from_differs = from_position in candidates
    first = candidates[0]
    if (from_differs and position_rank(first) < position_rank(from_position)
            and not _differs(gold.get(first), pred.get(first), qualifiers=False)):
        return from_position
    return first


@dataclasses.dataclass(frozen=True)
class _Walk:
    root: Position
    kept: tuple[Position, ...]               # divergent clauses shown harmless, before the root
    corrected: exp.Expression | None         # a corrected tree already verified, if any
    reason: str
    repair_also: tuple[Position, ...] = ()   # kept clauses the corrected query repairs too


def _verified_walk(gold: Canonical, pred: Canonical, gold_slots, pred_slots, divergent: list[Position],
                   executor, gold_result: ExecResult, ordered: bool, semantics: str,
                   schema: AnySchema | None = None, pred_result: ExecResult | None = None) -> _Walk:
    """Rule 3 of the module docstring: keep each divergent clause whose hybrid gives gold's result."""
    kept: list[Position] = []
    also: list[Position] = []           # kept clauses the corrected query repairs all the same
    verified: exp.Expression | None = None

    def fallback(candidates: list[Position]) -> _Walk:
        # The canonical comparison names the root among ``candidates``; a prediction that reads
        # gold's tables through subqueries is first tried with gold's FROM (verified:restructured).
        root = canonical_root(gold_slots, pred_slots, candidates)
        restructured = _restructured_root(root, gold, pred, divergent[i:], executor, gold_result,
                                          semantics, ordered, schema)
        if restructured is not None:
            return _Walk(restructured, tuple(kept), None, "verified:restructured",
                         tuple(also) + (Position("FROM"),))
        return _Walk(root, tuple(kept), verified, "canonical_fallback:hybrid_fails", tuple(also))

    i = 0
    while i < len(divergent):
        position = divergent[i]
        if i == len(divergent) - 1:     # keeping every divergent clause is the prediction itself
            return _Walk(position, tuple(kept), verified, "verified", tuple(also))
        # The hybrid keeps divergent[i..j] and repairs the rest. A prediction's clause that does
        # not fit gold's later clauses (it names a table gold's FROM lacks, ...) is tried together
        # with the clauses after it, until a hybrid runs.
        for j in range(i, len(divergent) - 1):
            hybrid = _repair_all(pred.tree, gold.tree, divergent[j + 1:])
            if hybrid is not None and isinstance(schema, Schema):
                hybrid = _rehome(hybrid, schema, _join_equalities(pred.tree))
            result = _run(executor, hybrid) if hybrid is not None else None
            if result is not None and result.ok:
                break
            if result is not None and result.error_kind in ("timeout", "too_many_rows"):
                result = None       # a runaway hybrid: do not try bigger ones, each as slow
                break
        else:
            j = len(divergent) - 1
            hybrid = result = None
        if result is None:
            # No hybrid that keeps this clause runs (a join rewritten as a subquery, scopes that
            # do not line up): the canonical comparison decides among the clauses left.
            return fallback(divergent[i:])
        if _same_answer(gold.tree, gold_result, result, executor, semantics, ordered):
            kept.extend(divergent[i:j + 1])
            verified = hybrid
            i = j + 1
            continue
        if j == i and position == Position("SELECT"):
            distinct_only = _distinct_cannot_matter(hybrid, gold, pred, executor, gold_result, pred_result,
                                                    semantics, ordered)
            if distinct_only is not None:
                kept.append(position)
                verified = distinct_only
                i += 1
                continue
        if (j == i and Position("FROM") in divergent[i + 1:]
                and position_rank(position) < position_rank(Position("FROM"))
                and not _differs(gold_slots.get(position), pred_slots.get(position), qualifiers=False)):
            # The clause names gold's columns, read from the prediction's tables: a wrong FROM,
            # copied into it by qualification, is the cause (canonical_root's exception).
            kept.append(position)
            also.append(position)
            verified = None     # the corrected query repairs this clause too
            i += 1
            continue
        if j == i:
            return _Walk(position, tuple(kept), verified, "verified", tuple(also))
        # Kept together the clauses change the answer, alone they do not run: which of them is
        # to blame is the canonical comparison's call.
        return fallback(divergent[i:j + 1])
    raise AssertionError("unreachable: the last divergent clause is always the root")


def _compound_as_filter(walk: _Walk, gold: Canonical, pred: Canonical, gold_slots, pred_slots,
                        divergent: list[Position]) -> _Walk:
    """Where one side combines queries (UNION / INTERSECT / EXCEPT) and the other writes the same
    set logic inside one query, the clause that carries it in the prediction is the root -- "the
    earliest decisive error in written order" read on the prediction's own structure -- even where
    a hybrid that adds gold's operator after it gives gold's answer. Not when the walk's root is
    written before FROM (a wrong SELECT stays the root).

    Gold compound, the prediction one query:

    * a FROM that inner-joins a table gold reads only in a right-hand operand (``A JOIN B`` for
      ``A INTERSECT B``): the join itself decides which rows come out, so FROM is the root;
    * else a WHERE that differs from gold's (``OR``, ``IN``, ``NOT IN``, ``IS NULL`` after a LEFT
      JOIN) is the root, ahead of a FROM that only feeds it and of the missing operator -- unless
      the walk verified FROM decisive and it joins a table beyond gold's first operand (not a mere
      restructuring of it).

    Gold one query, the prediction compound: a first-operand WHERE that is one operand of gold's
    own AND / OR (``WHERE a INTERSECT … WHERE b`` for ``WHERE a OR b``) is a piece of gold's
    condition, split off by the operator, and a first operand without a WHERE left the whole
    filter to the operator (``EXCEPT …`` for ``WHERE x NOT IN (…)``): the prediction's first
    operator unit is the root.
    """
    where, from_ = Position("WHERE"), Position("FROM")
    gold_compound = any(p.name in COMPOUND_NAMES for p in gold_slots)
    pred_compound = [p for p in pred_slots if p.name in COMPOUND_NAMES]
    if position_rank(walk.root) < position_rank(from_) or gold_compound == bool(pred_compound):
        return walk
    if pred_compound:
        if walk.root != where or where not in gold_slots:
            return walk
        if where in pred_slots:
            pieces = {canon.canonical_key(c) for c in _operands(_first_select(gold.tree).args["where"].this)}
            if canon.canonical_key(_first_select(pred.tree).args["where"].this) not in pieces:
                return walk
        # (no WHERE of its own: gold's whole filter went into the operator, NOT IN as EXCEPT)
        return _Walk(pred_compound[0], walk.kept, None, "verified:filter_as_compound", walk.repair_also)
    first = _first_select(gold.tree)
    first_tables = {t.name.lower() for t in _sources(first) if isinstance(t, exp.Table)}
    later_tables = {t.name.lower() for t in gold.tree.find_all(exp.Table)} - first_tables
    select = _first_select(pred.tree)
    inner = [j.this for j in select.args.get("joins") or []
             if not j.args.get("side") and (j.args.get("kind") or "").upper() in ("", "INNER", "CROSS")]
    if from_ in divergent and any(isinstance(t, exp.Table) and t.name.lower() in later_tables for t in inner):
        root = from_
    elif where in divergent and where in pred_slots and walk.root != where:
        beyond = any(not isinstance(t, exp.Table) or t.name.lower() not in first_tables for t in _sources(select))
        if walk.root == from_ and beyond:
            return walk
        root = where
    else:
        return walk
    if root == walk.root:
        return walk
    before = [p for p in divergent[:divergent.index(root)] if p not in walk.kept]
    return _Walk(root, tuple(p for p in walk.kept if p != root), None, "verified:compound_as_filter",
                 tuple(walk.repair_also) + tuple(before))


def _sources(select: exp.Expression) -> list[exp.Expression]:
    """The table sources of a SELECT's own FROM (its FROM and its joins)."""
    if not isinstance(select, exp.Select):
        return []
    return ([select.args["from_"].this] if select.args.get("from_") else []) + \
        [j.this for j in select.args.get("joins") or []]


def _operands(node: exp.Expression) -> list[exp.Expression]:
    """The top-level operands of an AND / OR chain (the node itself when it is neither)."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, (exp.And, exp.Or)):
        return _operands(node.this) + _operands(node.expression) + [node]
    return [node]


def _restructured_root(root: Position, gold: Canonical, pred: Canonical, left: list[Position], executor,
                       gold_result: ExecResult, semantics: str, ordered: bool, schema) -> Position | None:
    """The root when the prediction's FROM cannot be judged alone because it reads a table of
    gold's FROM elsewhere (a join written as an IN-subquery, or the reverse).

    Only when the canonical comparison would blame FROM, the prediction's FROM joins only tables
    of gold's FROM, and the prediction reads every table of gold's FROM somewhere: then its WHERE and HAVING, where such subqueries live, are tried
    alone -- the prediction's clause kept, every other divergent clause (FROM included) gold's.
    The first whose query does not give gold's answer is the root; if each gives it, FROM is
    (and the corrected query repairs FROM too). None where a query does not
    run (the canonical comparison stands).
    """
    from_position = Position("FROM")
    if root != from_position or from_position not in left:
        return None
    gold_from = _first_select(gold.tree)
    sources = ([gold_from.args["from_"].this] if gold_from.args.get("from_") else []) + \
        [j.this for j in gold_from.args.get("joins") or []]
    gold_tables = {t.name.lower() for t in sources if isinstance(t, exp.Table)}
    pred_from = _first_select(pred.tree)
    pred_sources = ([pred_from.args["from_"].this] if pred_from.args.get("from_") else []) + \
        [j.this for j in pred_from.args.get("joins") or []]
    pred_tables = {t.name.lower() for t in pred.tree.find_all(exp.Table)}
    if not gold_tables or not gold_tables <= pred_tables:
        return None         # the prediction never reads a table gold joins: its FROM lacks it
    if not all(isinstance(t, exp.Table) and t.name.lower() in gold_tables for t in pred_sources):
        return None         # its FROM joins what gold's does not: not a restructuring
    own = {p: slot for p, slot in _by_position(canon.clause_slots(pred.tree)).items()}
    # Only the prediction's own WHERE / HAVING can hold the subquery that reads the table: a
    # clause it lacks is gold's alone and tells nothing about the restructuring.
    for position in [p for p in left if p.name in ("WHERE", "HAVING") and p in own]:
        hybrid = _repair_all(pred.tree, gold.tree, [p for p in left if p != position])
        if hybrid is None:
            return None
        if isinstance(schema, Schema):
            hybrid = _rehome(hybrid, schema, _join_equalities(pred.tree))
        result = _run(executor, hybrid)
        if not result.ok:
            return None
        if not _same_answer(gold.tree, gold_result, result, executor, semantics, ordered):
            return position
    return from_position


def _run(executor, tree: exp.Expression) -> ExecResult:
    """Executes a built query; one sqlglot cannot render counts as SQL that does not parse."""
    try:
        sql = tree.sql(dialect=canon.DIALECT)
    except SqlglotError as e:
        return ExecResult(error_kind="parse", error=f"cannot render: {e}")
    return executor.execute(sql)


def _first_select(tree: exp.Expression) -> exp.Expression:
    while isinstance(tree, exp.SetOperation):
        tree = tree.this
    return tree


def _distinct_cannot_matter(hybrid: exp.Expression, gold: Canonical, pred: Canonical, executor,
                            gold_result: ExecResult, pred_result: ExecResult | None, semantics: str,
                            ordered: bool) -> exp.Expression | None:
    """A SELECT that differs from gold's answer only by its DISTINCT, where that DISTINCT cannot
    matter on the prediction's own query: the hybrid with gold's DISTINCT gives gold's answer, and
    the rows the prediction's FROM and GROUP BY make for its SELECT hold no duplicates (WHERE,
    HAVING, ORDER BY and LIMIT left out). Duplicates come from joins; gold's joins are not the
    prediction's. Returns that hybrid."""
    pred_distinct = _first_select(pred.tree).args.get("distinct")
    gold_distinct = _first_select(gold.tree).args.get("distinct")
    if bool(pred_distinct) == bool(gold_distinct) or pred_result is None or not pred_result.ok:
        return None
    with_gold = hybrid.copy()
    _first_select(with_gold).set("distinct", gold_distinct.copy() if gold_distinct else None)
    result = _run(executor, with_gold)
    if not _same_answer(gold.tree, gold_result, result, executor, semantics, ordered):
        return None
    # The prediction's own rows as its FROM (and GROUP BY) make them, before any filter: a filter
    # or LIMIT that happens to leave no duplicate proves nothing about the DISTINCT.
    if not isinstance(pred.tree, exp.Select):
        return None
    own_query = pred.tree.copy()
    for key in ("distinct", "where", "having", "order", "limit", "offset"):
        own_query.set(key, None)
    own = _run(executor, own_query)
    if not own.ok:
        return None
    return with_gold if len(set(own.rows)) == len(own.rows) else None


def _join_equalities(tree: exp.Expression) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(table, column) -> the columns the outer query's join conditions equate it with."""
    out: dict[tuple[str, str], set[tuple[str, str]]] = {}
    select = _first_select(tree)
    for join in select.args.get("joins") or [] if isinstance(select, exp.Select) else []:
        on = join.args.get("on")
        for eq_ in (on.find_all(exp.EQ) if on is not None else []):
            a, b = eq_.this, eq_.expression
            if isinstance(a, exp.Column) and isinstance(b, exp.Column) and a.table and b.table:
                out.setdefault((a.table, a.name), set()).add((b.table, b.name))
                out.setdefault((b.table, b.name), set()).add((a.table, a.name))
    return out


def _rehome(tree: exp.Expression, schema: Schema,
            equated: dict[tuple[str, str], set[tuple[str, str]]] | None = None) -> exp.Expression:
    """Columns of the outer query whose table is not in its FROM, read from a table that is.

    A hybrid keeps the prediction's earlier clause with gold's FROM; a column of a table only the
    prediction joined is then read where gold's FROM holds the same value -- the column the
    prediction's own join condition equates it with, else the one table there with a column of
    that name, else the one column a foreign key ties to it -- as a reader would rewrite the
    prediction's clause into gold's scope ("columns are judged by what they denote"). A column
    with no such unique home is left as it is (the hybrid then does not run).
    """
    select = tree
    while isinstance(select, exp.SetOperation):
        select = select.this
    if not isinstance(select, exp.Select):
        return tree
    instances = {}
    for source in ([select.args["from_"].this] if select.args.get("from_") else []) + \
            [j.this for j in select.args.get("joins") or []]:
        if isinstance(source, exp.Table):
            instances[source.alias_or_name] = source.name
    for column in list(select.find_all(exp.Column)):
        if (not column.table or column.table in instances or isinstance(column.this, exp.Star)
                or column.find_ancestor(exp.Select) is not select):
            continue
        home = _home(column, instances, schema, equated or {})
        if home is not None:
            column.set("table", exp.to_identifier(home[0]))
            column.set("this", exp.to_identifier(home[1]))
    return tree


def _home(column: exp.Column, instances: dict[str, str], schema: Schema,
          equated: dict[tuple[str, str], set[tuple[str, str]]]) -> tuple[str, str] | None:
    name = column.name.lower()
    joined = {ref for ref in equated.get((column.table, column.name), ()) if ref[0] in instances}
    if len(joined) == 1:
        return joined.pop()
    same = [alias for alias, table in instances.items()
            if schema.has_table(table) and schema.column(table, name) is not None]
    if len(same) == 1:
        return same[0], name
    table = re.sub(r"_\d+$", "", column.table) if not schema.has_table(column.table) else column.table
    linked = set()
    for fk in schema.foreign_keys:
        ends = [((fk.table.lower(), fk.column.lower()), (fk.ref_table.lower(), fk.ref_column.lower()))]
        ends.append(ends[0][::-1])
        for (t, c), (rt, rc) in ends:
            if (t, c) == (table.lower(), name):
                linked |= {(alias, rc) for alias, real in instances.items() if real.lower() == rt}
    return linked.pop() if len(linked) == 1 else None


def _corrected(walk: _Walk, gold: Canonical, pred: Canonical, pred_sql: str, repaired: list[Position],
               executor, gold_result: ExecResult | None, ordered: bool, semantics: str
               ) -> tuple[str | None, bool]:
    """The corrected query's text and whether it executes to gold's result.

    The prediction with the root and every later divergent clause repaired (the harmless ones
    before the root stay): spliced into the prediction's own text where that runs to gold's
    result, else the whole corrected tree in the prediction's aliases, else in canonical names.
    """
    tree = walk.corrected if walk.corrected is not None else _repair_all(pred.tree, gold.tree, repaired)
    if tree is None:
        return None, False
    aliased = _with_aliases(tree, pred.aliases).sql(dialect=canon.DIALECT)
    candidates = [_splice(pred_sql, aliased, repaired), aliased, tree.sql(dialect=canon.DIALECT)]
    candidates = [c for i, c in enumerate(candidates) if c is not None and c not in candidates[:i]]
    if executor is None or gold_result is None:
        return candidates[0], False
    for text in candidates:
        result = executor.execute(text)
        if result.ok and _same_answer(gold.tree, gold_result, result, executor, semantics, ordered):
            return text, True
    return candidates[0], False


def _same_answer(gold_tree: exp.Expression, gold_result: ExecResult, result: ExecResult, executor,
                 semantics: str, ordered: bool) -> bool:
    """gold's result, up to the types of equal values (``1`` against ``'1'``) or another break of
    the ties of its ORDER BY: a hybrid that differs from gold only so did not change what the
    query answers (the hand-labelling rules count neither as an error)."""
    if not result.ok:
        return False
    if results_equal(gold_result, result, semantics=semantics, ordered=ordered):
        return True
    if type_only(gold_result, result, semantics=semantics, ordered=ordered):
        return True
    return ordered and tie_equivalent(gold_tree, gold_result, result, executor)


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
    root = position.key
    if p is None:
        rewards[position.key] = -alpha      # the missing clause's position
    else:
        # Blame lies in the clause v*'s text is written in (a condition an equivalence rule moved
        # into FROM is still the WHERE's): the pairs are cut from the query as written.
        root = propagation.written_root(query, v_star) or position.key
    return Localization(False, _position(root).name, rewards, root_node,
                        tuple(op.as_dict() for op in script.ops), None, "divergent_clause", error_kind,
                        root_key=root)


def _position(key: str) -> Position:
    """Inverse of ``Position.key``: ``"UNION#2"`` -> Position("UNION", 1)."""
    name, _, number = key.partition("#")
    return Position(name, int(number) - 1 if number else 0)


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

def _splice(pred_sql: str, rendered: str, repaired: Sequence[Position]) -> str | None:
    """The prediction's text with each repaired clause replaced by its text in ``rendered``
    (inserted before the next clause when the prediction lacks it, removed when gold lacks it),
    right to left so that earlier offsets stay valid. None when either text does not split."""
    try:
        new_units, old_units = clause_units(rendered), clause_units(pred_sql)
    except SqlParseError:
        return None
    text = pred_sql
    order = align(list(old_units), list(new_units))       # written order, compound units as written
    for position in sorted((p for p in repaired if p in order), key=order.index, reverse=True):
        new, old = new_units.get(position), old_units.get(position)
        if old is not None and new is not None:
            text = text[:old.start] + new.text + text[old.end:]
        elif old is not None:         # gold lacks the clause: drop it
            text = (text[:old.start].rstrip() + " " + text[old.end:].lstrip()).strip()
        elif new is not None:         # the prediction lacks it: insert before the next clause
            later = [old_units[p] for p in order[order.index(position) + 1:] if p in old_units]
            at = min((u.start for u in later), default=len(text.rstrip().rstrip(";").rstrip()))
            text = (text[:at].rstrip() + " " + new.text + " " + text[at:].lstrip()).strip()
    return text


def _repair(pred_tree: exp.Expression, gold_tree: exp.Expression, position: Position) -> exp.Expression:
    """Copy of pred's canonical tree with gold's clause at ``position`` (set, replaced or removed)."""
    return _apply_repair(pred_tree.copy(), gold_tree, position)


def _repair_all(pred_tree: exp.Expression, gold_tree: exp.Expression,
                repaired: Sequence[Position]) -> exp.Expression | None:
    """Copy of pred's canonical tree with gold's clauses at every position of ``repaired``, in
    written order (compound operators before the ORDER BY / LIMIT of the compound result). None
    when gold's clause has no place in the prediction's structure."""
    tree = pred_tree.copy()
    try:
        for position in sorted(repaired, key=position_rank):
            tree = _apply_repair(tree, gold_tree, position)
    except (KeyError, IndexError, AttributeError, TypeError):
        return None
    return tree


def _apply_repair(repaired: exp.Expression, gold_tree: exp.Expression, position: Position) -> exp.Expression:
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
            left = p.this
            for key in _RESULT_ARGS:          # ORDER BY / LIMIT of the compound result stay the query's
                if p.args.get(key) is not None:
                    left.set(key, p.args[key])
            return left
        p.replace(p.this)
        return pred
    if g is None:
        raise KeyError(f"no {position.key} on either side")
    moved = {key: pred.args.get(key) for key in _RESULT_ARGS if pred.args.get(key) is not None}
    for key in moved:
        pred.set(key, None)
    return type(g)(this=pred, expression=g.expression.copy(), distinct=g.args.get("distinct"), **moved)


_RESULT_ARGS = ("order", "limit", "offset")


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
    keyed = list(zip(positions([name for name, _ in clauses]), (start for _, start in clauses)))
    offset, token = _error_offset(pred_sql, error)
    root: Position | None = None
    if offset is not None and keyed:
        # By occurrence: an error in the second UNION is the second UNION's, not the first's.
        before = [position for position, start in keyed if start <= offset]
        root = before[-1] if before else keyed[0][0]
    if root is None:
        root = _textual_root(gold_sql, pred_sql) or Position("SELECT")
    keys = [position.key for position, _ in keyed] or [root.key]
    rewards = {k: (-alpha if k == root.key else 0.0) for k in keys}
    rewards.setdefault(root.key, -alpha)
    return Localization(False, root.name, rewards, token, (), None, "parse_error", error_kind, root_key=root.key)


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


def _textual_root(gold_sql: str, pred_sql: str) -> Position | None:
    """First clause position whose whitespace/case-normalised text differs between the two queries."""
    def units(sql: str) -> dict[Position, str]:
        found = text_clauses(sql)
        names = positions([n for n, _ in found])
        ends = [s for _, s in found[1:]] + [len(sql)]
        return {p: " ".join(sql[s:e].lower().split()).rstrip(";") for p, (_, s), e in zip(names, found, ends)}
    g, p = units(gold_sql), units(pred_sql)
    for position in align(list(g), list(p)):
        if g.get(position) != p.get(position):
            return position
    return None
