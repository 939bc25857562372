"""BIRD's SQL dialect through caper_jax's SQL core: parse, canonicalise, execute on empty databases.

    python bench/bird_dialect.py [--data ../shared/data/bird_dev] [--json OUT.json]

BIRD dev (Li et al., "Can LLM Already Serve as A Database Interface? A BIg Bench for Large-Scale
Database Grounded Text-to-SQLs", NeurIPS 2023; data CC BY-SA 4.0) comes with its gold SQL, its
schemas (``dev_tables.json``) and, in ``predictions/*.sql``, six published systems' predictions;
its databases are not here. For the gold and every prediction this survey records:

* whether ``split_clauses`` (``nested=True``: subqueries' units too, whose spans it keeps) and
  ``canonicalize`` (with the schema SQLite reports for the database, as the annotator reads it:
  ``Schema.from_sqlite``) accept it, and if canonicalize had to fall back to the unqualified form;
* whether it executes, through the project's sandboxed ``Executor``, on an empty database built
  from ``dev_tables.json`` (``caper_jax.data.bird``): every name must resolve and every function
  exist, though no rows come back;
* whether its canonical form (``canonicalize(...).tree`` rendered as SQLite) executes there too,
  for the queries whose own text does: the annotator runs SQL built from canonical trees
  (``localize``'s hybrids and corrected queries), so canonicalisation must keep SQL runnable.

A prediction that does not parse is put in one of ``FAULT_KINDS`` by the first rule its text
matches: each is a fault of the prediction itself, which SQLite refuses too.

Prints the tables of docs/sql.md ("BIRD's dialect") and, with ``--json``, writes every outcome.
The figures are counts, not speeds; the load average is printed with the survey's time only.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from caper_jax.data.bird import build_empty_databases  # noqa: E402
from caper_jax.data.spider import DataError, load_split, read_sql_predictions  # noqa: E402
from caper_jax.sql.canonical import DIALECT, CanonicalizeError, canonicalize  # noqa: E402
from caper_jax.sql.clauses import SqlParseError, split_clauses  # noqa: E402
from caper_jax.sql.execution import Executors  # noqa: E402
from caper_jax.sql.schema import Schema  # noqa: E402

GOLD = "gold"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "bird_dev"


@dataclasses.dataclass(frozen=True)
class Outcome:
    source: str                 # GOLD or a system (a predictions/*.sql file's stem)
    index: int                  # question_id = 0-based line of the predictions file
    db_id: str
    sql: str
    parse_error: str = ""       # "split_clauses: ..." or "canonicalize: ..."; "" when both accept it
    qualified: bool = False     # canonicalize resolved every column against the schema
    execution_error: str = ""   # "<error_kind>: <SQLite's message>"; "" when it executes
    canonical_error: str | None = None   # the canonical form's execution error; None when not tried
    units: tuple[tuple[str, int, int, int], ...] = ()   # split_clauses(sql, nested=True): (name, start, end, depth)

    @property
    def parses(self) -> bool:
        return not self.parse_error


# -- Why a prediction does not parse: the first rule whose test its text passes.

@dataclasses.dataclass(frozen=True)
class FaultKind:
    name: str
    description: str
    matches: Callable[[str], bool]


_CASE, _END = re.compile(r"\bCASE\b", re.I), re.compile(r"\bEND\b", re.I)
_DANGLING = re.compile(r"\b(?:THEN|WHEN|ELSE|AND|OR|ON|WHERE|FROM|JOIN|SELECT|BY)\s*$", re.I)


def _open_at_end(sql: str) -> bool:
    """The text stops inside a parenthesis, a quoted string or name, or a CASE, or after a word that needs more."""
    depth, quote = 0, None
    for char in sql:
        if quote:
            quote = None if char == quote else quote   # a doubled quote closes and reopens: same state
        elif char in "'\"`":
            quote = char
        elif char in "()":
            depth += 1 if char == "(" else -1
    text = sql.rstrip().rstrip(";")
    return bool(quote or depth > 0 or len(_CASE.findall(text)) > len(_END.findall(text)) or _DANGLING.search(text))


def _statements_after_semicolon(sql: str) -> bool:
    """A ``;`` outside quotes followed by more SQL."""
    quote = None
    for i, char in enumerate(sql):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"`":
            quote = char
        elif char == ";" and sql[i + 1:].strip():
            return True
    return False


FAULT_KINDS: tuple[FaultKind, ...] = (
    FaultKind("text_around_sql", "natural-language text or a markdown code fence (```) written into the SQL",
              lambda sql: "```" in sql),
    FaultKind("two_statements", "two statements on one line (SQLite runs one per call)", _statements_after_semicolon),
    FaultKind("backslash_quote", "a quote escaped with a backslash, \\' (MySQL's escape; SQLite has none, so the "
              "string runs on)", lambda sql: "\\'" in sql),
    FaultKind("unescaped_quote", "an apostrophe inside a string not doubled: 'Women's Soccer' ends the string "
              "at Women", lambda sql: re.search(r"'[^',]*[A-Za-z]'s\b", sql) is not None),
    FaultKind("truncated", "the SQL stops mid-query: inside a parenthesis, a string or a CASE, or after THEN",
              _open_at_end),
    FaultKind("split_token", "a space inside a name or an operator: T 2.opendate, > =",
              lambda sql: re.search(r"\bT \d+\.|[<>!] =", sql) is not None),
)


def fault_kind(sql: str) -> str:
    """The first of ``FAULT_KINDS`` whose rule the text matches; ``"unknown"`` if none does."""
    return next((kind.name for kind in FAULT_KINDS if kind.matches(sql)), "unknown")


# -- The survey.

def systems_of(data: pathlib.Path) -> list[str]:
    return sorted(p.stem for p in (data / "predictions").glob("*.sql"))


def _parse(sql: str, schema: Schema) -> tuple[str, object, tuple]:
    """(error, canonical form, clause units) of one query; the error names the step that refused it."""
    try:
        units = tuple((u.name, u.start, u.end, u.depth) for u in split_clauses(sql, nested=True))
    except SqlParseError as error:
        return f"split_clauses: {error}", None, ()
    try:
        return "", canonicalize(sql, schema), units
    except CanonicalizeError as error:
        return f"canonicalize: {error}", None, units


def _error(result) -> str:
    return "" if result.ok else f"{result.error_kind}: {result.error}"


def survey(data: str | os.PathLike, databases: str | os.PathLike, systems: Sequence[str] | None = None,
           *, gold: bool = True) -> list[Outcome]:
    """Every gold (unless ``gold=False``), then every prediction of ``systems`` (default: all) of
    ``data``, on the empty databases already built in ``databases`` (``build_empty_databases`` layout)."""
    data = pathlib.Path(data)
    examples = load_split(data, "dev")
    sources = [(GOLD, [e.query for e in examples])] if gold else []
    for system in systems_of(data) if systems is None else systems:
        predictions = read_sql_predictions(data / "predictions" / f"{system}.sql", examples)
        if len(predictions) != len(examples):
            raise DataError(f"{system}.sql has {len(predictions)} lines for {len(examples)} questions")
        sources.append((system, predictions))
    outcomes = []
    parsed: dict[tuple[str, str], tuple[str, object, tuple]] = {}   # 17 % of the texts repeat one already seen
    with Executors(databases) as executors:
        schemas = {db: Schema.from_sqlite(executors.db_path(db), db) for db in {e.db_id for e in examples}}
        for source, queries in sources:
            for example, sql in zip(examples, queries):
                key = (example.db_id, sql)
                if key not in parsed:
                    parsed[key] = _parse(sql, schemas[example.db_id])
                parse_error, canonical, units = parsed[key]
                execution_error = _error(executors.execute(example.db_id, sql))
                canonical_error = None
                if canonical is not None and not execution_error:
                    canonical_error = _error(executors.execute(example.db_id, canonical.tree.sql(dialect=DIALECT)))
                outcomes.append(Outcome(source, example.index, example.db_id, sql, parse_error,
                                        canonical is not None and canonical.qualified, execution_error,
                                        canonical_error, units))
    return outcomes


# -- The figures.

_NAMED = re.compile(r"^(\w+: (?:no such column|no such table|ambiguous column name|misuse of aggregate function))\b.*")


def execution_reason(error: str) -> str:
    """An execution error grouped for counting: the offending column, table or aggregate dropped, a
    missing function's name kept (it says which dialect the prediction wrote)."""
    return _NAMED.sub(r"\1", error)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def report(outcomes: Sequence[Outcome]) -> str:
    """The markdown tables of docs/sql.md's "BIRD's dialect" section."""
    by_source: dict[str, list[Outcome]] = collections.defaultdict(list)
    for outcome in outcomes:
        by_source[outcome.source].append(outcome)
    lines = ["| SQL | n | split + canonicalise | parse errors | unqualified | executes on the empty db "
             "| canonical form executes |", "|---|---|---|---|---|---|---|"]
    for source, rows in by_source.items():
        parsed = [r for r in rows if r.parses]
        executed = [r for r in rows if not r.execution_error]
        tried = [r for r in rows if r.canonical_error is not None]
        canonical_ok = sum(not r.canonical_error for r in tried)
        lines.append(f"| {source} | {len(rows)} | {len(parsed)} ({_pct(len(parsed), len(rows))}) "
                     f"| {len(rows) - len(parsed)} | {sum(not r.qualified for r in parsed)} "
                     f"| {len(executed)} ({_pct(len(executed), len(rows))}) | {canonical_ok} of {len(tried)} |")
    lines += ["", "| parse error kind | what the prediction did | " + " | ".join(by_source) + " |",
              "|---|---|" + "---|" * len(by_source)]
    kinds = collections.Counter((fault_kind(r.sql), r.source) for r in outcomes if not r.parses)
    for kind in [*FAULT_KINDS, FaultKind("unknown", "no rule matches", lambda sql: False)]:
        counts = [kinds[kind.name, source] for source in by_source]
        if any(counts):
            lines.append(f"| `{kind.name}` | {kind.description} | " + " | ".join(map(str, counts)) + " |")
    lines += ["", "| execution error on the empty databases | " + " | ".join(by_source) + " |",
              "|---|" + "---|" * len(by_source)]
    reasons = collections.Counter((execution_reason(r.execution_error), r.source) for r in outcomes
                                  if r.execution_error)
    for reason in sorted({reason for reason, _ in reasons}, key=lambda x: (-sum(reasons[x, s] for s in by_source), x)):
        lines.append(f"| `{reason}` | " + " | ".join(str(reasons[reason, s]) for s in by_source) + " |")
    lines += ["", "| canonical form that does not execute, its own text does (source, question_id) | error |",
              "|---|---|"]
    for r in outcomes:
        if r.canonical_error:
            lines.append(f"| {r.source} {r.index} | `{r.canonical_error}` |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA,
                        help="BIRD dev folder: dev.json, dev_tables.json, predictions/*.sql")
    parser.add_argument("--json", type=pathlib.Path, help="also write every outcome here (a JSON list)")
    args = parser.parse_args(argv)
    for needed in ("dev.json", "dev_tables.json", "predictions"):
        if not (args.data / needed).exists():
            print(f"error: {args.data / needed} not found (--data is BIRD's dev folder)", file=sys.stderr)
            return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"error: --json {args.json}: no folder {args.json.parent}", file=sys.stderr)
        return 2
    # load_split warns that dev.json's databases are missing: here they are absent by design.
    logging.getLogger("caper_jax.data.spider").setLevel(logging.ERROR)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as databases:
        try:
            build_empty_databases(args.data / "dev_tables.json", databases)
            outcomes = survey(args.data, databases)
        except (DataError, ValueError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    print(report(outcomes))
    print(f"\n{len(outcomes)} queries in {time.perf_counter() - start:.1f} s; "
          f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
