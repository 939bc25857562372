"""Clause-level preference tuples, from fault injection and from counterfactual repair.

A tuple compares two clause *states*: ``prefix + clause`` of a positive query against the same
position of a negative query. Positions are aligned by clause name in written order
(``canonical.align``: compound units as each query writes them). The positive side is the
reference, so its clause rewards are 0; the negative side's rewards come from propagation out of
its root-cause node, in the clauses as the negative is written (``propagation``). A tuple is
emitted at a position when

    delta = r(u+) - r(u-) >= margin_floor     and     (prefix+, u+) != (prefix-, u-)

The second condition drops positions where both states are the same text: a preference between
identical inputs teaches nothing. Every tuple is then checked against the invariants of
``caper_jax.sql.invariants`` (both states cut from their queries at clause boundaries, different
clause texts, the root never on a within-trajectory pair's chosen side, margin in (0, alpha]); one
that breaks any is dropped and counted by reason (``Annotation.dropped``, the build summary's
``dropped_by_reason``). Where a position exists on one side only (a missing or an extra clause),
the other side's state at that point is the clause it wrote next; if it wrote nothing more, it is
its last clause followed by the end of the query.

**The end of the query is part of the last clause's state.** The last clause of a query is
written ``clause + END_OF_SQL`` (the token the policy stops on, ``caper_jax.sql.contract``), so
the PRM reads it after the query has ended. Why: a query that lacks its trailing WHERE is, up to
FROM's last token, exactly a correct prefix; only "and here it ends" is wrong, and a causal model
can blame FROM for it only if it sees the end. Scoring a whole query does the same
(``caper_jax.data.prm_scoring_batches.score_batch``, GRPO's clause ends in ``caper_jax.policy.rollout``).

Sources:

* **mutation** (gold is positive, a type-preserving mutation of gold that changes the result is
  negative; provenance ``mutation:<kind>``). v* is the mutated node. When the mutator re-rendered
  the SQL with sqlglot, the gold is rendered the same way, so that both sides share their prefix
  character for character.
* **counterfactual** (the repaired prediction is positive, the prediction negative; provenance
  ``counterfactual``), from ``localize.localize``. A *suspect* failure (``Localization.suspect``:
  a tie under ORDER BY ... LIMIT, a type-only difference, gold's literal-case slip) gives no tuples unless
  ``AnnotationSettings.suspect_tuples``; the build summary counts it as kind ``suspect:<reason>``.

Within-trajectory tuples (our extension beyond the paper, ``AnnotationSettings.within_trajectory``).
Aligned tuples teach what a wrong clause is worth against an alternative clause at the same place;
root-cause localisation ranks the clauses of ONE failed query against each other, which aligned
tuples never compare. So each negative query also yields, for every clause k of its own

    (prefix_k, clause_k)  >  (prefix_root, clause_root)     with  delta = r_k - r_root >= margin_floor

where the root is the clause propagation gave the lowest reward (-alpha, first in written order on
a tie); a root position the negative lacks (a missing clause) is represented, as above, by the
clause it wrote next, or by its last clause and the end of the query. Both states come from the negative's own text, so their prefixes differ.
``clause`` names the root position (the blamed state); provenance is ``within:<mutation kind>`` or
``within:counterfactual``.

The ``schema`` field is ``caper_jax.sql.contract.serialize_schema`` of the database's tables.json
record when one is given, else of a record built from the SQLite catalogue (``tables_entry``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import pathlib
import random
from collections.abc import Mapping

from caper_jax.sql import canonical as canon
from caper_jax.sql import invariants, propagation
from caper_jax.sql.canonical import AnySchema, Position, after, align, position_rank, positions
from caper_jax.sql.clauses import ClauseUnit, SqlParseError, render_sql, split_clauses
from caper_jax.sql.contract import END_OF_SQL, serialize_schema
from caper_jax.sql.execution import Executor, Executors, database_dirs_of
from caper_jax.sql.localize import GoldError, Localization, localize
from caper_jax.sql.mutations import SITE_BALANCES, Negative, inject_faults
from caper_jax.sql.schema import Schema


# Bumped whenever the same settings would write different tuples (caches key on it). 2: the last
# clause's state ends with END_OF_SQL, and a clause missing at the end is blamed on it. 3: roots
# verified by execution, equivalence rules in canonicalisation, suspect failures left out. 4: rewards
# in the clauses as written, reference edges off by default, every tuple checked against the
# invariants (caper_jax.sql.invariants), a literal's case an error, compound units as written.
TUPLE_FORMAT = 4


@dataclasses.dataclass
class PreferenceTuple:
    question: str          # as the prompts show it: BIRD's evidence on a Hint line (contract.prompt_question)
    db_id: str
    schema: str            # serialised schema
    clause: str            # clause name of the compared position
    prefix_chosen: str     # SQL text before the chosen clause (may be "")
    chosen: str            # u+ clause text
    prefix_rejected: str
    rejected: str          # u- clause text
    margin: float          # delta = r(u+) - r(u-) > 0
    provenance: str        # "mutation:<kind>" | "counterfactual" | "within:<kind>" | "within:counterfactual"
    gold_sql: str
    negative_sql: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Context:
    """What every tuple of one example shares."""
    question: str
    db_id: str
    schema: str
    gold_sql: str


def aligned_tuples(context: Context, *, positive_sql: str, positive_rewards: Mapping[str, float],
                   negative_sql: str, negative_rewards: Mapping[str, float], margin_floor: float,
                   provenance: str) -> list[PreferenceTuple]:
    """Tuples at every aligned position whose margin reaches the floor (module docstring)."""
    if margin_floor <= 0:
        raise ValueError(f"margin_floor must be > 0, got {margin_floor}")
    pos_units, neg_units = _units(positive_sql), _units(negative_sql)
    out = []
    order = align(list(pos_units), list(neg_units))
    for position in order:
        margin = positive_rewards.get(position.key, 0.0) - negative_rewards.get(position.key, 0.0)
        if margin < margin_floor:
            continue
        chosen = _state_at(pos_units, position, order)
        rejected = _state_at(neg_units, position, order)
        if chosen is None or rejected is None:
            continue
        prefix_chosen, chosen_text = state_text(positive_sql, pos_units, chosen)
        prefix_rejected, rejected_text = state_text(negative_sql, neg_units, rejected)
        if (prefix_chosen, chosen_text) == (prefix_rejected, rejected_text):
            continue
        out.append(PreferenceTuple(
            question=context.question, db_id=context.db_id, schema=context.schema,
            clause=position.name, prefix_chosen=prefix_chosen, chosen=chosen_text,
            prefix_rejected=prefix_rejected, rejected=rejected_text, margin=float(margin),
            provenance=provenance, gold_sql=context.gold_sql, negative_sql=negative_sql))
    return out


def _state_at(units: dict[Position, ClauseUnit], position: Position,
              order: list[Position] | None = None) -> ClauseUnit | None:
    """The unit at ``position``, or the one written next in its place, or (nothing written after
    it) the query's last unit, whose state includes the end of the query (module docstring).

    ``order``: the written order of both queries' positions (``align``); without it, the order of
    ``units`` with ``position`` placed by ``align`` (a compound unit before the query's own).
    """
    if position in units:
        return units[position]
    order = order if order is not None else align(list(units), [position])
    nxt = after(order, position, units)
    if nxt is not None:
        return units[nxt]
    return units[list(units)[-1]] if units else None


def state_text(sql: str, units: dict[Position, ClauseUnit], unit: ClauseUnit) -> tuple[str, str]:
    """(prefix, clause) of ``unit`` in ``sql``; the last unit's clause ends with ``END_OF_SQL``."""
    final = unit.end == max(u.end for u in units.values())
    return sql[:unit.start], unit.text + (END_OF_SQL if final else "")


def within_trajectory_tuples(context: Context, *, negative_sql: str, negative_rewards: Mapping[str, float],
                             margin_floor: float, provenance: str) -> list[PreferenceTuple]:
    """Every clause of one negative query against its own root clause (module docstring).

    ``negative_rewards`` maps position keys to propagated rewards (absent: 0). Raises SqlParseError
    when ``negative_sql`` does not split into clauses.
    """
    if margin_floor <= 0:
        raise ValueError(f"margin_floor must be > 0, got {margin_floor}")
    if not negative_rewards:
        return []
    units = _units(negative_sql)
    ranked = sorted(negative_rewards, key=lambda k: (negative_rewards[k], position_rank(_position(k))))
    root_position = _position(ranked[0])
    root_reward = negative_rewards[ranked[0]]
    root = _state_at(units, root_position)
    if root is None:
        return []
    prefix_rejected, rejected_text = state_text(negative_sql, units, root)
    out = []
    for position, unit in units.items():
        margin = negative_rewards.get(position.key, 0.0) - root_reward
        if unit is root or margin < margin_floor:
            continue
        prefix_chosen, chosen_text = state_text(negative_sql, units, unit)
        out.append(PreferenceTuple(
            question=context.question, db_id=context.db_id, schema=context.schema,
            clause=root_position.name, prefix_chosen=prefix_chosen, chosen=chosen_text,
            prefix_rejected=prefix_rejected, rejected=rejected_text, margin=float(margin),
            provenance=provenance, gold_sql=context.gold_sql, negative_sql=negative_sql))
    return out


@functools.lru_cache(maxsize=4096)
def _units(sql: str) -> dict[Position, ClauseUnit]:
    """``clause_units``, cached: a negative is cut for its aligned pairs, its within pairs and its
    root state, a gold once for all its negatives. Spans only (``ClauseUnit.node`` None); callers
    only read the dict."""
    units = split_clauses(sql, nodes=False)
    return dict(zip(positions([u.name for u in units]), units))


@functools.lru_cache(maxsize=1024)
def _rendered(gold_sql: str) -> str:
    """The gold rendered as the mutator renders its mutants (sqlglot, SQLite dialect)."""
    return render_sql(canon.parse(gold_sql))


def _position(key: str) -> Position:
    """Inverse of ``Position.key``: ``"UNION#2"`` -> Position("UNION", 1)."""
    name, _, number = key.partition("#")
    return Position(name, int(number) - 1 if number else 0)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A tuple with the whole query its chosen state is cut from, and why it was dropped (None: kept)."""
    tuple: PreferenceTuple
    positive_sql: str
    dropped: str | None = None


def checked(tuples: list[PreferenceTuple], *, positive_sql: str, alpha: float, within: bool,
            root_state: tuple[str, str] | None) -> list[Pair]:
    """Each tuple with the first invariant it breaks (``caper_jax.sql.invariants``), or None."""
    return [Pair(t, positive_sql, invariants.violation(t, positive_sql=positive_sql, alpha=alpha, within=within,
                                                       root_state=root_state)) for t in tuples]


def root_state(sql: str, root_key: str | None) -> tuple[str, str] | None:
    """(prefix, clause) the negative wrote at the position of the clause holding v*."""
    if root_key is None:
        return None
    try:
        units = _units(sql)
    except SqlParseError:
        return None
    unit = _state_at(units, _position(root_key))
    return state_text(sql, units, unit) if unit is not None else None


def counterfactual_pairs(context: Context, pred_sql: str, localization: Localization, *, margin_floor: float,
                         alpha: float, within_trajectory: bool = False) -> list[Pair]:
    """Corrected query (positive) against the prediction (negative); with ``within_trajectory``
    also the prediction's clauses against its root clause. Every pair checked."""
    if localization.correct or localization.corrected_sql is None:
        return []
    try:
        aligned = aligned_tuples(context, positive_sql=localization.corrected_sql, positive_rewards={},
                                 negative_sql=pred_sql, negative_rewards=localization.clause_rewards,
                                 margin_floor=margin_floor, provenance="counterfactual")
        within = within_trajectory_tuples(context, negative_sql=pred_sql,
                                          negative_rewards=localization.clause_rewards,
                                          margin_floor=margin_floor,
                                          provenance="within:counterfactual") if within_trajectory else []
    except SqlParseError:
        return []
    root = root_state(pred_sql, localization.root_key)
    return (checked(aligned, positive_sql=localization.corrected_sql, alpha=alpha, within=False, root_state=root)
            + checked(within, positive_sql=pred_sql, alpha=alpha, within=True, root_state=root))


def counterfactual_tuples(context: Context, pred_sql: str, localization: Localization, *,
                          margin_floor: float, within_trajectory: bool = False,
                          alpha: float = 1.0) -> list[PreferenceTuple]:
    """The kept tuples of ``counterfactual_pairs``."""
    return [p.tuple for p in counterfactual_pairs(context, pred_sql, localization, margin_floor=margin_floor,
                                                  alpha=alpha, within_trajectory=within_trajectory)
            if p.dropped is None]


def _mutation_v_star(negative: Negative):
    query = canon.query_tree(negative.tree)
    v_star = canon.find_labelled(query, negative.node) if negative.node is not None else None
    if v_star is None or v_star is query:
        v_star = next((c for c in query.children if c.label == negative.clause), None)
    if v_star is None:
        raise ValueError(f"mutated clause {negative.clause!r} is not in {negative.sql!r}")
    return query, v_star


def mutation_rewards(negative: Negative, *, alpha: float, sigma: float, reference_edges: bool = False,
                     schema: AnySchema | None = None) -> dict[str, float]:
    """Clause rewards of a mutated query, propagated from its mutated node.

    ``negative`` is a ``caper_jax.sql.mutations.Negative``: ``tree`` is the mutated query's AST and
    ``node`` the mutated node in it. A mutation that removed its node (e.g. dropping DISTINCT)
    leaves the clause itself as v*.
    """
    query, v_star = _mutation_v_star(negative)
    return propagation.clause_rewards(query, v_star, alpha=alpha, sigma=sigma,
                                      reference_edges=reference_edges, schema=schema)


def mutation_pairs(context: Context, negative: Negative, *, alpha: float, sigma: float, margin_floor: float,
                   reference_edges: bool = False, schema: AnySchema | None = None,
                   within_trajectory: bool = False) -> list[Pair]:
    """Gold (positive) against one mutated query (negative); with ``within_trajectory`` also the
    mutant's clauses against its mutated clause. Every pair checked."""
    query, v_star = _mutation_v_star(negative)
    written = propagation.written_clauses(query)
    rewards = propagation.clause_rewards(query, v_star, alpha=alpha, sigma=sigma,
                                         reference_edges=reference_edges, schema=schema, written=written)
    # A mutant is rendered by sqlglot (Negative.sql's contract): so is the gold it is compared
    # with, so that both sides share their prefix character for character.
    positive_sql = _rendered(context.gold_sql)
    try:
        aligned = aligned_tuples(context, positive_sql=positive_sql, positive_rewards={},
                                 negative_sql=negative.sql, negative_rewards=rewards,
                                 margin_floor=margin_floor, provenance=f"mutation:{negative.mutation}")
        within = within_trajectory_tuples(context, negative_sql=negative.sql, negative_rewards=rewards,
                                          margin_floor=margin_floor,
                                          provenance=f"within:{negative.mutation}") if within_trajectory else []
    except SqlParseError:   # a side sqlglot renders but cannot cut into clauses: no states to compare
        return []
    root = root_state(negative.sql, propagation.written_root(query, v_star, written))
    return (checked(aligned, positive_sql=positive_sql, alpha=alpha, within=False, root_state=root)
            + checked(within, positive_sql=negative.sql, alpha=alpha, within=True, root_state=root))


def mutation_tuples(context: Context, negative: Negative, *, alpha: float, sigma: float, margin_floor: float,
                    reference_edges: bool = False, schema: AnySchema | None = None,
                    within_trajectory: bool = False) -> list[PreferenceTuple]:
    """The kept tuples of ``mutation_pairs``."""
    return [p.tuple for p in mutation_pairs(context, negative, alpha=alpha, sigma=sigma, margin_floor=margin_floor,
                                            reference_edges=reference_edges, schema=schema,
                                            within_trajectory=within_trajectory) if p.dropped is None]


def tables_entry(schema: Schema) -> dict:
    """A Spider ``tables.json`` record of a schema read from SQLite (for ``serialize_schema``)."""
    columns = [[-1, "*"]] + [[schema.tables.index(c.table), c.name] for c in schema.columns]
    index = {(c.table.lower(), c.name.lower()): i + 1 for i, c in enumerate(schema.columns)}
    pairs = [((f.table.lower(), f.column.lower()), (f.ref_table.lower(), f.ref_column.lower()))
             for f in schema.foreign_keys]
    foreign = [[index[a], index[b]] for a, b in pairs if a in index and b in index]
    return {"db_id": schema.db_id, "table_names_original": list(schema.tables),
            "column_names_original": columns, "column_types": ["text"] + [c.type for c in schema.columns],
            "primary_keys": [i + 1 for i, c in enumerate(schema.columns) if c.primary_key],
            "foreign_keys": foreign}


# --------------------------------------------------------------------------------------------
# One trajectory -> tuples.

@dataclasses.dataclass(frozen=True)
class AnnotationSettings:
    """The knobs of annotation; configs/annotate.py documents each default."""
    alpha: float = 1.0
    sigma: float = 1.0
    margin_floor: float = 0.05
    reference_edges: bool = False
    within_trajectory: bool = True
    per_query: int = 4
    compound: int = 0
    site_balance: str = "clause"
    max_attempts: int | None = None
    semantics: str = "spider"
    suspect_tuples: bool = False
    # A query's limit is a budget of SQLite VM instructions (50 M: 0.4–2 s of SQLite on one core; the
    # costliest Spider dev gold takes 53 k), so whether a mutant times out, and with it every label,
    # does not depend on the machine's load. timeout_s is only the wall-clock backstop.
    max_vm_steps: int = 50_000_000
    timeout_s: float = 60.0
    max_rows: int = 10_000
    seed: int = 0

    def __post_init__(self):
        if self.alpha <= 0 or self.sigma <= 0 or self.margin_floor <= 0:
            raise ValueError(f"alpha, sigma and margin_floor must be > 0: {self}")
        if self.margin_floor > self.alpha:
            raise ValueError(f"margin_floor {self.margin_floor} > alpha {self.alpha}: no tuple could pass")
        if self.max_vm_steps <= 0 or self.timeout_s <= 0:
            raise ValueError(f"max_vm_steps and timeout_s must be > 0: {self}")
        if self.per_query < 0:
            raise ValueError(f"per_query must be >= 0, got {self.per_query}")
        if not 0 <= self.compound <= self.per_query:
            raise ValueError(f"compound must be in [0, per_query={self.per_query}], got {self.compound}")
        if self.site_balance not in SITE_BALANCES:
            raise ValueError(f"site_balance must be one of {SITE_BALANCES}, got {self.site_balance!r}")
        if self.semantics not in ("spider", "bird"):
            raise ValueError(f"semantics must be 'spider' or 'bird', got {self.semantics!r}")


@dataclasses.dataclass
class Annotation:
    """What one trajectory produced, with the counts the build summary reports."""
    tuples: list[PreferenceTuple]
    source: str                                   # "mutation" | "counterfactual" | "correct" | "error"
    error: str | None = None                      # error kind when source == "error"
    negatives_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    tuples_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    positive_sql: list[str] = dataclasses.field(default_factory=list)   # per tuple: the query chosen is cut from
    dropped: list[Pair] = dataclasses.field(default_factory=list)       # tuples that broke an invariant

    def extend(self, pairs: list[Pair], kind: str) -> int:
        """Keeps the pairs that satisfy every invariant, records the others; returns how many were kept."""
        kept = 0
        for pair in pairs:
            if pair.dropped is None:
                self.tuples.append(pair.tuple)
                self.positive_sql.append(pair.positive_sql)
                kept += 1
            else:
                self.dropped.append(pair)
        if kept:
            self.tuples_by_kind[kind] = self.tuples_by_kind.get(kind, 0) + kept
        return kept

    def pairs(self) -> list[Pair]:
        """Every pair, kept ones first (``Pair.dropped`` None), then the dropped ones."""
        return [Pair(t, q) for t, q in zip(self.tuples, self.positive_sql)] + list(self.dropped)


class AnnotationSummary:
    """The build summary: the counts of many ``Annotation``s, added one by one or merged.

    Merging is what lets a distributed build (``caper_jax.data.beam_annotate``) count per worker
    and still write the same ``summary_<split>.json`` as the one-process build
    (``caper_jax.data.tfds_caper``).
    """

    def __init__(self):
        self.trajectories = 0
        self.tuples = 0
        self.sources: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.negatives_by_kind: collections.Counter = collections.Counter()
        self.tuples_by_kind: collections.Counter = collections.Counter()
        self.dropped: collections.Counter = collections.Counter()     # invariant -> tuples dropped

    def add(self, annotation: Annotation) -> None:
        self.trajectories += 1
        self.tuples += len(annotation.tuples)
        self.sources[annotation.source] += 1
        if annotation.error:
            self.errors[annotation.error] += 1
        self.negatives_by_kind.update(annotation.negatives_by_kind)
        self.tuples_by_kind.update(annotation.tuples_by_kind)
        self.dropped.update(pair.dropped for pair in annotation.dropped)

    def merge(self, other: AnnotationSummary) -> AnnotationSummary:
        """Adds the counts of ``other`` to this summary; returns it."""
        self.trajectories += other.trajectories
        self.tuples += other.tuples
        for name in ("sources", "errors", "negatives_by_kind", "tuples_by_kind", "dropped"):
            getattr(self, name).update(getattr(other, name))
        return self

    def as_dict(self) -> dict:
        kinds = sorted(set(self.negatives_by_kind) | set(self.tuples_by_kind))
        return {"trajectories": self.trajectories, "tuples": self.tuples,
                "sources": dict(self.sources), "errors": dict(self.errors),
                "dropped_by_reason": dict(sorted(self.dropped.items())),
                "yield_by_kind": {k: {"negatives": self.negatives_by_kind.get(k, 0),
                                      "tuples": self.tuples_by_kind.get(k, 0)} for k in kinds}}


def annotate_prediction(context: Context, pred: str, executor: Executor, schema: Schema,
                        settings: AnnotationSettings) -> Annotation:
    """The pairs a wrong prediction yields (counterfactual repair), every one checked; a correct one
    yields none (source "correct"), a gold that does not parse or run is an error ("gold_fails")."""
    s = settings
    try:
        loc = localize(context.gold_sql, pred, executor, schema, alpha=s.alpha, sigma=s.sigma,
                       reference_edges=s.reference_edges, semantics=s.semantics)
    except GoldError:
        return Annotation([], "error", error="gold_fails")
    if loc.correct:
        return Annotation([], "correct")
    # A suspect failure (a tie, a type-only difference, gold's case slip) may answer the question: by default it
    # gives no tuples, and the summary counts it by reason.
    kind = f"suspect:{loc.suspect}" if loc.suspect else "counterfactual"
    out = Annotation([], "counterfactual", negatives_by_kind={kind: 1})
    if loc.suspect and not s.suspect_tuples:
        return out
    out.extend(counterfactual_pairs(context, pred, loc, margin_floor=s.margin_floor, alpha=s.alpha,
                                    within_trajectory=s.within_trajectory), kind)
    return out


class Annotator:
    """Trajectories ``{"question", "db_id", "gold", ["pred"]}`` -> preference tuples.

    No prediction: fault injection on gold (up to ``per_query`` negatives, plus up to ``compound``
    of them with a second fault in a later clause, their root still the first). A wrong prediction:
    counterfactual repair. A correct prediction yields nothing by default, because Spider-layout
    sources also hold the question record of the same gold, which is mutated already;
    ``mutate_correct=True`` mutates its gold instead (for a stream of predictions alone).

    Databases live in Spider layout (``<database_dir>/<db_id>/<db_id>.sqlite``; ``database_dir`` may be
    several folders, searched in order, as BIRD keeps dev and train databases apart); executors and
    schemas are opened once per database and dropped when pickled (Grain worker processes reopen
    them). The random stream of a trajectory is seeded by (seed, db_id, gold), so a record
    annotates the same way in any process or order -- which is what lets a Grain iterator resume
    mid-dataset.
    """

    def __init__(self, database_dir: str | os.PathLike | tuple, settings: AnnotationSettings = AnnotationSettings(),
                 tables: Mapping[str, dict] | None = None, *, mutate_correct: bool = False):
        self.database_dir = database_dirs_of(database_dir)
        self.settings = settings
        self.tables = dict(tables or {})     # db_id -> tables.json record, for the schema text
        self.mutate_correct = mutate_correct
        self._executors = Executors(self.database_dir, timeout_s=settings.timeout_s, max_rows=settings.max_rows,
                                    max_vm_steps=settings.max_vm_steps)
        self._schemas: dict[str, Schema] = {}
        self._schema_texts: dict[str, str] = {}

    def __getstate__(self):
        return {"database_dir": self.database_dir, "settings": self.settings, "tables": self.tables,
                "mutate_correct": self.mutate_correct}

    def __setstate__(self, state):
        self.__init__(state["database_dir"], state["settings"], state["tables"],
                      mutate_correct=state["mutate_correct"])

    def db_path(self, db_id: str) -> pathlib.Path:
        return self._executors.db_path(db_id)

    def executor(self, db_id: str) -> Executor:
        return self._executors[db_id]

    def schema(self, db_id: str) -> Schema:
        if db_id not in self._schemas:
            self._schemas[db_id] = Schema.from_sqlite(self.db_path(db_id), db_id)
            entry = self.tables.get(db_id) or tables_entry(self._schemas[db_id])
            self._schema_texts[db_id] = serialize_schema(entry)
        return self._schemas[db_id]

    def close(self) -> None:
        self._executors.close()

    def __call__(self, record: Mapping) -> Annotation:
        """Never raises on a bad record: failures come back as ``Annotation(source="error")``."""
        try:
            return self._annotate(record)
        except Exception as e:  # noqa: BLE001 -- one record must never end a build
            return Annotation([], "error", error=f"internal:{type(e).__name__}")

    def _annotate(self, record: Mapping) -> Annotation:
        try:
            db_id, gold = str(record["db_id"]), str(record["gold"])
        except KeyError as e:
            return Annotation([], "error", error=f"missing_field:{e.args[0]}")
        if not self.db_path(db_id).is_file():
            return Annotation([], "error", error="missing_db")
        schema = self.schema(db_id)
        context = Context(str(record.get("question", "")), db_id, self._schema_texts[db_id], gold)
        pred = record.get("pred")
        if pred is not None:
            return self._counterfactual(context, str(pred), schema)
        return self._mutations(context, schema)

    def _counterfactual(self, context: Context, pred: str, schema: Schema) -> Annotation:
        out = annotate_prediction(context, pred, self.executor(context.db_id), schema, self.settings)
        if out.source == "correct" and self.mutate_correct:
            return self._mutations(context, schema)
        return out

    def _mutations(self, context: Context, schema: Schema) -> Annotation:
        s = self.settings
        rng = random.Random(f"{s.seed}\x00{context.db_id}\x00{context.gold_sql}")
        try:
            negatives = inject_faults(context.gold_sql, self.executor(context.db_id), schema, s.per_query,
                                      rng, max_attempts=s.max_attempts, compound=s.compound,
                                      balance=s.site_balance, semantics=s.semantics)
        except SqlParseError:
            return Annotation([], "error", error="gold_parse")
        if not negatives and not self.executor(context.db_id).execute(context.gold_sql).ok:
            return Annotation([], "error", error="gold_fails")
        out = Annotation([], "mutation")
        for negative in negatives:
            out.negatives_by_kind[negative.mutation] = out.negatives_by_kind.get(negative.mutation, 0) + 1
            out.extend(mutation_pairs(context, negative, alpha=s.alpha, sigma=s.sigma,
                                      margin_floor=s.margin_floor, reference_edges=s.reference_edges,
                                      schema=schema, within_trajectory=s.within_trajectory), negative.mutation)
        return out
