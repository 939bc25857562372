"""Execution accuracy (EX) of predictions, with majority voting over candidates.

Each prediction line names an example by ``index`` (its position in ``<data>/<split>.json``) and
carries either ``pred`` (one SQL string) or ``candidates`` (a list of SQL strings). A candidates
line is scored by majority vote over execution results:

* each candidate is executed; candidates whose results are equal share one vote bucket (equality
  under the chosen semantics, ignoring row order, so that an ORDER BY does not split a vote);
* a candidate that fails (error, timeout, too many rows) casts no vote;
* the bucket with most votes wins, ties going to the bucket whose first member came first; the
  chosen SQL is that first member; if every candidate fails, the first candidate is chosen (and is
  wrong).

Scoring: the chosen SQL is correct iff it executes and ``results_equal(gold, chosen)`` holds under
``spider`` (ordered iff the gold has ORDER BY) or ``bird`` semantics. ``spider_official`` is the official
test-suite evaluator's default: every DISTINCT is removed from gold and candidates before they run, then
they compare as ``spider`` (caper_jax/sql/semantics.py). Errors and timeouts are wrong.
Examples whose database is missing, or whose gold SQL fails, are reported and excluded from ``n``.
Malformed lines (not UTF-8, not JSON, a lone surrogate, a bad ``index`` or one already graded on an
earlier line, which would count twice) are reported with their line number and skipped. ``output``
is refused if it is (or resolves to) the predictions, a dataset file or a database, and is renamed
into place only when every line is graded.

The summary has ``ex`` (accuracy of the chosen SQL), ``n``, and, when any line has candidates,
``mv``: over those lines, ``first`` (accuracy of the first candidate alone), ``vote`` (of the vote)
and ``any`` (some candidate correct: the oracle upper bound).

``published_failures`` lists the Spider-dev failures of published systems' prediction files.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from caper_jax.data.spider import (SQL_PREDICTION_SUFFIXES, DataError, MissingDatabaseError, db_path, load_split,
                                   read_sql_predictions, read_system_predictions)
from caper_jax.sql.execution import ExecResult, Executor, Executors, order_matters, results_equal
from caper_jax.sql.semantics import EvalSemantics as Semantics, check_semantics, comparison, executed_sql
from caper_jax.utils import atomic, jsonl

DEFAULT_TIMEOUT_S = 30.0  # BIRD's evaluator uses 30 s; Spider gold queries take milliseconds
DEFAULT_MAX_ROWS = 1_000_000  # far above any Spider/BIRD gold result: a cap, not a filter


class PredictionError(ValueError):
    """One prediction line is malformed; it is reported and skipped."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    line: int  # 1-based line number in the predictions file
    index: int
    candidates: tuple[str, ...]  # (pred,) for a pred line
    voted: bool  # True for a candidates line
    record: dict  # the line as read, repeated in the output


def parse_prediction(line_number: int, text: str, n_examples: int) -> Prediction:
    try:
        record = jsonl.parse_json_line(text)  # refuses a line that is not UTF-8, not JSON, or a lone surrogate
    except jsonl.LineError as error:
        raise PredictionError(str(error)) from None
    if not isinstance(record, dict):
        raise PredictionError("not a JSON object")
    index = record.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n_examples:
        raise PredictionError(f"'index' must be an integer in [0, {n_examples}), got {index!r}")
    has_pred, has_candidates = "pred" in record, "candidates" in record
    if has_pred == has_candidates:
        raise PredictionError("needs exactly one of 'pred' and 'candidates'")
    if has_pred:
        if not isinstance(record["pred"], str):
            raise PredictionError("'pred' must be a string")
        return Prediction(line_number, index, (record["pred"],), False, record)
    candidates = record["candidates"]
    if not isinstance(candidates, list) or not candidates or not all(isinstance(c, str) for c in candidates):
        raise PredictionError("'candidates' must be a non-empty list of strings")
    return Prediction(line_number, index, tuple(candidates), True, record)


def majority_vote(results: list[ExecResult], semantics: Semantics) -> int:
    """Index of the chosen candidate (see module docstring)."""
    buckets: list[list[int]] = []  # candidate indices, buckets in order of first appearance
    for i, result in enumerate(results):
        if not result.ok:
            continue
        for bucket in buckets:
            if results_equal(results[bucket[0]], result, semantics=comparison(semantics), ordered=False):
                bucket.append(i)
                break
        else:
            buckets.append([i])
    if not buckets:
        return 0
    return max(buckets, key=len)[0]  # max keeps the first of equal-sized buckets


def data_inputs(data_dir: str | os.PathLike, *files: str | os.PathLike) -> list:
    """The input files an output must never be: ``files`` and the dataset's JSON files."""
    return [*files, *pathlib.Path(data_dir).glob("*.json")]


