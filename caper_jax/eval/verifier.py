"""A trained Clause-PRM as a plug-and-play verifier for any system: reranking and localisation.

The command line is ``python -m caper_jax.verify`` (caper_jax/verify.py: rerank, the default
command, and ``localize``); this module is what it runs.

**Rerank** (``rerank``). Candidate lines are those of ``evaluate ex``: ``index`` (position in
``<data>/<split>.json``) and ``candidates`` (a list of SQL strings; a ``pred`` line is one
candidate). Every candidate of every line is scored by the PRM (``caper_jax.prm.scoring``: one
forward per query, clause scores aggregated by ``--aggregate``; SQL that does not parse scores
-inf, so it is chosen only when every candidate is unparseable) and executed. The last stdout line
is the JSON summary over the scored lines::

    {"n", "first", "vote", "prm", "aggregate", "prm_by_aggregate": {min, mean, last, vote_min, vote_mean,
     vote_last}, "any", "excluded", "malformed"}

``first`` is EX of the first candidate, ``vote`` of the majority vote by execution result
(``caper_jax.eval.ex.majority_vote``), ``prm`` of the PRM's choice, ``any`` the oracle (some
candidate right); ``prm_by_aggregate`` holds best-of-k by each aggregate and the PRM-weighted vote
``vote_<aggregate>`` (``caper_jax.prm.scoring.weighted_vote``: the result class whose members'
sigmoid scores sum highest). ``--output`` gets one line per well-formed input line: the input fields, ``sql`` (the PRM's
choice), ``chosen``, ``correct``, ``clauses`` ([name, score] of the chosen SQL), ``score`` (its
aggregate) and ``candidate_scores`` (every candidate's aggregate). Lines whose database is missing
or whose gold fails are reported on stderr and excluded from ``n``; malformed lines (not UTF-8, not
JSON, a lone surrogate, a bad or repeated ``index``) are reported with their line number and skipped
— as in ``evaluate ex``. An ``--output`` (``--output_dir``) that is or resolves to an input or a
database is refused before the PRM is loaded; outputs are renamed into place only when complete;
Ctrl-C exits 130 with no summary.

**Localize**: root-cause localisation of a file of FAILED predictions (lines: ``gold``, ``pred``,
``question``, ``db_id`` — or ``index`` into the split for the missing ones — and optionally the true
root as ``root_clause`` or ``true_root_clause``; without one, the annotator's counterfactual
localisation ``caper_jax.sql.localize`` labels the line, and a prediction it finds correct is
skipped). Clauses ranked lowest-score-first give top-1 and MRR per true clause for the PRM and the
baselines of ``caper_jax.prm.localization``; written to ``--output_dir`` as ``localization.json``,
``localization.md`` (tables, confusion of true vs blamed clause) and PNG plots.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from caper_jax.sql.clauses import SqlParseError, split_clauses
from caper_jax.sql.contract import prompt_question, serialize_schema
from caper_jax.sql.localize import GoldError, localize
from caper_jax.sql.schema import Schema
from caper_jax.data.spider import DataError, ShownQuestions, load_schemas, load_split
from caper_jax.sql.semantics import check_semantics
from caper_jax.eval.ex import (DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S, Databases, GradingTally, PredictionError,
                               data_inputs, majority_vote)
from caper_jax.prm.aggregates import AGGREGATES
from caper_jax.utils import atomic, jsonl

Report = Callable[[str], None]


class Scorer(Protocol):
    def score_queries(self, rows: Sequence[Mapping[str, str]]) -> list[np.ndarray]: ...


class _Databases(Databases):
    """A split's databases with their serialised schemas (the split's own schema file first); a
    missing database is reported once."""

    def __init__(self, data_dir, split: str, *, timeout_s: float, max_rows: int, report: Report, where: str):
        super().__init__(data_dir, split, timeout_s=timeout_s, max_rows=max_rows,
                         on_missing=lambda db_id: report(f"{where}: database {db_id!r} is missing; "
                                                         "its lines are excluded"))
        self.tables = load_schemas(data_dir, split)
        self._schemas: dict[str, str] = {}

    def schema(self, db_id: str) -> str:
        if db_id not in self._schemas:
            if db_id not in self.tables:
                raise DataError(f"database {db_id!r} is not in the schema file of {self.data_dir}")
            self._schemas[db_id] = serialize_schema(self.tables[db_id])
        return self._schemas[db_id]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


# -- rerank


def rerank(scorer: Scorer, data_dir: str | os.PathLike, split: str, candidates: str | os.PathLike, *,
           aggregate: str = "min", semantics: str = "spider", output: str | os.PathLike | None = None,
           timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int = DEFAULT_MAX_ROWS,
           report: Report | None = None) -> dict:
    """Reranks every candidates line with the PRM; returns the summary (module docstring)."""
    from caper_jax.prm import scoring  # JAX loads only where the PRM is used: verify checks flags first

    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    check_semantics(semantics)
    report = report or _stderr
    if output is not None:   # before any work: never the candidates, the data or a database
        atomic.check_output(output, inputs=data_inputs(data_dir, candidates))
    examples = load_split(data_dir, split)
    databases = _Databases(data_dir, split, timeout_s=timeout_s, max_rows=max_rows, report=report,
                           where=str(candidates))
    tally = GradingTally(candidates, report)
    lines: list[dict[str, Any]] = []  # in file order; excluded lines have "excluded" instead of "right"
    try:
        for line in tally.lines(examples, databases.executor, semantics=semantics):
            prediction, example = line.prediction, line.example
            if line.excluded is not None:
                if line.excluded != "missing_db":   # a missing database is reported by _Databases, once
                    report(f"{candidates}:{line.line_number}: example {prediction.index} excluded: {line.excluded}")
                lines.append({"prediction": prediction, "excluded": line.excluded})
                continue
            schema = databases.schema(example.db_id)
            lines.append({"prediction": prediction, "right": line.right, "vote": majority_vote(line.results, semantics),
                          "classes": scoring.result_classes(line.results, semantics),
                          "rows": [{"question": prompt_question(example.question, example.evidence),
                                    "schema": schema, "sql": sql} for sql in prediction.candidates]})
    finally:
        databases.close()

    scored = [line for line in lines if "right" in line]
    flat = scorer.score_queries([row for line in scored for row in line["rows"]])
    position = 0
    counts = collections.Counter()
    for line in scored:
        k = len(line["rows"])
        line["scores"], position = flat[position:position + k], position + k
        # Every selector's pick, counted here and written with the line: paired comparisons between
        # selectors (PRM rerank vs majority vote on the same questions) are computed from the output.
        line["choices"] = {sel: scoring.select(line["scores"], sel, line["classes"]) for sel in scoring.SELECTORS}
        right = line["right"]
        counts["first"] += right[0]
        counts["vote"] += right[line["vote"]]
        counts["any"] += any(right)
        for sel, chosen in line["choices"].items():
            counts[sel] += right[chosen]
    n = len(scored)
    if output is not None:   # a temporary file renamed into place: never half written
        with atomic.atomic_output(output) as sink:
            for line in lines:
                sink.write(json.dumps(_output_row(line, aggregate), ensure_ascii=False) + "\n")
    rate = lambda key: counts[key] / n if n else 0.0  # noqa: E731
    return {"n": n, "first": rate("first"), "vote": rate("vote"), "prm": rate(aggregate), "aggregate": aggregate,
            "prm_by_aggregate": {how: rate(how) for how in scoring.SELECTORS}, "any": rate("any"),
            "excluded": dict(tally.excluded), "malformed": len(tally.malformed)}


def _output_row(line: dict, how: str) -> dict:
    from caper_jax.prm import scoring  # JAX loads only where the PRM is used: verify checks flags first

    prediction = line["prediction"]
    if "right" not in line:
        return {**prediction.record, "correct": None, "excluded": line["excluded"]}
    chosen = line["choices"][how]
    sql = prediction.candidates[chosen]
    scores = line["scores"][chosen]
    return {**prediction.record, "sql": sql, "chosen": chosen, "correct": line["right"][chosen],
            "clauses": [[name, _json_float(s)] for name, s in zip(scoring.clause_names(sql), scores)],
            "score": _json_float(scoring.aggregate(scores, how)),
            "candidate_scores": [_json_float(scoring.aggregate(s, how)) for s in line["scores"]],
            "candidate_correct": [bool(r) for r in line["right"]], "vote_choice": int(line["vote"]),
            "choices": line["choices"]}


def _json_float(x: float) -> float | str | None:
    """JSON has no NaN/inf: NaN (a truncated clause) -> null, ±inf (unparseable) -> "-inf"/"inf"."""
    x = float(x)
    if np.isnan(x):
        return None
    if np.isinf(x):
        return "-inf" if x < 0 else "inf"
    return x


# -- localize


def read_failures(data_dir: str | os.PathLike, split: str, predictions: str | os.PathLike, *,
                  timeout_s: float = DEFAULT_TIMEOUT_S, report: Report | None = None) -> tuple[list[dict], dict]:
    """Failed predictions with their root clause, as rows for scoring; and counts of skipped lines."""
    from caper_jax.prm.heldout import with_baseline_inputs  # JAX (prm.scoring): as above

    report = report or _stderr
    examples: list = []

    def split_examples() -> list:
        if not examples:
            examples.extend(load_split(data_dir, split))
        return examples

    databases = _Databases(data_dir, split, timeout_s=timeout_s, max_rows=DEFAULT_MAX_ROWS, report=report,
                           where=str(predictions))
    schemas: dict[str, Schema] = {}
    shown: ShownQuestions | None = None
    rows, skipped = [], collections.Counter()
    try:
        with jsonl.open_text_lines(predictions) as f:   # decoded line by line: a bad byte spoils one line
            for line_number, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:   # not UTF-8, not JSON, a lone surrogate, missing fields: that line only
                    record = _failure_record(jsonl.parse_json_line(text), split_examples)
                except (jsonl.LineError, PredictionError) as error:
                    skipped["malformed"] += 1
                    report(f"{predictions}:{line_number}: skipped: {error}")
                    continue
                if record["db_id"] not in databases.tables:
                    skipped["unknown_db"] += 1
                    report(f"{predictions}:{line_number}: skipped: database {record['db_id']!r} not in the schemas")
                    continue
                # A failure that may answer the question (a tie, a type-only difference, a literal's
                # case: docs/annotation.md 2a) has no root to find; the demo world marks its own.
                if record.get("kind") == "suspect" or record.get("suspect"):
                    skipped["suspect"] += 1
                    continue
                root, source = record.get("root_clause") or record.get("true_root_clause"), "given"
                if root is None:
                    executor = databases.executor(record["db_id"])
                    if executor is None:
                        skipped["missing_db"] += 1
                        continue
                    if record["db_id"] not in schemas:
                        schemas[record["db_id"]] = Schema.from_sqlite(executor.db_path, record["db_id"])
                    try:
                        found = localize(record["gold"], record["pred"], executor, schemas[record["db_id"]])
                    except GoldError as error:
                        skipped["gold_error"] += 1
                        report(f"{predictions}:{line_number}: skipped: {error}")
                        continue
                    if found.correct:
                        skipped["correct"] += 1
                        continue
                    if found.suspect:
                        skipped["suspect"] += 1
                        report(f"{predictions}:{line_number}: skipped: suspect failure ({found.suspect})")
                        continue
                    root, source = found.root_clause, "annotator"
                try:
                    pred_units = [(u.name, u.text) for u in split_clauses(record["pred"])]
                    gold_units = [(u.name, u.text) for u in split_clauses(record["gold"])]
                except SqlParseError:
                    skipped["unparseable"] += 1  # no clauses to rank
                    continue
                shown = shown or ShownQuestions(split_examples())   # BIRD's evidence, as the prompts show it
                row = {"question": shown(record), "schema": databases.schema(record["db_id"]),
                       "sql": record["pred"], "root": root, "root_source": source,
                       "pred_units": pred_units, "gold_units": gold_units}
                # Lines carrying "samples" / "clause_logprob" also get the gold-free baselines.
                rows.append(with_baseline_inputs(row, record, schemas.get(record["db_id"])))
    finally:
        databases.close()
    return rows, dict(skipped)


def _failure_record(record: Any, split_examples: Callable[[], list]) -> dict:
    if not isinstance(record, dict):
        raise PredictionError("not a JSON object")
    record = dict(record)
    if not all(isinstance(record.get(k), str) for k in ("gold", "question", "db_id")):
        index = record.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            raise PredictionError("needs 'gold', 'question' and 'db_id', or an integer 'index' into the split")
        examples = split_examples()
        if not 0 <= index < len(examples):
            raise PredictionError(f"'index' must be in [0, {len(examples)}), got {index}")
        example = examples[index]
        record.setdefault("gold", example.query)
        record.setdefault("question", example.question)
        record.setdefault("db_id", example.db_id)
    if not isinstance(record.get("pred"), str):
        raise PredictionError("'pred' must be a string")
    return record


def localization_report(scorer: Scorer, rows: list[dict], out_dir: str | os.PathLike, skipped: dict) -> dict:
    """Scores the failures, summarises PRM vs baselines, writes json, markdown and plots."""
    from caper_jax.eval import report as report_lib  # JAX (prm.heldout): loaded where the PRM is used
    from caper_jax.prm import heldout

    localization = heldout.localization_summaries(rows, scorer.score_queries(rows)) if rows else {}
    results = {"n": len(rows), "skipped": skipped,
               "root_source": dict(collections.Counter(r["root_source"] for r in rows)),
               "localization": localization}
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Every file is written into a temporary directory beside them, then renamed into place, the
    # JSON last: an interrupted run leaves the previous report (or none), never a truncated file.
    staging = pathlib.Path(tempfile.mkdtemp(dir=out, prefix=".localization-partial-"))
    try:
        report_lib.write_localization_report(results, staging)
        (staging / "localization.json").write_text(json.dumps(results, indent=1) + "\n")
        for path in sorted(staging.iterdir(), key=lambda p: p.name == "localization.json"):
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return results
