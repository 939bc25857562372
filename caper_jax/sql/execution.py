"""Sandboxed, cached SQLite execution of untrusted SQL and result equivalence (Spider, BIRD).

Model-written SQL is untrusted. Defence in depth, each layer checked by tests/sql/test_execution.py:

1. the file is opened read-only through a URI (``mode=ro``) and ``PRAGMA query_only`` is set;
2. ``SQLITE_LIMIT_ATTACHED`` is 0: ATTACH would otherwise create files even on a read-only
   connection;
3. an authorizer allows only SELECT / READ / FUNCTION / RECURSIVE actions (never
   ``load_extension``): every write, DDL, ATTACH, PRAGMA and VACUUM is refused before it runs;
4. a progress handler aborts a statement past its wall-clock limit (``timeout_s``) or past a budget
   of SQLite VM instructions (``max_vm_steps``), and at most ``max_rows`` rows are fetched, so a
   runaway recursive CTE or cartesian product costs a bounded time. The instruction budget is the
   reproducible limit: whether a query exceeds it does not depend on the machine's load, so labels
   built on it (the annotator's) are the same on a busy machine; the wall clock is then a backstop;
5. exactly one statement per call (sqlite3 refuses stacked statements).

Results are cached by (database, normalised SQL): the annotator re-executes the same gold query once
per mutation and GRPO groups repeat candidates. Normalisation removes comments (``-- ...`` to the
end of the line, ``/* ... */``, an unterminated ``/*`` to the end of the text, as SQLite reads
them), drops trailing ``;`` and collapses whitespace outside quotes, which never changes meaning.
Comments are found by sqlglot's tokenizer, never by folding text: a ``--`` inside a string or
quoted identifier is text, and a comment cannot swallow the lines after it. The normalised text is
what SQLite runs.

Ctrl-C is never swallowed: SIGINT during a query makes SQLite abort it (through the progress
handler), and ``execute`` raises KeyboardInterrupt instead of reporting an error or a timeout.

Equivalence follows the official evaluators: ``spider`` is test-suite-sql-eval's ``result_eq``
(bag of rows, or ordered list when the gold query has ORDER BY; any column permutation; no float
tolerance; two empty results are equal), ``bird`` is ``set(gold) == set(pred)``.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import pathlib
import re
import sqlite3
import time
from collections.abc import Callable
from typing import Literal

from sqlglot.dialects.sqlite import SQLite
from sqlglot.errors import SqlglotError
from sqlglot.tokens import TokenType

ErrorKind = Literal["parse", "forbidden", "timeout", "too_many_rows", "runtime", "missing_db",
                    "empty", "decode"]
Semantics = Literal["spider", "bird"]

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                              sqlite3.SQLITE_RECURSIVE})
_FORBIDDEN_FUNCTIONS = frozenset({"load_extension"})
# Every this many SQLite VM instructions the progress handler checks the clock and the instruction
# budget (~tens of µs); max_vm_steps is therefore enforced to within this many instructions.
_PROGRESS_STEPS = 1000
_MAX_VALUE_BYTES = 16 * 2**20
# Text and blob bytes one result may hold: max_rows alone lets 10k-1M rows of 16 MiB values through
# (SELECT zeroblob(16000000) FROM <recursive CTE> grows by ~0.4 GB/s until the deadline). Rows are
# fetched in chunks this small so that the budget is overshot by at most a chunk of maximal values.
DEFAULT_MAX_RESULT_BYTES = 256 * 2**20
_FETCH_CHUNK = 16
# Quoted tokens (strings, identifiers) are kept verbatim; whitespace between them is collapsed.
_QUOTED = re.compile(r"('[^']*(?:''[^']*)*'|\"[^\"]*(?:\"\"[^\"]*)*\"|`[^`]*(?:``[^`]*)*`|\[[^\]]*\])")
_SPACE = re.compile(r"\s+")
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_DIALECT = SQLite()
# What may lie between two tokens: whitespace and comments, nothing else (else the tokenizer skipped
# text SQLite would read, and normalisation leaves the SQL as written).
# (Each alternative starts with its own character and a comment ends at its first */, so there is
# only one way to match: no backtracking blow-up, no comment spanning two.)
_GAP = re.compile(r"(?:\s|--[^\n]*\n|/\*(?:[^*]|\*(?!/))*\*/)*")
_TAIL = re.compile(r"(?:\s|--[^\n]*(?:\n|\Z)|/\*(?:[^*]|\*(?!/))*(?:\*/|\Z))*")


@dataclasses.dataclass(frozen=True)
class ExecResult:
    rows: tuple[tuple, ...] = ()
    error_kind: ErrorKind | None = None
    error: str = ""
    columns: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error_kind is None


def normalize_sql(sql: str) -> str:
    """SQL without comments or trailing ';', whitespace collapsed outside quotes: what runs, and the cache key."""
    if "--" in sql or "/*" in sql:
        stripped = _strip_comments(sql)
        if stripped is not None:
            return stripped
        return sql.strip()  # not tokenizable (e.g. an unterminated string): SQLite reports it as written
    parts = _QUOTED.split(sql)
    parts[::2] = [_SPACE.sub(" ", part) for part in parts[::2]]
    return "".join(parts).strip().rstrip(";").strip()


def _strip_comments(sql: str) -> str | None:
    """The tokens of ``sql`` joined by what lay between them: '' if nothing, else one space.

    Trailing ``;`` tokens are dropped. None when sqlglot cannot tokenize the text or skipped
    anything but whitespace and comments between two tokens.
    """
    try:
        tokens = _DIALECT.tokenize(sql)
    except SqlglotError:
        if sql.endswith("/*"):  # SQLite reads a final "/*" as "/" "*", not as a comment
            return None
        try:  # SQLite lets a /* comment run to the end of the text; sqlglot needs it closed
            tokens = _DIALECT.tokenize(sql + "*/")
        except SqlglotError:
            return None
    while tokens and tokens[-1].token_type == TokenType.SEMICOLON:
        tokens = tokens[:-1]
    pieces: list[str] = []
    position = 0
    for token in tokens:
        if token.end >= len(sql) or not _GAP.fullmatch(sql[position:token.start]):
            return None
        if token.start > position and pieces:
            pieces.append(" ")
        pieces.append(sql[token.start:token.end + 1])
        position = token.end + 1
    # After the last token: whitespace, comments and the dropped semicolons; a -- or /* comment may
    # run to the end of the text.
    if not _TAIL.fullmatch(sql[position:].replace(";", " ")):
        return None
    return "".join(pieces)


def order_matters(gold_sql: str) -> bool:
    """Spider's rule: compare in order iff the gold SQL contains ORDER BY (anywhere but in a comment)."""
    return _ORDER_BY.search(normalize_sql(gold_sql)) is not None