class Databases(Executors):
    """An Executor per db_id of ``split``'s layout (``data.spider.db_path``: BIRD keeps a db_id's file
    per split), opened on first use; ``executor`` gives None for a database not on disk, after one
    ``on_missing(db_id)``."""

    def __init__(self, data_dir: str | os.PathLike, split: str, *, timeout_s: float, max_rows: int,
                 on_missing: Callable[[str], None] = lambda db_id: None):
        super().__init__(lambda db_id: db_path(data_dir, db_id, split), timeout_s=timeout_s, max_rows=max_rows)
        self.data_dir, self.split, self.on_missing = data_dir, split, on_missing
        self._missing: set[str] = set()

    def executor(self, db_id: str) -> Executor | None:
        if db_id in self._missing:
            return None
        try:
            return self[db_id]
        except MissingDatabaseError:
            self._missing.add(db_id)
            self.on_missing(db_id)
            return None


@dataclasses.dataclass(frozen=True)
class GradedLine:
    """One well-formed predictions line, executed and compared with its gold."""
    line_number: int
    prediction: Prediction
    example: Any                    # caper_jax.data.spider.Example
    excluded: str | None            # "missing_db" | "gold_<error kind>" | None (graded)
    results: list[ExecResult]       # of the candidates, in order ([] when excluded)
    right: list[bool]               # each candidate's result equals the gold's


def _prediction_lines(path: str | os.PathLike, examples: Sequence):
    """The predictions file's lines; a plain SQL file comes as one ``{"index", "pred"}`` line per example."""
    if pathlib.Path(path).suffix.lower() not in SQL_PREDICTION_SUFFIXES:
        return jsonl.open_text_lines(path)  # decoded line by line: a bad byte spoils one line only
    sql = read_sql_predictions(path, examples)
    if len(sql) != len(examples):   # line i is example i: a truncated or padded file would grade a shifted subset
        raise DataError(f"{path}: {len(sql)} predictions for {len(examples)} examples (a .sql/.txt/.csv file holds "
                        "one prediction per example, in split order)")
    return contextlib.nullcontext([json.dumps({"index": i, "pred": s}) for i, s in enumerate(sql)])


def grade_predictions(path: str | os.PathLike, examples: Sequence, executor_for: Callable[[str], Executor | None],
                      *, semantics: Semantics, on_malformed: Callable[[int, PredictionError], None]
                      ) -> Iterator[GradedLine]:
    """Every non-blank line of a predictions file, graded; malformed lines go to ``on_malformed``.

    ``executor_for(db_id)`` is None when the database is missing. An example is excluded (not
    graded) when its database is missing or its gold query fails. A ``.sql``/``.txt``/``.csv`` file is a
    published system's predictions, one per example in split order (``read_sql_predictions``).
    """
    first_line: dict[int, int] = {}  # index -> line that graded it: a repeated index would count twice
    with _prediction_lines(path, examples) as lines:
        for line_number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                prediction = parse_prediction(line_number, text, len(examples))
                if prediction.index in first_line:
                    raise PredictionError(f"index {prediction.index} again (first at line "
                                          f"{first_line[prediction.index]}); it would count twice")
            except PredictionError as error:
                on_malformed(line_number, error)
                continue
            first_line[prediction.index] = line_number
            example = examples[prediction.index]
            executor = executor_for(example.db_id)
            gold = executor.execute(executed_sql(example.query, semantics)) if executor is not None else None
            if gold is None or not gold.ok:
                reason = "missing_db" if gold is None else f"gold_{gold.error_kind}"
                yield GradedLine(line_number, prediction, example, reason, [], [])
                continue
            ordered = order_matters(example.query)
            results = [executor.execute(executed_sql(sql, semantics)) for sql in prediction.candidates]
            right = [results_equal(gold, r, semantics=comparison(semantics), ordered=ordered) for r in results]
            yield GradedLine(line_number, prediction, example, None, results, right)


class GradingTally:
    """A predictions file graded for a command (``evaluate ex``, ``verify``): each malformed line is reported
    as skipped and its number kept in ``malformed``; excluded lines are counted in ``excluded`` by reason."""

    def __init__(self, path: str | os.PathLike, report: Callable[[str], None]):
        self.path, self.report = path, report
        self.malformed: list[int] = []
        self.excluded: collections.Counter[str] = collections.Counter()

    def skip(self, line_number: int, error: PredictionError) -> None:
        self.malformed.append(line_number)
        self.report(f"{self.path}:{line_number}: skipped: {error}")

    def lines(self, examples: Sequence, executor_for: Callable[[str], Executor | None], *,
              semantics: Semantics) -> Iterator[GradedLine]:
        """``grade_predictions`` of the file, tallied."""
        for line in grade_predictions(self.path, examples, executor_for, semantics=semantics, on_malformed=self.skip):
            if line.excluded is not None:
                self.excluded[line.excluded] += 1
            yield line


