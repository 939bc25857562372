"""Typed database schemas: tables, typed columns, primary and foreign keys.

Two sources, one shape: a Spider/BIRD ``tables.json`` entry (``Schema.from_spider``) and the SQLite
file's own catalogue (``Schema.from_sqlite``). Type-preserving mutations need to know which columns
are interchangeable, so every column gets one of Spider's five type classes
(``text``, ``number``, ``time``, ``boolean``, ``others``); declared SQLite types are mapped to them
with SQLite's affinity rules plus a date/time check. On the 19 Spider dev databases the two sources
agree on every column's class except ``bool`` columns (annotated ``others``), and the SQLite
catalogue also lists every member of a composite primary key, which ``tables.json`` omits. Fault
injection uses the SQLite catalogue: it is what the data obeys.

Names keep their original spelling; lookups are case-insensitive, as in SQLite.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sqlite3
from typing import Literal

TypeClass = Literal["text", "number", "time", "boolean", "others"]
_TYPE_CLASSES = ("text", "number", "time", "boolean", "others")


@dataclasses.dataclass(frozen=True)
class Column:
    table: str
    name: str
    type: TypeClass
    primary_key: bool = False


@dataclasses.dataclass(frozen=True)
class ForeignKey:
    table: str
    column: str
    ref_table: str
    ref_column: str


@dataclasses.dataclass(frozen=True)
class Schema:
    db_id: str
    tables: tuple[str, ...]
    columns: tuple[Column, ...]
    foreign_keys: tuple[ForeignKey, ...] = ()
    _by_table: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        by_table: dict[str, dict[str, Column]] = {t.lower(): {} for t in self.tables}
        for column in self.columns:
            if column.table.lower() not in by_table:
                raise ValueError(f"column {column.name} of unknown table {column.table}")
            if column.type not in _TYPE_CLASSES:
                raise ValueError(f"column {column.table}.{column.name}: bad type {column.type!r}")
            by_table[column.table.lower()][column.name.lower()] = column
        object.__setattr__(self, "_by_table", by_table)

    def has_table(self, table: str) -> bool:
        return table.lower() in self._by_table

    def table_name(self, table: str) -> str:
        """Original spelling of a table name."""
        for name in self.tables:
            if name.lower() == table.lower():
                return name
        raise KeyError(f"{self.db_id}: no table {table!r}")

    def columns_of(self, table: str) -> tuple[Column, ...]:
        try:
            return tuple(self._by_table[table.lower()].values())
        except KeyError:
            raise KeyError(f"{self.db_id}: no table {table!r}") from None

    def column(self, table: str, name: str) -> Column | None:
        return self._by_table.get(table.lower(), {}).get(name.lower())

    def primary_keys(self, table: str) -> tuple[Column, ...]:
        return tuple(c for c in self.columns_of(table) if c.primary_key)

    @classmethod
    def from_spider(cls, entry: dict) -> Schema:
        """From one entry of Spider's ``tables.json``."""
        try:
            tables = tuple(entry["table_names_original"])
            raw_columns = entry["column_names_original"]
            types = entry["column_types"]
            # Composite primary keys appear as nested lists (Spider's train_others, BIRD).
            primary = {i for key in entry.get("primary_keys", [])
                       for i in (key if isinstance(key, list) else [key])}
            columns, index_to_column = [], {}
            for index, ((table_index, name), type_) in enumerate(zip(raw_columns, types)):
                if table_index < 0:  # the "*" pseudo-column
                    continue
                # Spider writes type classes; BIRD's dev_tables.json writes SQLite type names.
                type_ = type_ if type_ in _TYPE_CLASSES else type_class(type_)
                column = Column(tables[table_index], name, type_, index in primary)
                columns.append(column)
                index_to_column[index] = column
            foreign_keys = tuple(
                ForeignKey(index_to_column[a].table, index_to_column[a].name,
                           index_to_column[b].table, index_to_column[b].name)
                for a, b in entry.get("foreign_keys", []))
            return cls(entry["db_id"], tables, tuple(columns), foreign_keys)
        except (KeyError, IndexError, TypeError) as error:
            raise ValueError(f"malformed tables.json entry: {error!r}") from error

    @classmethod
    def from_sqlite(cls, db_path: str | os.PathLike, db_id: str | None = None) -> Schema:
        """From the database file's own catalogue (read-only connection)."""
        path = pathlib.Path(db_path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"database not found: {path}")
        connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        connection.text_factory = lambda b: b.decode("utf-8", errors="replace")
        try:
            tables = tuple(name for (name,) in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                "ORDER BY rowid"))
            columns, foreign_keys = [], []
            for table in tables:
                quoted = table.replace('"', '""')
                for _, name, declared, _, _, pk in connection.execute(f'PRAGMA table_info("{quoted}")'):
                    columns.append(Column(table, name, type_class(declared), bool(pk)))
                for row in connection.execute(f'PRAGMA foreign_key_list("{quoted}")'):
                    ref_table, column, ref_column = row[2], row[3], row[4]
                    foreign_keys.append(ForeignKey(table, column, ref_table, ref_column or column))
        finally:
            connection.close()
        return cls(db_id or path.stem, tables, tuple(columns), tuple(foreign_keys))


def affinity(declared: str | None) -> str:
    """SQLite's column affinity of a declared type, in three groups that compare without
    conversion among themselves: ``numeric`` (INTEGER, REAL, NUMERIC), ``text``, ``none`` (BLOB
    or no type)."""
    upper = (declared or "").upper()
    if "INT" in upper:
        return "numeric"
    if any(word in upper for word in ("CHAR", "CLOB", "TEXT")):
        return "text"
    if not upper or "BLOB" in upper:
        return "none"
    return "numeric"


_AFFINITY_CLASS: dict[str, TypeClass] = {"numeric": "number", "text": "text", "none": "others"}


def type_class(declared: str | None) -> TypeClass:
    """Spider type class of a declared SQLite column type (SQLite affinity rules + dates)."""
    upper = (declared or "").upper()
    if any(word in upper for word in ("DATE", "TIME", "YEAR")):
        return "time"
    if "BOOL" in upper:
        return "boolean"
    return _AFFINITY_CLASS[affinity(declared)]  # REAL, FLOA, DOUB, NUMERIC, DECIMAL, ...: number


def load_spider_schemas(tables_json: str | os.PathLike) -> dict[str, Schema]:
    """All schemas of a ``tables.json`` file, by db_id."""
    entries = json.loads(pathlib.Path(tables_json).read_text())
    return {entry["db_id"]: Schema.from_spider(entry) for entry in entries}


__all__ = ["Column", "ForeignKey", "Schema", "TypeClass", "affinity", "load_spider_schemas", "type_class"]