def _authorizer(action: int, arg1, arg2, db_name, trigger) -> int:
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _FORBIDDEN_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _decode_text(raw: bytes) -> str:
    # Spider databases hold some non-UTF-8 text; the official evaluator decodes leniently too.
    return raw.decode("utf-8", errors="replace")


# printf's "%.Nc" repeats a character N times one append at a time, inside one VM instruction that
# no progress handler interrupts: printf('%.*c', 2147483647, 'x') takes ~8.7 s, once per row
# (26 s for 3 rows under timeout_s=1). printf/format are replaced by a wrapper that refuses widths and
# precisions adding up past the longest value SQLite may hold (the time is linear in their sum), and
# otherwise runs SQLite's own printf on a private in-memory connection with the same length limit.
_LEADING_INT = re.compile(r"\s*[-+]?\d+")
_PRINTF_SPEC = re.compile(r"%[-+ #0!,]*(\*|\d*)(?:\.(\*|\d*))?l{0,2}([a-zA-Z%])")


def _star_width(value) -> int:
    """A ``*`` width or precision as SQLite reads its argument (sqlite3_value_int64), made non-negative."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return abs(int(m.group())) if (m := _LEADING_INT.match(value)) else 0
    if isinstance(value, float):
        if value != value:
            return 0
        return _MAX_VALUE_BYTES + 1 if abs(value) == float("inf") else abs(int(value))
    return abs(value) if isinstance(value, int) else 0


def _printf_size(fmt: str, args: tuple) -> int:
    """The sum of the format's widths and precisions, ``*`` ones read from ``args`` in order."""
    used = total = 0
    for spec in _PRINTF_SPEC.finditer(fmt):
        for part in spec.group(1, 2):
            if part == "*":
                total += _star_width(args[used] if used < len(args) else 0)
                used += 1
            else:
                total += int(part) if part else 0
        used += spec.group(3) != "%"
    return total


