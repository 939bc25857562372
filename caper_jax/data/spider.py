"""The one reader of text-to-SQL data in the Spider and BIRD layouts (the demo world uses Spider's).

Every part of caper_jax that reads questions, schemas or databases goes through this module: the
trainers (``caper_jax.data.data_world``), SFT/GRPO examples (``caper_jax.sft.data``), annotation
(``caper_jax.data.tfds_caper``, PRM training), ``evaluate ex``, ``verify`` and policy evaluation.

    split      Spider                                   BIRD (either arrangement)
    dev        dev.json                                 dev.json | dev/dev.json
    train      train_spider.json + train_others.json    train.json | train/train.json
    <name>     <name>.json (or any .json path under the root)
    schemas    tables.json                              dev_tables.json, train_tables.json
                                                        (or dev/dev_tables.json, train/train_tables.json)
    databases  database/<db>/<db>.sqlite                dev_databases/<db>/<db>.sqlite,
                                                        train_databases/<db>/<db>.sqlite
                                                        (or dev/dev_databases, train/train_databases)

Question records carry ``db_id``, ``question`` and the gold SQL as ``query`` (Spider) or ``SQL``
(BIRD), plus BIRD's ``evidence``; they come back as ``Example`` records with the gold under
``query`` whatever the source called it. Spider's official training set is train_spider.json and
train_others.json together (its README), so ``train`` reads both. Schemas and databases are looked
up for a split in that split's own files first (``<split>_tables.json``, ``<split>_databases/``), then
in the layout's others, so one root holding BIRD's dev and train folders serves both splits;
``database_dirs(root)`` lists every database folder for the executors.

A database that is missing on disk is not an error at load time (Spider's public dev copy, for
one, lacks wta_1), but it is reported (a logged warning, ``missing_databases``) and can be dropped
with ``drop_missing=True``; ``db_path`` raises ``MissingDatabaseError`` for it.

Predictions of published systems are read here too (``read_sql_predictions``, one file;
``read_system_predictions``, several, each one prediction per example of a split), such as the six
systems kept in ``../shared/data/spider_predictions/`` (provenance, licences and formats in its
PROVENANCE.md): four ``.sql`` files of 1034 lines in dev.json order and two DIN-SQL CSVs with a
``PREDICTED SQL`` column. Grading them is ``caper_jax.eval.ex``'s.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import json
import logging
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

from caper_jax.sql.contract import prompt_question

log = logging.getLogger(__name__)

_SPLIT_FILES = {
    "dev": (("dev.json",), ("dev/dev.json",)),
    # Official Spider training data = train_spider.json + train_others.json.
    "train": (("train_spider.json", "train_others.json"), ("train.json",), ("train/train.json",)),
}


class DataError(ValueError):
    """A data file is missing or not in a layout these readers know."""


class MissingDatabaseError(FileNotFoundError):
    """The SQLite file of a db_id is not on disk."""


@dataclasses.dataclass(frozen=True)
class Example:
    db_id: str
    question: str
    query: str  # gold SQL ("query" in Spider, "SQL" in BIRD)
    evidence: str = ""  # BIRD's external-knowledge hint; "" elsewhere
    index: int = 0  # position in the split
    # Other fields of the record; left out of == and hash() so that examples stay hashable.
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)


class ShownQuestions:
    """A record's question as the prompts show it (``contract.prompt_question``: BIRD's evidence as a
    ``Hint:`` line), the evidence being the record's own ``evidence``, else its split example's."""

    def __init__(self, examples: Iterable[Example]):
        self._evidence = {(ex.db_id, ex.question): ex.evidence for ex in examples if ex.evidence}

    @classmethod
    def of_split(cls, data_dir: str | os.PathLike, split: str) -> "ShownQuestions":
        """Over ``split``'s examples; a folder without the split's file has no evidence to add."""
        try:
            return cls(load_split(data_dir, split))
        except DataError:
            return cls(())

    def __call__(self, record: Mapping[str, Any]) -> str:
        question = str(record.get("question", ""))
        evidence = record.get("evidence") or self._evidence.get((record.get("db_id"), question), "")
        return prompt_question(question, str(evidence))


def _read_json(path: pathlib.Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise DataError(f"{path} is not valid JSON: {error}") from error
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 (byte {error.start + 1} is {error.object[error.start:error.start + 1]!r})"
                        ) from error


def split_name(split: str) -> str:
    """``dev`` for ``dev`` and for ``dev/dev.json``: the name a split's schema and database folders carry."""
    return pathlib.PurePath(split).stem if split.endswith(".json") else split


