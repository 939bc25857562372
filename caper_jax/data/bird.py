"""Empty SQLite databases built from BIRD's ``dev_tables.json``: the schema without the data.

BIRD's databases (Li et al., "Can LLM Already Serve as A Database Interface? A BIg Bench for
Large-Scale Database Grounded Text-to-SQLs", NeurIPS 2023) come as a 1.5 GB download; its
``<split>_tables.json`` (Spider's ``tables.json`` format) is small and public. A database with the
same tables, columns, declared types, primary and foreign keys and no rows is enough to ask SQLite
whether a query *runs*: every name resolves, every function exists, the quoting reads as BIRD means
it. It cannot say what a query returns, so execution accuracy still needs the real files.

What is kept from a ``tables.json`` entry, and how:

* tables and columns with their original spelling (``table_names_original``,
  ``column_names_original``), in their order; every name is written double-quoted in the DDL
  (``""`` for a quote inside it), so names with spaces, parentheses, ``%`` or ``-``
  (``"Free Meal Count (K-12)"``) and keywords (financial's ``order`` table) are created as written.
  Queries then reach them with BIRD's backquotes or double quotes, as SQLite reads either;
* ``column_types`` as the declared type (BIRD writes ``integer``, ``real``, ``text``, ``date``,
  ``datetime``), so SQLite gives each column the affinity its name implies;
* ``primary_keys``: a number is one column's key, a list a composite key (BIRD writes both);
* ``foreign_keys``: one ``FOREIGN KEY (a) REFERENCES t(b)`` per pair. BIRD lists some keys that
  reference a column that is not its table's key (card_games' ``cards.uuid``); SQLite accepts the
  declaration and checks it only when rows are written, which never happens here.

The layout is the one ``caper_jax.sql.execution.Executors`` searches, ``<out>/<db_id>/<db_id>.sqlite``,
so the sandboxed executor and ``Schema.from_sqlite`` read these files as they read BIRD's own.
Imports no JAX.
"""
from __future__ import annotations

import json
import os
import pathlib
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any


class SchemaEntryError(ValueError):
    """A ``tables.json`` entry this builder cannot turn into tables (missing keys, bad indices)."""


def _quoted(name: str) -> str:
    """``name`` as an SQLite double-quoted identifier (an inner ``"`` doubled), plain names too: a
    plain-looking name can be a keyword (``order``), which ``contract.quote_identifier`` leaves bare."""
    return '"' + name.replace('"', '""') + '"'


def _key_columns(key: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(key) if isinstance(key, (list, tuple)) else (key,)


def create_table_statements(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """One ``CREATE TABLE`` statement per table of a ``tables.json`` entry, in the entry's order."""
    try:
        tables = list(entry["table_names_original"])
        columns = [(int(t), str(name)) for t, name in entry["column_names_original"]]
        types = list(entry["column_types"])
        primary_keys = [_key_columns(k) for k in entry.get("primary_keys", [])]
        foreign_keys = [(int(a), int(b)) for a, b in entry.get("foreign_keys", [])]
    except (KeyError, TypeError, ValueError) as error:
        raise SchemaEntryError(f"malformed tables.json entry {entry.get('db_id', '?')!r}: {error!r}") from error
    db_id = entry.get("db_id", "?")
    if len(types) != len(columns):
        raise SchemaEntryError(f"{db_id}: {len(columns)} columns but {len(types)} column types")

    def column(index: int) -> tuple[int, str]:
        if not 0 <= index < len(columns) or not 0 <= columns[index][0] < len(tables):
            raise SchemaEntryError(f"{db_id}: column index {index} names no column of a table")
        return columns[index]

    definitions: list[list[str]] = [[] for _ in tables]
    for index, (table, name) in enumerate(columns):
        if table < 0:       # Spider's "*" pseudo-column
            continue
        column(index)
        definitions[table].append(f"{_quoted(name)} {types[index]}")
    for key in primary_keys:
        owners = {column(i)[0] for i in key}
        if len(owners) != 1:
            raise SchemaEntryError(f"{db_id}: primary key {list(key)} spans several tables")
        names = ", ".join(_quoted(column(i)[1]) for i in key)
        definitions[owners.pop()].append(f"PRIMARY KEY ({names})")
    for source, target in foreign_keys:
        (table, name), (ref_table, ref_name) = column(source), column(target)
        definitions[table].append(f"FOREIGN KEY ({_quoted(name)}) REFERENCES "
                                  f"{_quoted(tables[ref_table])} ({_quoted(ref_name)})")
    return tuple(f"CREATE TABLE {_quoted(table)} ({', '.join(parts)})"
                 for table, parts in zip(tables, definitions))


def database_path(out_dir: str | os.PathLike, db_id: str) -> pathlib.Path:
    """Where ``Executors(out_dir)`` looks for ``db_id``: ``<out_dir>/<db_id>/<db_id>.sqlite``."""
    return pathlib.Path(out_dir) / db_id / f"{db_id}.sqlite"


def build_empty_database(entry: Mapping[str, Any], path: str | os.PathLike) -> pathlib.Path:
    """Writes the entry's tables, with no rows, to a new SQLite file at ``path``.

    Refuses (FileExistsError) to touch a file that is already there: a real database must never be
    overwritten by its empty copy. The file is written under a temporary name and renamed into
    place, so an interrupted build leaves nothing at ``path``.
    """
    path = pathlib.Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; an empty database is only written to a new file")
    statements = create_table_statements(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    connection = sqlite3.connect(partial)
    try:
        with connection:
            for statement in statements:
                connection.execute(statement)
    except sqlite3.Error as error:
        connection.close()
        partial.unlink(missing_ok=True)
        raise SchemaEntryError(f"{entry.get('db_id', '?')}: SQLite refused the schema: {error}") from error
    connection.close()
    partial.rename(path)
    return path


def build_empty_databases(tables_json: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, pathlib.Path]:
    """An empty database per entry of a ``tables.json`` file, in ``out_dir``'s executor layout; db_id -> path."""
    entries = json.loads(pathlib.Path(tables_json).read_text(encoding="utf-8"))
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "db_id" in e for e in entries):
        raise SchemaEntryError(f"{tables_json} must hold a JSON list of objects with a db_id")
    return {entry["db_id"]: build_empty_database(entry, database_path(out_dir, entry["db_id"]))
            for entry in entries}


__all__ = ["SchemaEntryError", "build_empty_database", "build_empty_databases", "create_table_statements",
           "database_path"]