def _bounded_printf(delegate: sqlite3.Connection):
    def printf(fmt=None, *args):
        text = fmt.decode("utf-8", "replace") if isinstance(fmt, bytes) else fmt   # SQLite reads a blob as text
        if isinstance(text, str) and _printf_size(text, args) > _MAX_VALUE_BYTES:
            raise ValueError(f"printf widths and precisions add up past {_MAX_VALUE_BYTES}")
        marks = ", ".join("?" * (1 + len(args)))
        return delegate.execute(f"SELECT printf({marks})", (fmt, *args)).fetchone()[0]
    return printf


class NotADatabaseError(ValueError):
    """The database path names a file that is not a SQLite database (text, empty, an LFS pointer)."""


def open_readonly(db_path: str | os.PathLike) -> sqlite3.Connection:
    """A sandboxed connection (layers 1-3 of the module docstring).

    Raises FileNotFoundError (no such file) or NotADatabaseError (not a SQLite file).
    """
    path = pathlib.Path(db_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"database not found: {path}")
    with open(path, "rb") as f:
        header = f.read(20)
        if header[:16] != b"SQLite format 3\x00":
            raise NotADatabaseError(f"{path} is not a SQLite database (no 'SQLite format 3' header)")
    # A WAL-mode file (header bytes 18-19 = 2) would make even a read-only connection create
    # <db>-wal and <db>-shm beside it, and fail ("unable to open database file") in a folder it
    # cannot write. With no -wal file, every committed page is in the file itself: open it as
    # immutable, which takes no locks and creates nothing. (A -wal file holds commits not yet in the
    # file: then the ordinary read-only open, which reads them.)
    wal = pathlib.Path(f"{path}-wal")
    immutable = header[18:20] == b"\x02\x02" and not (wal.exists() and wal.stat().st_size > 0)
    # Serialised use from several threads is fine (Grain may hand work between threads);
    # concurrent use of one Executor is not (its deadline and cache are per executor).
    connection = sqlite3.connect(f"{path.as_uri()}?mode=ro{'&immutable=1' if immutable else ''}", uri=True,
                                 check_same_thread=False,
                                 isolation_level=None)
    connection.execute("PRAGMA query_only = 1")
    connection.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    # zeroblob(1e9) would otherwise allocate a gigabyte inside one row.
    connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
    delegate = sqlite3.connect(":memory:", check_same_thread=False)
    delegate.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
    printf = _bounded_printf(delegate)
    for name in ("printf", "format"):
        connection.create_function(name, -1, printf, deterministic=True)
    connection.set_authorizer(_authorizer)
    return connection