def split_files(data_dir: str | os.PathLike, split: str) -> list[pathlib.Path]:
    """The JSON file(s) holding a split. ``split`` may also be a path relative to ``data_dir``."""
    root = pathlib.Path(data_dir)
    if split.endswith(".json"):
        path = root / split
        if not path.is_file():
            raise DataError(f"no split file {path}")
        return [path]
    options = _SPLIT_FILES.get(split, ((f"{split}.json",), (f"{split}/{split}.json",)))
    for names in options:
        if (root / names[0]).is_file():
            return [root / n for n in names if (root / n).is_file()]
    tried = ", ".join(str(root / names[0]) for names in options)
    raise DataError(f"no {split!r} split under {root} (looked for {tried})")


def load_split(data_dir: str | os.PathLike, split: str, *, drop_missing: bool = False) -> list[Example]:
    """Examples of a split (``"dev"``, ``"train"``, any ``<name>`` with ``<name>.json``, or a .json path)."""
    records = []
    for path in split_files(data_dir, split):
        loaded = _read_json(path)
        if not isinstance(loaded, list):
            raise DataError(f"{path} must hold a JSON list of examples")
        records.extend((path, r) for r in loaded)
    examples = [_example(path, i, record) for i, (path, record) in enumerate(records)]
    missing = missing_databases(data_dir, examples, split)
    if missing:
        listed = ", ".join(f"{db} ({n} examples)" for db, n in sorted(missing.items()))
        action = "dropped" if drop_missing else "kept"
        log.warning("%s/%s: databases missing on disk, examples %s: %s", data_dir, split, action, listed)
        if drop_missing:
            examples = [e for e in examples if e.db_id not in missing]
    return examples


def _example(path: pathlib.Path, index: int, record: Any) -> Example:
    if not isinstance(record, dict):
        raise DataError(f"{path} example {index} is not an object")
    query = record.get("query", record.get("SQL"))
    missing = [k for k, v in (("db_id", record.get("db_id")), ("question", record.get("question")),
                              ("query/SQL", query)) if not isinstance(v, str)]
    if missing:
        raise DataError(f"{path} example {index} lacks string field(s) {missing}")
    known = {"db_id", "question", "query", "SQL", "evidence"}
    meta = {k: v for k, v in record.items() if k not in known}
    return Example(record["db_id"], record["question"], query, str(record.get("evidence") or ""), index, meta)


def _ordered(own: Iterable[pathlib.Path], others: Iterable[pathlib.Path]) -> list[pathlib.Path]:
    seen, out = set(), []
    for path in [*own, *others]:
        if path not in seen:
            seen.add(path)
            out.append(path)
    return out


def schema_files(data_dir: str | os.PathLike, split: str | None = None) -> list[pathlib.Path]:
    """The schema files of the layout that exist: ``split``'s own first, then the others."""
    root = pathlib.Path(data_dir)
    every = [root / "tables.json", *sorted(root.glob("*_tables.json")), *sorted(root.glob("*/*_tables.json"))]
    own = []
    if split is not None:
        name = split_name(split)
        own = [root / f"{name}_tables.json", root / name / f"{name}_tables.json", root / "tables.json"]
    return [p for p in _ordered(own, every) if p.is_file()]


def load_schemas(data_dir: str | os.PathLike, split: str | None = None) -> dict[str, dict]:
    """db_id -> tables.json entry, merged over every schema file of the layout (``split``'s own win)."""
    files = schema_files(data_dir, split)
    if not files:
        raise DataError(f"no schema file under {data_dir} (looked for tables.json, <split>_tables.json, "
                        f"<split>/<split>_tables.json)")
    schemas: dict[str, dict] = {}
    for path in files:
        entries = _read_json(path)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "db_id" in e for e in entries):
            raise DataError(f"{path} must hold a JSON list of objects with a db_id")
        for entry in entries:
            schemas.setdefault(entry["db_id"], entry)
    return schemas