# The six published systems' Spider-dev predictions of ../shared/data/spider_predictions/.
PUBLISHED_SYSTEMS = ("dail_sql_gpt4.sql", "dail_sql_gpt4_sc.sql", "graphix_t5.sql", "c3sql_chatgpt.sql",
                     "din_sql_gpt4.csv", "din_sql_codex.csv")


def published_failures(spider_dir: str | os.PathLike, predictions_dir: str | os.PathLike,
                       systems: Sequence[str] = PUBLISHED_SYSTEMS) -> list[dict]:
    """Every Spider-dev failure of the given systems: ``{system, index, db_id, question, gold, pred}``.

    A failure is an example with a database whose prediction does not execute to gold's result the
    Spider way (``results_equal``: bags, ordered iff gold has ORDER BY, any column order), under the
    Executor's default limits. Examples whose database is missing (``wta_1`` here) are skipped.
    """
    examples = load_split(spider_dir, "dev")
    per_system = read_system_predictions(predictions_dir, systems, examples)
    out = []
    with Executors(pathlib.Path(spider_dir) / "database") as executors:
        for system, predictions in zip(systems, per_system):
            for example, pred in zip(examples, predictions):
                if not executors.db_path(example.db_id).is_file():
                    continue
                gold = executors.execute(example.db_id, example.query)
                result = executors.execute(example.db_id, pred)
                if result.ok and results_equal(gold, result, ordered=order_matters(example.query)):
                    continue
                out.append({"system": system, "index": example.index, "db_id": example.db_id,
                            "question": example.question, "gold": example.query, "pred": pred})
    return out


def evaluate_ex(data_dir: str | os.PathLike, split: str, predictions: str | os.PathLike, *,
                semantics: Semantics = "spider", output: str | os.PathLike | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int = DEFAULT_MAX_ROWS,
                report: Callable[[str], None] | None = None) -> dict:
    """Scores a predictions file; writes per-line results to ``output``; returns the summary."""
    check_semantics(semantics)
    report = report or (lambda message: print(message, file=sys.stderr))
    if output is not None:   # before any work: never the predictions, the data or a database
        atomic.check_output(output, inputs=data_inputs(data_dir, predictions))
    examples = load_split(data_dir, split)
    databases = Databases(data_dir, split, timeout_s=timeout_s, max_rows=max_rows)

    correct = first_correct = vote_correct = any_correct = n = n_voted = 0
    tally = GradingTally(predictions, report)
    missing_reported: set[str] = set()

    # Written under a temporary name, renamed into place only when every line is graded.
    sink: atomic.AtomicWriter | None = atomic.AtomicWriter(output) if output is not None else None
    try:
        for line in tally.lines(examples, databases.executor, semantics=semantics):
            prediction, example = line.prediction, line.example
            if line.excluded is not None:
                if line.excluded != "missing_db" or example.db_id not in missing_reported:
                    missing_reported.add(example.db_id)
                    report(f"{predictions}:{line.line_number}: example {prediction.index} "
                           f"({example.db_id}) excluded: {line.excluded}"
                           + (" (reported once per database)" if line.excluded == "missing_db" else ""))
                row = {**prediction.record, "correct": None, "excluded": line.excluded}
            else:
                right = line.right
                chosen = majority_vote(line.results, semantics) if prediction.voted else 0
                n += 1
                correct += right[chosen]
                if prediction.voted:
                    n_voted += 1
                    first_correct += right[0]
                    vote_correct += right[chosen]
                    any_correct += any(right)
                row = {**prediction.record, "correct": right[chosen], "sql": prediction.candidates[chosen]}
                if not line.results[chosen].ok:
                    row["error"] = line.results[chosen].error_kind
            if sink is not None:
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
    except BaseException:   # Ctrl-C included: the output keeps its previous content (or stays absent)
        if sink is not None:
            sink.discard()
        raise
    finally:
        if sink is not None:
            sink.close()    # renames it into place (nothing after a discard)
        databases.close()
    summary: dict = {"ex": correct / n if n else 0.0, "n": n}
    if n_voted:
        summary["mv"] = {"n": n_voted, "first": first_correct / n_voted, "vote": vote_correct / n_voted,
                         "any": any_correct / n_voted}
    summary["excluded"] = dict(tally.excluded)
    summary["malformed"] = len(tally.malformed)
    return summary
