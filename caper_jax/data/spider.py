"""Readers for text-to-SQL data in the Spider and BIRD layouts (the demo world uses Spider's).

    Spider:  dev.json, train_spider.json (+ train_others.json), tables.json, database/<db>/<db>.sqlite
    BIRD:    dev.json / train.json with "SQL" and "evidence", dev_tables.json / train_tables.json,
             dev_databases/<db>/<db>.sqlite, train_databases/<db>/<db>.sqlite
    demo:    train.json, dev.json, tables.json, database/<db>/<db>.sqlite

Examples come back as ``Example`` records with the gold SQL under ``query`` whatever the source
called it. A database that is missing on disk is not an error at load time — Spider's public dev
copy, for one, lacks wta_1 — but it is reported (a logged warning, ``missing_databases``) and can
be dropped with ``drop_missing=True``; ``db_path`` raises ``MissingDatabaseError`` for it.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import pathlib
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

_DATABASE_DIRS = ("database", "dev_databases", "train_databases", "train/train_databases", "dev/dev_databases")
_TABLE_FILES = ("tables.json", "dev_tables.json", "train_tables.json", "train/train_tables.json",
                "dev/dev_tables.json")
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


def _read_json(path: pathlib.Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise DataError(f"{path} is not valid JSON: {error}") from error


def split_files(data_dir: str | pathlib.Path, split: str) -> list[pathlib.Path]:
    """The JSON file(s) holding a split. ``split`` may also be a path relative to ``data_dir``."""
    root = pathlib.Path(data_dir)
    if split.endswith(".json"):
        path = root / split
        if not path.is_file():
            raise DataError(f"no split file {path}")
        return [path]
    options = _SPLIT_FILES.get(split, ((f"{split}.json",),))
    for names in options:
        if (root / names[0]).is_file():
            return [root / n for n in names if (root / n).is_file()]
    tried = ", ".join(str(root / names[0]) for names in options)
    raise DataError(f"no {split!r} split under {root} (looked for {tried})")


def load_split(data_dir: str | pathlib.Path, split: str, *, drop_missing: bool = False) -> list[Example]:
    """Examples of a split (``"dev"``, ``"train"``, any ``<name>`` with ``<name>.json``, or a .json path)."""
    records = []
    for path in split_files(data_dir, split):
        loaded = _read_json(path)
        if not isinstance(loaded, list):
            raise DataError(f"{path} must hold a JSON list of examples")
        records.extend((path, r) for r in loaded)
    examples = [_example(path, i, record) for i, (path, record) in enumerate(records)]
    missing = missing_databases(data_dir, examples)
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


def load_schemas(data_dir: str | pathlib.Path) -> dict[str, dict]:
    """db_id -> tables.json entry, merged over every schema file of the layout."""
    root = pathlib.Path(data_dir)
    files = [root / name for name in _TABLE_FILES if (root / name).is_file()]
    if not files:
        raise DataError(f"no schema file under {root} (looked for {', '.join(_TABLE_FILES)})")
    schemas: dict[str, dict] = {}
    for path in files:
        entries = _read_json(path)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "db_id" in e for e in entries):
            raise DataError(f"{path} must hold a JSON list of objects with a db_id")
        for entry in entries:
            schemas.setdefault(entry["db_id"], entry)
    return schemas


def db_path(data_dir: str | pathlib.Path, db_id: str) -> pathlib.Path:
    """Path of ``<db_id>.sqlite``; raises MissingDatabaseError naming every place it looked."""
    root = pathlib.Path(data_dir)
    candidates = [root / d / db_id / f"{db_id}.sqlite" for d in _DATABASE_DIRS]
    for path in candidates:
        if path.is_file():
            return path
    raise MissingDatabaseError(f"database {db_id!r} not found; looked in " + ", ".join(map(str, candidates)))


def missing_databases(data_dir: str | pathlib.Path, examples: Iterable[Example]) -> dict[str, int]:
    """db_id -> number of examples, for the databases of ``examples`` that are not on disk."""
    counts = collections.Counter(e.db_id for e in examples)
    missing = {}
    for db_id, n in counts.items():
        try:
            db_path(data_dir, db_id)
        except MissingDatabaseError:
            missing[db_id] = n
    return missing