def database_dirs(data_dir: str | os.PathLike, split: str | None = None) -> tuple[pathlib.Path, ...]:
    """The folders holding ``<db_id>/<db_id>.sqlite`` that exist: ``split``'s own first (``database/``,
    ``<split>_databases/``, ``<split>/<split>_databases/``), then the layout's others. Empty if none."""
    root = pathlib.Path(data_dir)
    every = [root / "database", *sorted(root.glob("*_databases")), *sorted(root.glob("*/*_databases"))]
    own = []
    if split is not None:
        name = split_name(split)
        own = [root / "database", root / f"{name}_databases", root / name / f"{name}_databases"]
    return tuple(p for p in _ordered(own, every) if p.is_dir())


def db_path(data_dir: str | os.PathLike, db_id: str, split: str | None = None) -> pathlib.Path:
    """Path of ``<db_id>.sqlite``; raises MissingDatabaseError naming every place it looked."""
    dirs = database_dirs(data_dir, split)
    candidates = [d / db_id / f"{db_id}.sqlite" for d in dirs]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(map(str, candidates)) if candidates else (
        f"{data_dir} has no database folder (database/, <split>_databases/, <split>/<split>_databases/)")
    raise MissingDatabaseError(f"database {db_id!r} not found; looked in {looked}")


SQL_PREDICTION_SUFFIXES = (".sql", ".txt", ".csv")
_CSV_SQL_COLUMNS = ("PREDICTED SQL", "pred", "prediction", "sql")


def read_sql_predictions(path: str | os.PathLike, examples: Sequence[Example] | None = None) -> list[str]:
    """One predicted SQL per example, in split order, from a published system's prediction file.

    ``.csv`` (DIN-SQL's release): the column ``PREDICTED SQL`` (or ``pred`` / ``prediction`` /
    ``sql``), one row per example. Anything else is the official evaluator's format: line ``i`` is the
    prediction for example ``i`` (lines split as Python's text mode does, ``\\r\\n`` included), surrounding
    whitespace stripped, so a line of spaces is an empty (wrong) prediction. A trailing
    ``<TAB><db_id>`` naming example ``i``'s database (the gold-file layout) is dropped; every other
    tab is whitespace inside the SQL. The official reader instead cuts a line at its first tab
    (``line.strip().split('\\t')[0]``), which truncates a query written with tabs, such as
    c3sql_chatgpt.sql line 771 (docs/evaluation.md).
    """
    path = pathlib.Path(path)
    if path.suffix.lower() == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            column = next((c for c in _CSV_SQL_COLUMNS if c in (reader.fieldnames or ())), None)
            if column is None:
                raise DataError(f"{path}: no SQL column (looked for {', '.join(_CSV_SQL_COLUMNS)}); "
                                f"columns are {reader.fieldnames}")
            return [(row[column] or "").replace("\t", " ").strip() for row in reader]
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    out = []
    for i, line in enumerate(lines):
        sql = line.strip()
        head, tab, last = sql.rpartition("\t")
        if tab and examples is not None and i < len(examples) and last.strip() == examples[i].db_id:
            sql = head.strip()
        out.append(sql.replace("\t", " "))
    return out


def read_system_predictions(predictions_dir: str | os.PathLike, systems: Sequence[str],
                            examples: Sequence[Example]) -> list[list[str]]:
    """Per system (a file name under ``predictions_dir``), its ``read_sql_predictions``; a DataError
    unless each has one prediction per example."""
    per_system = [read_sql_predictions(pathlib.Path(predictions_dir) / system, examples) for system in systems]
    for system, predictions in zip(systems, per_system):
        if len(predictions) != len(examples):
            raise DataError(f"{system}: {len(predictions)} predictions for {len(examples)} examples")
    return per_system


def missing_databases(data_dir: str | os.PathLike, examples: Iterable[Example],
                      split: str | None = None) -> dict[str, int]:
    """db_id -> number of examples, for the databases of ``examples`` that are not on disk."""
    counts = collections.Counter(e.db_id for e in examples)
    missing = {}
    for db_id, n in counts.items():
        try:
            db_path(data_dir, db_id, split)
        except MissingDatabaseError:
            missing[db_id] = n
    return missing
