"""Candidate-level contrasts: a right and a wrong sample of one question, compared at the wrong one's root.

Extra training tuples (provenance ``candidate``) for reranking, built from a split's predictions by
the annotator's localisation (``caper_jax.sql.localize``); ``configs/prm.py``'s
``annotate.candidate_contrasts`` turns them on.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from caper_jax.data.spider import ShownQuestions
from caper_jax.sql import invariants
from caper_jax.sql.clauses import SqlParseError
from caper_jax.sql.contract import serialize_schema
from caper_jax.sql.localize import GoldError, localize
from caper_jax.sql.tuples import Annotator, Context, aligned_tuples, tables_entry

CANDIDATE_PROVENANCE = "candidate"


def candidate_contrasts(records: Iterable[Mapping[str, Any]], annotator: Any, tables: Mapping[str, dict] | None = None
                        ) -> list[dict[str, Any]]:
    """Tuples (provenance ``candidate``) pairing a correct and a wrong prediction of the same question.

    Counterfactual tuples compare a wrong query with its own minimal repair; at reranking time the PRM
    must instead prefer a *different* right candidate of the same question. So for each question
    (db_id, question, gold) with at least one right and one wrong distinct prediction, every wrong
    one is paired with a right one (round-robin over the right ones, in file order) at the wrong
    one's root position (``caper_jax.sql.localize``): chosen = the right candidate's state there,
    rejected = the wrong one's, margin = the propagated reward gap there (``tuples.aligned_tuples``
    with the right candidate as the positive side). A pair whose states at the root coincide,
    whose gap is below the margin floor, or that breaks an invariant of ``caper_jax.sql.invariants``
    gives nothing. ``annotator``: a ``caper_jax.sql.tuples.Annotator``
    (its settings, executors and schemas).
    """
    s = annotator.settings
    tables = dict(tables or {})
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in records:
        if "pred" not in r or not str(r["pred"]).strip():
            continue
        preds = groups.setdefault((str(r["db_id"]), str(r.get("question", "")), str(r["gold"])), [])
        if r["pred"] not in preds:
            preds.append(str(r["pred"]))
    out: list[dict[str, Any]] = []
    for (db_id, question, gold), preds in groups.items():
        if len(preds) < 2 or not annotator.db_path(db_id).is_file():
            continue
        schema = annotator.schema(db_id)
        right, wrong = [], []
        for pred in preds:
            try:
                loc = localize(gold, pred, annotator.executor(db_id), schema, alpha=s.alpha, sigma=s.sigma,
                               reference_edges=s.reference_edges, semantics=s.semantics)
            except GoldError:
                break
            if loc.correct:
                right.append(pred)
            elif loc.root_clause is not None:
                wrong.append((pred, loc))
        if not right or not wrong:
            continue
        context = Context(question, db_id, serialize_schema(tables.get(db_id) or tables_entry(schema)), gold)
        for j, (pred, loc) in enumerate(wrong):
            try:
                pairs = aligned_tuples(context, positive_sql=right[j % len(right)], positive_rewards={},
                                       negative_sql=pred, negative_rewards=loc.clause_rewards,
                                       margin_floor=s.margin_floor, provenance=CANDIDATE_PROVENANCE)
            except SqlParseError:  # a side does not split into clauses
                continue
            # The same invariants as every annotated tuple (caper_jax.sql.invariants); a violator is left out.
            at_root = [t for t in pairs if t.clause == loc.root_clause
                       and invariants.violation(t, positive_sql=right[j % len(right)], alpha=s.alpha,
                                                within=False) is None]
            if at_root:
                out.append(at_root[0].as_dict())
    return out


def with_candidate_contrasts(world_dir: str | os.PathLike, database_dir: Any, split: str, settings: Any,
                             tuples_path: str | os.PathLike) -> pathlib.Path:
    """``tuples_path``'s tuples plus the candidate contrasts of ``predictions_<split>.jsonl``, as a new
    JSONL next to it (``<name>-contrasts.jsonl``, built once: the same inputs give the same tuples)."""
    # Deferred: caper_jax.data.tfds_caper loads tensorflow_datasets (seconds), which only this reader needs.
    from caper_jax.data.tfds_caper import read_tables

    tuples_path = pathlib.Path(tuples_path)
    out = tuples_path.with_name(tuples_path.stem + "-contrasts.jsonl")
    if out.exists():
        return out
    predictions = pathlib.Path(world_dir) / f"predictions_{split}.jsonl"
    records = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()] \
        if predictions.exists() else []
    shown = ShownQuestions.of_split(world_dir, split)   # BIRD's evidence as a Hint line, as the annotator reads it
    records = [{**r, "question": shown(r)} if isinstance(r, dict) and isinstance(r.get("question"), str) else r
               for r in records]
    tables = read_tables(world_dir)
    annotator = Annotator(database_dir, settings, tables)
    try:
        extra = candidate_contrasts(records, annotator, tables)
    finally:
        annotator.close()
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.write(tuples_path.read_text())
        f.writelines(json.dumps(t) + "\n" for t in extra)
    os.replace(tmp, out)
    logging.getLogger("caper_jax").info("candidate contrasts: %d tuples from %s added to %s", len(extra),
                                        predictions, out)
    return out

