"""The text contract between the annotator (``caper_jax.sql``) and the models that read its output.

Everything a tuple, a prompt or a clause id means is fixed here, once, for both sides: the marker
that ends a query (``END_OF_SQL``), the schema serialisation, the prompt texts the policy and the
Clause-PRM read before the SQL, and the clause unit names with their written order and ids. It
lives in ``sql/`` because the annotator writes these texts into its tuples and ``sql/`` imports
nothing above itself; it needs only the standard library, so the data, model and evaluation code
import it without pulling in sqlglot or jax.

Tiny models on the demo world train at sequence length <= 512, so everything here is terse: one
line per table, ``table(column type [PK] [→ table.column], ...)``, column names exactly as the
database spells them (the SQL must use them verbatim), names that are not plain identifiers in
double quotes (SQLite's identifier quoting). With ``max_values > 0`` each text column also lists
its most frequent values (read from the database), which helps models write the right literals.

Both prompts use the Qwen chat markers (``<|im_start|>``, ``<|im_end|>``), which are single special
tokens in Qwen3.5's tokenizer and in the demo tokenizer; the SQL follows the prompt directly and
the policy ends it with ``END_OF_SQL``. ``prm_prompt`` is the same text as ``policy_prompt`` on
purpose: the PRM scores clauses in exactly the context they were generated in, and a PRM
initialised from the SFT policy starts from inputs it knows. BIRD's evidence is part of both, as
the question's ``Hint:`` line (``prompt_question``).
"""
from __future__ import annotations

import pathlib
import re
import sqlite3
from typing import Any, Mapping

END_OF_SQL = "<|im_end|>"

# Clause units as caper_jax.sql.clauses splits a query: the clauses of one SELECT, the compound
# operators, and a leading WITH.
CLAUSE_NAMES = ("SELECT", "FROM", "WHERE", "GROUP BY", "HAVING", "ORDER BY", "LIMIT")
COMPOUND_NAMES = ("UNION", "UNION ALL", "INTERSECT", "EXCEPT")
WITH_NAME = "WITH"
# Written order of the units: a compound's operator parts come before the ORDER BY / LIMIT of the
# compound result, as split_clauses writes them. Aligns two queries' clauses and places a missing
# root clause.
CLAUSE_ORDER = (WITH_NAME, *CLAUSE_NAMES[:5], *COMPOUND_NAMES, *CLAUSE_NAMES[5:])
# The PRM's clause ids: a SELECT clause's index in CLAUSE_NAMES (0..6); every compound operator
# unit shares COMPOUND_CLAUSE_ID; a WITH unit gets WITH_CLAUSE_ID.
COMPOUND_CLAUSE_ID = 7
WITH_CLAUSE_ID = 8
NUM_CLAUSE_IDS = 9
CLAUSE_IDS = {**{name: i for i, name in enumerate(CLAUSE_NAMES)},
              **{name: COMPOUND_CLAUSE_ID for name in COMPOUND_NAMES}, WITH_NAME: WITH_CLAUSE_ID}

_PLAIN_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_VALUE_CHARS = 40


class SchemaError(ValueError):
    """A tables.json entry is malformed."""


def quote_identifier(name: str) -> str:
    if _PLAIN_IDENTIFIER.fullmatch(name):
        return name
    return '"' + name.replace('"', '""') + '"'