class Executor:
    """Executes single SELECT statements on one database, sandboxed, time- and row-limited, cached.

    A missing database does not raise: every call returns ``error_kind="missing_db"``, so a
    batch over many examples can report and skip them. Not for concurrent use by several
    threads at once (one deadline and cache per executor): use one per worker.
    """

    def __init__(self, db_path: str | os.PathLike, timeout_s: float = 2.0, max_rows: int = 10_000,
                 cache_size: int = 4096, max_vm_steps: int | None = None,
                 max_result_bytes: int | None = DEFAULT_MAX_RESULT_BYTES):
        # Written as "not > 0" so that NaN is refused too: a NaN deadline is never passed (no timeout at all).
        if (not timeout_s > 0 or not max_rows > 0 or not cache_size >= 0
                or (max_vm_steps is not None and not max_vm_steps > 0)
                or (max_result_bytes is not None and not max_result_bytes > 0)):
            raise ValueError(f"need timeout_s > 0, max_rows > 0, cache_size >= 0, max_vm_steps None or > 0, "
                             f"max_result_bytes None or > 0; got {timeout_s}, {max_rows}, {cache_size}, "
                             f"{max_vm_steps}, {max_result_bytes}")
        self.db_path = pathlib.Path(db_path)
        self.timeout_s = timeout_s
        self.max_vm_steps = max_vm_steps
        # Progress-handler calls a query may take: each call follows _PROGRESS_STEPS instructions.
        self._max_progress_calls = None if max_vm_steps is None else -(-max_vm_steps // _PROGRESS_STEPS)
        self._progress_calls = 0
        self.max_rows = max_rows
        self.max_result_bytes = max_result_bytes
        self.cache_size = cache_size
        self.sqlite_seconds = 0.0  # time spent inside SQLite (execute + fetch), for benchmarks
        self._cache: collections.OrderedDict[str, ExecResult] = collections.OrderedDict()
        self._deadline = 0.0
        self._timed_out = False  # set by the progress handler when it aborts a query for its deadline
        self._closed = False
        try:
            self._connection: sqlite3.Connection | None = open_readonly(self.db_path)
        except FileNotFoundError:
            self._connection = None
        if self._connection is not None:
            self._connection.set_progress_handler(self._past_deadline, _PROGRESS_STEPS)

    def _past_deadline(self) -> int:
        self._progress_calls += 1
        if time.monotonic() > self._deadline or (
                self._max_progress_calls is not None and self._progress_calls > self._max_progress_calls):
            self._timed_out = True
            return 1
        return 0

    def close(self) -> None:
        self._closed = True
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def execute(self, sql: str | bytes) -> ExecResult:
        if isinstance(sql, bytes):
            try:
                sql = sql.decode("utf-8")
            except UnicodeDecodeError as error:
                return ExecResult(error_kind="decode", error=f"SQL is not UTF-8: {error}")
        if not isinstance(sql, str):
            raise TypeError(f"sql must be str or bytes, got {type(sql).__name__}")
        if self._closed:
            raise RuntimeError(f"executor of {self.db_path} is closed")
        key = normalize_sql(sql)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        result = self._run(key)
        if result.error_kind != "missing_db" and self.cache_size:
            self._cache[key] = result
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result

    def _run(self, sql: str) -> ExecResult:
        if self._connection is None:
            return ExecResult(error_kind="missing_db", error=f"database not found: {self.db_path}")
        if not sql:
            return ExecResult(error_kind="empty", error="empty SQL")
        try:
            sql.encode("utf-8")
        except UnicodeEncodeError as error:
            return ExecResult(error_kind="decode", error=f"SQL is not valid Unicode: {error}")
        if "\x00" in sql:  # sqlite3 refuses it with a ValueError; a sampled completion can hold one
            return ExecResult(error_kind="parse", error="SQL contains a NUL character")
        if not sqlite3.complete_statement(sql + "\n;"):  # "\n": a -- comment must not hide the ';'
            return ExecResult(error_kind="parse", error="incomplete SQL statement")
        try:
            return self._query(sql)
        except _NotUtf8:
            # Rare non-UTF-8 text in the data: decode leniently (as the official evaluator does)
            # only then, since a Python text_factory costs a call per value.
            self._connection.text_factory = _decode_text
            try:
                return self._query(sql)
            finally:
                self._connection.text_factory = str

    def _query(self, sql: str) -> ExecResult:
        start = time.monotonic()
        self._deadline = start + self.timeout_s
        self._progress_calls = 0
        self._timed_out = False
        cursor = self._connection.cursor()
        try:
            cursor.execute(sql)
            rows, too_large = self._fetch(cursor)
        except sqlite3.ProgrammingError as error:
            if "one statement at a time" in str(error):
                return ExecResult(error_kind="forbidden", error=str(error))
            if "number of bindings" in str(error):
                # A parameter placeholder (?, :name, @name, $name) that nothing binds: a sampled
                # completion wrote one. Not a query we can answer; not a fault of the executor.
                return ExecResult(error_kind="parse", error=f"SQL has unbound parameters: {error}")
            raise  # misuse of the executor (e.g. after close), not bad SQL
        except sqlite3.DatabaseError as error:
            if str(error).startswith("Could not decode to UTF-8"):
                raise _NotUtf8 from error
            if "interrupted" in str(error).lower() and not self._timed_out:
                # Only the progress handler interrupts, and it did not time out: a signal handler
                # raised inside it (Ctrl-C), and sqlite3 swallowed that exception. Re-raise it.
                raise KeyboardInterrupt(f"SQLite query interrupted: {sql[:80]}") from error
            return ExecResult(error_kind=_classify(error, self._timed_out), error=str(error))
        except (OverflowError, MemoryError, ValueError) as error:
            return ExecResult(error_kind="runtime", error=f"{type(error).__name__}: {error}")
        finally:
            self.sqlite_seconds += time.monotonic() - start
            cursor.close()
        if too_large:
            return ExecResult(error_kind="too_many_rows", error=f"result larger than {self.max_result_bytes} bytes")
        if len(rows) > self.max_rows:
            return ExecResult(error_kind="too_many_rows", error=f"more than {self.max_rows} rows")
        columns = tuple(d[0] for d in cursor.description or ())
        return ExecResult(rows=tuple(rows), columns=columns)

    def _fetch(self, cursor: sqlite3.Cursor) -> tuple[list, bool]:
        """Up to max_rows + 1 rows; (rows, True) as soon as their text/blob bytes pass max_result_bytes."""
        if self.max_result_bytes is None:
            return cursor.fetchmany(self.max_rows + 1), False
        rows: list = []
        size = 0
        while len(rows) <= self.max_rows:
            chunk = cursor.fetchmany(min(_FETCH_CHUNK, self.max_rows + 1 - len(rows)))
            if not chunk:
                break
            rows.extend(chunk)
            size += sum(len(v) for row in chunk for v in row if isinstance(v, (str, bytes)))
            if size > self.max_result_bytes:
                return [], True
        return rows, False


class _NotUtf8(Exception):
    pass


def database_dirs_of(database_dir) -> tuple[pathlib.Path, ...]:
    """One database folder (str / PathLike) or several (a sequence of them) as a tuple of Paths."""
    if isinstance(database_dir, (str, os.PathLike)):
        return (pathlib.Path(database_dir),)
    dirs = tuple(pathlib.Path(d) for d in database_dir)
    if not dirs:
        raise ValueError("no database folder given")
    return dirs


def find_database(database_dirs, db_id: str) -> pathlib.Path:
    """``<dir>/<db_id>/<db_id>.sqlite`` in the first of ``database_dirs`` that has it, else under the first
    (where a missing database is then reported). BIRD keeps dev and train databases in two folders."""
    dirs = database_dirs_of(database_dirs)
    for directory in dirs:
        path = directory / db_id / f"{db_id}.sqlite"
        if path.is_file():
            return path
    return dirs[0] / db_id / f"{db_id}.sqlite"


class Executors:
    """One Executor per database, opened on first use and kept open.

    ``databases`` says where a db_id's file is: the folder(s) of a Spider/BIRD layout, searched in
    order for ``<folder>/<db_id>/<db_id>.sqlite`` (BIRD's ``dev_databases/`` and ``train_databases/``,
    as ``caper_jax.data.spider.database_dirs`` lists them), or a function ``db_id -> path`` for a
    layout that resolves per split (``caper_jax.eval.ex.Databases``).
    """

    def __init__(self, databases: str | os.PathLike | tuple | Callable[[str], pathlib.Path], **executor_kwargs):
        if callable(databases):
            self._locate = databases
        else:
            dirs = database_dirs_of(databases)
            self._locate = lambda db_id: find_database(dirs, db_id)
        self.executor_kwargs = executor_kwargs
        self._executors: dict[str, Executor] = {}

    def db_path(self, db_id: str) -> pathlib.Path:
        return self._locate(db_id)

    def __getitem__(self, db_id: str) -> Executor:
        executor = self._executors.get(db_id)
        if executor is None:
            executor = self._executors[db_id] = Executor(self.db_path(db_id), **self.executor_kwargs)
        return executor

    def execute(self, db_id: str, sql: str | bytes) -> ExecResult:
        return self[db_id].execute(sql)

    def close(self) -> None:
        for executor in self._executors.values():
            executor.close()
        self._executors.clear()

    def __enter__(self) -> Executors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_FORBIDDEN_MARKERS = ("not authorized", "authorization denied", "prohibited", "readonly", "read-only",
                      "too many attached")


def _classify(error: sqlite3.DatabaseError, past_deadline: bool) -> ErrorKind:
    message = str(error).lower()
    if "interrupted" in message and past_deadline:
        return "timeout"
    if any(marker in message for marker in _FORBIDDEN_MARKERS):
        return "forbidden"
    if "syntax error" in message or "incomplete input" in message or "unrecognized token" in message:
        return "parse"
    return "runtime"


def _multiset_equal(a: tuple[tuple, ...], b: tuple[tuple, ...] | list[tuple]) -> bool:
    return collections.Counter(a) == collections.Counter(b)


def _cells(rows: tuple[tuple, ...]) -> collections.Counter:
    return collections.Counter(itertools.chain.from_iterable(rows))


def _column_permutations(gold: tuple[tuple, ...], pred: tuple[tuple, ...]):
    """Yields perm with pred column perm[i] as gold column i, pruned by column value multisets.

    Any bag or ordered match implies equal per-column multisets, so the pruning is exact; the
    official evaluator prunes with a 20-row sample and then checks the same condition.
    """
    n = len(gold[0])
    gold_columns = [collections.Counter(row[i] for row in gold) for i in range(n)]
    pred_columns = [collections.Counter(row[j] for row in pred) for j in range(n)]
    candidates = [[j for j in range(n) if pred_columns[j] == gold_columns[i]] for i in range(n)]

    def extend(prefix: list[int]):
        i = len(prefix)
        if i == n:
            yield tuple(prefix)
            return
        for j in candidates[i]:
            if j not in prefix:
                yield from extend(prefix + [j])

    yield from extend([])


def results_equal(gold: ExecResult, pred: ExecResult, *, semantics: Semantics = "spider",
                  ordered: bool) -> bool:
    """Whether pred's result matches gold's. A failed execution on either side is never equal.

    ``ordered`` applies to ``spider`` only (see ``order_matters``); ``bird`` compares row sets.
    """
    if not (gold.ok and pred.ok):
        return False
    if semantics == "bird":
        return set(gold.rows) == set(pred.rows)
    if semantics != "spider":
        raise ValueError(f"unknown semantics {semantics!r}; expected 'spider' or 'bird'")
    g, p = gold.rows, pred.rows
    if not g and not p:
        return True
    if len(g) != len(p) or len(g[0]) != len(p[0]):
        return False
    if (g == p) if ordered else _multiset_equal(g, p):  # identity permutation, the common case
        return True
    if len(g[0]) == 1 or _cells(g) != _cells(p):  # permuting columns keeps the bag of cells
        return False
    for perm in _column_permutations(g, p):
        permuted = [tuple(row[j] for j in perm) for row in p]
        if (list(g) == permuted) if ordered else _multiset_equal(g, permuted):
            return True
    return False


__all__ = ["ErrorKind", "ExecResult", "Executor", "Executors", "NotADatabaseError", "database_dirs_of", "find_database",
           "normalize_sql", "open_readonly", "order_matters", "results_equal"]