def serialize_schema(entry: Mapping[str, Any], max_values: int = 0,
                     db_path: str | pathlib.Path | None = None) -> str:
    """One line per table: ``table(col type PK, col type → other.col, ...)``.

    ``entry`` is one Spider/BIRD ``tables.json`` record. Types are Spider's (``number``, ``text``,
    ``time``, ``boolean``, ``others``). ``max_values`` > 0 appends up to that many of the most
    frequent values of every text column that is not a key, ``('a', 'b')``, most frequent first
    (ties by value), read from ``db_path`` (required then).
    """
    try:
        tables = list(entry["table_names_original"])
        columns = [(int(t), str(name)) for t, name in entry["column_names_original"]]
        types = list(entry["column_types"])
        primary = _flatten_keys(entry.get("primary_keys", []))
        foreign = {int(a): int(b) for a, b in entry.get("foreign_keys", [])}
    except (KeyError, TypeError, ValueError) as error:
        raise SchemaError(f"malformed tables.json entry {entry.get('db_id', '?')!r}: {error!r}") from error
    if len(types) != len(columns):
        raise SchemaError(f"{entry.get('db_id')!r}: {len(columns)} columns but {len(types)} column types")
    if max_values < 0:
        raise ValueError(f"max_values must be >= 0, got {max_values}")
    if max_values and db_path is None:
        raise ValueError("max_values > 0 needs db_path to read the values from")

    conn = _open_read_only(db_path) if max_values else None
    try:
        lines = []
        for t, table in enumerate(tables):
            parts = []
            for c, (owner, name) in enumerate(columns):
                if owner != t:
                    continue
                part = f"{quote_identifier(name)} {types[c]}"
                if c in primary:
                    part += " PK"
                if c in foreign:
                    target_table, target_column = columns[foreign[c]]
                    part += f" → {quote_identifier(tables[target_table])}.{quote_identifier(target_column)}"
                if conn is not None and types[c] == "text" and c not in primary and c not in foreign:
                    values = _frequent_values(conn, table, name, max_values)
                    if values:
                        part += " (" + ", ".join(_sql_string(v) for v in values) + ")"
                parts.append(part)
            lines.append(f"{quote_identifier(table)}({', '.join(parts)})")
        return "\n".join(lines)
    finally:
        if conn is not None:
            conn.close()


def _flatten_keys(keys) -> set[int]:
    """Spider lists primary keys as ints; composite keys appear as nested lists in some files."""
    flat = set()
    for key in keys:
        if isinstance(key, (list, tuple)):
            flat.update(int(k) for k in key)
        else:
            flat.add(int(key))
    return flat


def _open_read_only(db_path: str | pathlib.Path) -> sqlite3.Connection:
    path = pathlib.Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"no database at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.text_factory = lambda b: b.decode("utf-8", errors="replace")
    return conn


def _frequent_values(conn: sqlite3.Connection, table: str, column: str, k: int) -> list[str]:
    # Always quoted here: a plain-looking name can still be a keyword ("order").
    col, tab = ('"' + name.replace('"', '""') + '"' for name in (column, table))
    rows = conn.execute(f"SELECT {col} FROM {tab} WHERE {col} IS NOT NULL GROUP BY {col} "
                        f"ORDER BY COUNT(*) DESC, {col} LIMIT {int(k)}").fetchall()
    return [str(r[0])[:_MAX_VALUE_CHARS] for r in rows]


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def prompt_question(question: str, evidence: str = "") -> str:
    """The question as the prompts show it: BIRD's evidence, if any, follows on a ``Hint:`` line.

    The Clause-PRM's inputs (annotated tuples, held-out failures, the rows ``verify`` and ``evaluate``
    score) carry this text as their question, so that ``prm_prompt(prompt_question(q, e), schema)``
    is the policy's own prompt, the one GRPO's PRM reads. Without evidence the question is returned
    as it is (Spider, the demo world), so it still matches the split's records.
    """
    if not evidence or not evidence.strip():
        return question
    return f"{question.strip()}\nHint: {evidence.strip()}"


def policy_prompt(question: str, schema_text: str, evidence: str = "") -> str:
    """What the SFT/GRPO policy reads before it writes the SQL (BIRD's evidence, if any, as a hint)."""
    shown = prompt_question(question, evidence).strip()
    return f"<|im_start|>user\n{schema_text}\nQuestion: {shown}<|im_end|>\n<|im_start|>assistant\n"


def prm_prompt(question: str, schema_text: str, evidence: str = "") -> str:
    """The Clause-PRM's context before the SQL prefix; identical to the policy's (see module doc)."""
    return policy_prompt(question, schema_text, evidence)
