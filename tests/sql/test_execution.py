"""Sandboxed execution (hostile SQL on a temp copy of a Spider db) and result equivalence rules."""
import hashlib
import json
import random
import shutil
import sqlite3
import time

import pytest

from caper_jax.sql.execution import (ExecResult, Executor, Executors, normalize_sql, order_matters,
                                     results_equal)
from tests.helpers import naive_spider_equal

TIMEOUT_S = 0.3


@pytest.fixture()
def db_copy(spider, tmp_path, monkeypatch):
    """A private copy of concert_singer; the cwd is its folder so relative ATTACH files land there."""
    folder = tmp_path / "db"
    folder.mkdir()
    path = folder / "concert_singer.sqlite"
    shutil.copy(spider / "database" / "concert_singer" / "concert_singer.sqlite", path)
    monkeypatch.chdir(folder)
    return path


def fingerprint(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


HOSTILE = [
    ("INSERT INTO singer (Singer_ID, Name) VALUES (99, 'x')", "forbidden"),
    ("UPDATE singer SET Name = 'x'", "forbidden"),
    ("DELETE FROM singer", "forbidden"),
    ("DROP TABLE singer", "forbidden"),
    ("CREATE TABLE evil (a)", "forbidden"),
    ("CREATE TEMP TABLE evil (a)", "forbidden"),
    ("ATTACH DATABASE 'evil.sqlite' AS evil", "forbidden"),
    ("ATTACH DATABASE ':memory:' AS evil", "forbidden"),
    ("PRAGMA journal_mode = WAL", "forbidden"),
    ("PRAGMA query_only = 0", "forbidden"),
    ("SELECT * FROM pragma_table_info('singer')", "forbidden"),
    ("VACUUM", "forbidden"),
    ("VACUUM INTO 'copy.sqlite'", "forbidden"),
    ("SELECT load_extension('libevil')", "forbidden"),
    ("SELECT 1; DELETE FROM singer", "forbidden"),
    ("SELECT 1; SELECT 2", "forbidden"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", "timeout"),
    ("SELECT count(*) FROM singer a, singer b, singer c, singer d, singer e, singer f, singer g, "
     "singer h, singer i WHERE a.Age + b.Age + c.Age + d.Age + e.Age + f.Age + g.Age + h.Age > i.Age",
     "timeout"),
    ("SELECT * FROM singer a, singer b, singer c, singer d", "too_many_rows"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c", "too_many_rows"),
    ("SELECT zeroblob(1000000000)", "runtime"),
    (b"SELECT 'caf\xe9'", "decode"),
    ("SELECT '\udcff'", "decode"),
    ("", "empty"),
    (" ;\n", "empty"),
    ("SELEC Name FROM singer", "parse"),
    ("SELECT 'unterminated", "parse"),
    ("SELECT Name FROM singer\x00", "parse"),   # a sampled completion held one; sqlite3 raises ValueError
    # Parameter placeholders nothing binds: a sampled completion wrote one (it stopped a reproduction).
    ("SELECT Name FROM singer WHERE Age > ?", "parse"),
    ("SELECT Name FROM singer WHERE Name = :name", "parse"),
    ("SELECT Name FROM singer WHERE Name = @name OR Name = $other", "parse"),
    ("SELECT nope FROM singer", "runtime"),
]


@pytest.mark.parametrize("sql,kind", HOSTILE, ids=[repr(s)[:40] for s, _ in HOSTILE])
def test_hostile_sql_gets_typed_error_in_time_and_leaves_files_alone(db_copy, sql, kind):
    before = fingerprint(db_copy.parent)
    with Executor(db_copy, timeout_s=TIMEOUT_S, max_rows=1000) as executor:
        start = time.monotonic()
        result = executor.execute(sql)
        elapsed = time.monotonic() - start
        assert not result.ok and result.rows == ()
        assert result.error_kind == kind, result.error
        assert elapsed < TIMEOUT_S + 0.5
        assert executor.execute("SELECT count(*) FROM singer").rows == ((6,),)  # still usable
    assert fingerprint(db_copy.parent) == before


def test_gold_queries_match_a_plain_sqlite_connection(spider):
    examples = json.loads((spider / "dev.json").read_text())
    executors = Executors(spider / "database")
    checked = 0
    references = {}
    for example in examples:
        path = executors.db_path(example["db_id"])
        if not path.exists():
            assert executors.execute(example["db_id"], example["query"]).error_kind == "missing_db"
            continue
        if path not in references:
            references[path] = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
            references[path].text_factory = lambda b: b.decode("utf-8", errors="replace")
        reference = references[path]
        result = executors.execute(example["db_id"], example["query"])
        assert result.ok, (example["query"], result.error)
        assert list(result.rows) == reference.execute(example["query"]).fetchall()
        checked += 1
    executors.close()
    assert checked > 900


def _one_value_db(path, value):
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE t (v)")
        connection.execute("INSERT INTO t VALUES (?)", (value,))
    connection.close()


def test_executors_search_folders_in_order_or_ask_a_resolver(tmp_path):
    first, second = tmp_path / "dev_databases", tmp_path / "train_databases"
    _one_value_db(first / "both" / "both.sqlite", "first")
    _one_value_db(second / "both" / "both.sqlite", "second")
    _one_value_db(second / "only" / "only.sqlite", "only")
    with Executors((first, second)) as executors:
        assert executors.execute("both", "SELECT v FROM t").rows == (("first",),)
        assert executors.execute("only", "SELECT v FROM t").rows == (("only",),)
        assert executors.db_path("absent") == first / "absent" / "absent.sqlite"   # reported where it belongs
        assert executors.execute("absent", "SELECT 1").error_kind == "missing_db"
    asked = []
    with Executors(lambda db_id: asked.append(db_id) or second / db_id / f"{db_id}.sqlite") as executors:
        assert executors.execute("both", "SELECT v FROM t").rows == (("second",),)
        assert executors.execute("both", "SELECT v FROM t").rows == (("second",),)   # opened once
    assert asked == ["both"]


def test_cache_hits_on_whitespace_but_not_inside_quotes(db_copy):
    with Executor(db_copy) as executor:
        first = executor.execute("SELECT Name FROM singer WHERE Age > 30")
        assert executor.execute("  SELECT Name\n FROM   singer WHERE Age > 30 ;") is first
        assert executor.execute("SELECT 'a  b'").rows == (("a  b",),)
        assert executor.execute("SELECT 'a b'").rows == (("a b",),)
    assert normalize_sql("SELECT  \"x  y\" ,\t[a  b]  ;") == "SELECT \"x  y\" , [a  b]"


def test_missing_database_is_typed_and_bad_limits_raise(tmp_path):
    executor = Executor(tmp_path / "absent.sqlite")
    assert executor.execute("SELECT 1").error_kind == "missing_db"
    assert not (tmp_path / "absent.sqlite").exists()
    with pytest.raises(ValueError):
        Executor(tmp_path / "absent.sqlite", timeout_s=0)
    with pytest.raises(ValueError):
        Executor(tmp_path / "absent.sqlite", max_vm_steps=0)
    with pytest.raises(TypeError):
        executor.execute(3)


def test_order_matters_follows_the_gold_order_by():
    assert order_matters("SELECT a FROM t ORDER  BY a")
    assert order_matters("select a from t order\nby a desc limit 1")
    assert not order_matters("SELECT a FROM t GROUP BY a")


def ok(*rows):
    return ExecResult(rows=tuple(rows))


@pytest.mark.parametrize("gold,pred,ordered,spider,bird", [
    (ok((1,), (2,)), ok((2,), (1,)), False, True, True),          # bag: order free
    (ok((1,), (2,)), ok((2,), (1,)), True, False, True),          # ORDER BY in gold: order counts
    (ok((1,), (1,), (2,)), ok((1,), (2,), (2,)), False, False, True),  # multiplicity (DISTINCT) counts
    (ok((1,), (2,)), ok((1,), (2,), (2,)), False, False, True),
    (ok((1, "a"), (2, "b")), ok(("a", 1), ("b", 2)), False, True, False),  # column permutation
    (ok((1, "a"), (2, "b")), ok(("b", 2), ("a", 1)), True, False, False),
    (ok((1, 2), (3, 4)), ok((2, 1), (3, 4)), False, False, False),  # permutation must be global
    (ok((1,), (2,)), ok((1.0,), (2.0,)), False, True, True),      # 1 == 1.0, as in Python
    (ok((0.1 + 0.2,)), ok((0.3,)), False, False, False),          # no float tolerance
    (ok(), ok(), True, True, True),
    (ok(), ok((None,)), False, False, False),
    (ok((1, 2)), ok((1,)), False, False, False),
    (ok((None,)), ok((None,)), False, True, True),
])
def test_hand_written_result_pairs(gold, pred, ordered, spider, bird):
    assert results_equal(gold, pred, semantics="spider", ordered=ordered) is spider
    assert results_equal(gold, pred, semantics="bird", ordered=ordered) is bird


def test_failed_executions_are_never_equal_and_semantics_is_checked():
    error = ExecResult(error_kind="timeout", error="interrupted")
    assert not results_equal(error, error, semantics="spider", ordered=False)
    assert not results_equal(ok((1,)), error, semantics="bird", ordered=False)
    with pytest.raises(ValueError):
        results_equal(ok(), ok(), semantics="exact", ordered=False)


def test_spider_equivalence_matches_brute_force_on_random_tables():
    rng = random.Random(0)
    agreements = {True: 0, False: 0}
    for _ in range(3000):
        n_rows, n_cols = rng.randint(0, 4), rng.randint(1, 4)
        gold = tuple(tuple(rng.randint(0, 2) for _ in range(n_cols)) for _ in range(n_rows))
        pred = list(gold)
        action = rng.randrange(4)
        if action == 0 and pred:
            perm = rng.sample(range(n_cols), n_cols)
            pred = [tuple(row[j] for j in perm) for row in pred]
        elif action == 1:
            rng.shuffle(pred)
        elif action == 2 and pred:
            pred[rng.randrange(len(pred))] = tuple(rng.randint(0, 2) for _ in range(n_cols))
        ordered = rng.random() < 0.5
        expected = naive_spider_equal(gold, tuple(pred), ordered)
        assert results_equal(ok(*gold), ok(*pred), semantics="spider", ordered=ordered) is expected
        agreements[expected] += 1
    assert min(agreements.values()) > 300


def test_non_utf8_text_in_the_data_is_decoded_leniently(tmp_path):
    path = tmp_path / "latin.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE t (a TEXT)")
    connection.execute("INSERT INTO t VALUES (CAST(x'636166e9' AS TEXT)), ('ok')")  # latin-1 'café'
    connection.commit()
    connection.close()
    with Executor(path) as executor:
        result = executor.execute("SELECT a FROM t ORDER BY rowid")
        assert result.rows == ((b"caf\xe9".decode("utf-8", errors="replace"),), ("ok",))
        assert executor.execute("SELECT 'plain'").rows == (("plain",),)




def test_closed_executor_raises_instead_of_blaming_the_sql(db_copy):
    executor = Executor(db_copy)
    assert executor.execute("SELECT 1").ok
    executor.close()
    with pytest.raises(RuntimeError, match="closed"):
        executor.execute("SELECT 1")


# -- comments: removed by sqlglot's tokenizer, never by folding text; SQLite's own result is the reference

COMMENTED = [
    "SELECT count(*) FROM singer -- n",                                  # trailing -- comment
    "SELECT count(*)\nFROM singer -- n\n",                               # multi-line, trailing comment
    "SELECT count(*) -- how many\nFROM singer\nWHERE age > 30 -- older\n",  # comments between clauses
    "SELECT count(*) FROM singer; /* c */",                              # comment-only trailer after ;
    "SELECT count(*) FROM singer; -- c",
    "SELECT count(*) FROM singer /* c */;",
    "SELECT count(*) /* a */ FROM /* b */ singer -- c\n;",
    "SELECT count(*)/*x*/FROM singer",                                   # no spaces around the comment
    "SELECT name FROM singer WHERE name = 'Joe Sharp' -- it's a quote\nOR name = 'Rose White'",
    "SELECT name FROM singer /* it's \"quoted\" -- */ WHERE age > 40",     # quotes and -- inside /* */
    "SELECT '--not a comment', '/* nor this */' FROM singer",             # comment markers inside strings
    "SELECT \"--x\" FROM (SELECT 1 AS \"--x\")",                          # ... and inside identifiers
    "SELECT [a--b] FROM (SELECT 2 AS [a--b])",
    "SELECT 2--1",                                                       # -- right after a token
    "SELECT 2/*x*/-1",
    "SELECT count(*) FROM singer /* unterminated: SQLite runs to the end",
    "SELECT 1 -- x\r\n, 2",                                              # CRLF ends a -- comment
    "SELECT name FROM singer WHERE name = 'a /* b' -- c\n OR 1 = 1",
]


@pytest.mark.parametrize("sql", COMMENTED)
def test_comments_are_what_sqlite_says_they_are(db_copy, sql):
    with sqlite3.connect(f"file:{db_copy}?mode=ro", uri=True) as connection:
        expected = connection.execute(sql).fetchall()
    with Executor(db_copy) as executor:
        result = executor.execute(sql)
    assert result.ok, (sql, result)
    assert list(result.rows) == expected
    normalized = normalize_sql(sql)
    assert "--" not in normalized.replace("'--not a comment'", "").replace('"--x"', "").replace("[a--b]", "")


def test_comment_normalisation_keeps_text_and_refuses_what_sqlite_refuses(db_copy):
    assert normalize_sql("SELECT a -- c\nFROM t /* d */ WHERE x = '-- kept'  ;  -- e") == \
        "SELECT a FROM t WHERE x = '-- kept'"
    assert normalize_sql("-- only a comment\n/* and another */") == ""
    with Executor(db_copy) as executor:
        assert executor.execute("-- only a comment").error_kind == "empty"
        assert executor.execute("SELECT 'open -- string").error_kind == "parse"
        assert executor.execute("SELECT 1 /*").error_kind == "parse"          # SQLite: "/" "*" at the end
        assert executor.execute("SELECT 1; SELECT 2 -- two").error_kind == "forbidden"
        # One cache entry for the query with and without its comments.
        assert executor.execute("SELECT count(*) FROM singer -- n") is executor.execute("SELECT count(*) FROM singer")
    assert order_matters("SELECT a FROM t ORDER BY a -- c")
    assert not order_matters("SELECT a FROM t -- ORDER BY a")


def test_trailing_comments_do_not_make_a_second_statement():
    from caper_jax.sql.clauses import split_clauses

    for trailer in ("; /* c */", "; -- c", " -- c", "; -- c\n; /* d */"):
        units = split_clauses("SELECT name FROM singer WHERE age > 30" + trailer)
        assert [u.name for u in units] == ["SELECT", "FROM", "WHERE"]
    with pytest.raises(ValueError, match="expected one statement, got 2"):
        split_clauses("SELECT 1; SELECT 2")


def test_ctrl_c_inside_a_query_raises_keyboard_interrupt_and_is_not_cached(db_copy):
    import signal
    import threading

    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    # Python's own Ctrl-C handler, whatever the suite inherited (a background job of a script starts
    # with SIGINT ignored, and then no KeyboardInterrupt would ever come).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Executor(db_copy, timeout_s=60) as executor:
            timer = threading.Timer(0.5, signal.raise_signal, (signal.SIGINT,))  # delivered to the main thread
            timer.start()
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt, match="SQLite query interrupted"):
                executor.execute(endless)
            assert time.monotonic() - start < 10
            timer.join()
            # A real timeout is still a timeout, and the interrupted query was not cached as anything.
            short = Executor(db_copy, timeout_s=0.2)
            assert short.execute(endless).error_kind == "timeout"
            short.close()
            assert executor.execute("SELECT count(*) FROM singer").rows == ((6,),)
    finally:
        signal.signal(signal.SIGINT, previous)


def sqlite_vm_steps(db_path, sql: str, every: int = 1000) -> int:
    """VM instructions SQLite itself counts for ``sql`` (to within ``every``), on a plain connection."""
    calls = [0]

    def count():
        calls[0] += 1
        return 0
    connection = sqlite3.connect(db_path)
    connection.set_progress_handler(count, every)
    connection.execute(sql).fetchall()
    connection.close()
    return calls[0] * every


def test_instruction_budget_is_exact_and_independent_of_the_wall_clock(db_copy):
    # A recursive CTE whose instruction count SQLite reports; a budget just above it passes, one just
    # below it times out, with a wall-clock limit far away: the verdict is the instruction count's.
    sql = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000) SELECT sum(x) FROM c"
    steps = sqlite_vm_steps(db_copy, sql)
    assert steps > 100_000
    with Executor(db_copy, timeout_s=600, max_vm_steps=steps + 1000, cache_size=0) as executor:
        result = executor.execute(sql)
        assert result.ok and result.rows == ((20000 * 20001 // 2,),)
    with Executor(db_copy, timeout_s=600, max_vm_steps=steps - 2000, cache_size=0) as executor:
        for _ in range(3):   # the same verdict each time: the count restarts with every query
            assert executor.execute(sql).error_kind == "timeout"
        assert executor.execute("SELECT count(*) FROM singer").ok


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    from caper_jax.sql.execution import NotADatabaseError

    (tmp_path / "text.sqlite").write_text("version https://git-lfs.github.com/spec/v1\n")
    (tmp_path / "empty.sqlite").touch()
    for name in ("text.sqlite", "empty.sqlite"):
        with pytest.raises(NotADatabaseError, match="not a SQLite database"):
            Executor(tmp_path / name)


# -- bad-input audit (2026-12-06): limits that disabled themselves, results bounded in bytes, WAL files


def test_a_nan_limit_is_refused_instead_of_disabling_the_deadline(db_copy):
    """``timeout_s <= 0`` let NaN through, and ``monotonic() > start + nan`` is never true: an endless
    query then ran forever (``evaluate ex --timeout_s nan`` hung on the recursive CTE below)."""
    for kwargs in ({"timeout_s": float("nan")}, {"max_rows": float("nan")}, {"max_vm_steps": float("nan")},
                   {"max_result_bytes": float("nan")}, {"max_result_bytes": 0}):
        with pytest.raises(ValueError, match="need timeout_s > 0"):
            Executor(db_copy, **kwargs)


def test_a_result_is_bounded_in_bytes_not_only_in_rows(db_copy):
    """``SELECT zeroblob(16e6) FROM <recursive CTE>`` stays under max_rows while each row holds 16 MiB:
    measured 7.8 GB in 19 s (MemoryError under an 8 GB limit; the OOM killer without one) at evaluate's
    30 s default. A byte budget stops it as too_many_rows once the fetched text/blob bytes pass it."""
    bomb = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT zeroblob(1000000) FROM c"
    with Executor(db_copy, timeout_s=30, max_rows=1_000_000, max_result_bytes=20_000_000) as executor:
        start = time.monotonic()
        result = executor.execute(bomb)
        assert result.error_kind == "too_many_rows" and "bytes" in result.error, result
        assert time.monotonic() - start < 5
        assert executor.execute("SELECT Name FROM singer").ok   # small results are untouched
    assert Executor(db_copy).max_result_bytes is not None     # bounded by default


def test_a_wal_database_is_read_without_creating_files_beside_it(tmp_path):
    """A WAL-mode file made even the mode=ro connection create <db>-wal and <db>-shm next to the data
    (and fail with 'unable to open database file', every gold then 'excluded', in a folder it cannot
    write). It is now opened immutable when no -wal file holds commits not yet in the file."""
    path = tmp_path / "db" / "w.sqlite"
    _one_value_db(path, "v")
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode = WAL").fetchone() == ("wal",)
    connection.close()
    before = fingerprint(path.parent)
    assert sorted(before) == ["w.sqlite"]
    with Executor(path) as executor:
        assert executor.execute("SELECT v FROM t").rows == (("v",),)
        assert executor.execute("DELETE FROM t").error_kind == "forbidden"
    assert fingerprint(path.parent) == before


def test_printf_cannot_outrun_the_deadline(db_copy):
    """printf's "%.Nc" repeats a character N times inside one VM instruction, where no progress handler
    runs: printf('%.*c', 2147483647, 'x') took 8.7 s per row whatever timeout_s and max_vm_steps said
    (26 s for 3 rows under timeout_s=1). Widths and precisions adding up past the value limit are refused;
    every other printf/format call is SQLite's own."""
    reference = sqlite3.connect(":memory:")
    reference.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 16 * 2**20)
    with Executor(db_copy, timeout_s=1, max_vm_steps=1_000_000, cache_size=0) as executor:
        for sql in ["SELECT printf('%.*c', 2147483647 + Singer_ID * 0, 'x') FROM singer LIMIT 3",
                    "SELECT format('%.2147483647c', 'x')", "SELECT printf(x'252e3230303030303030303063', 'x')",
                    "SELECT printf('" + "%.10000000c" * 3 + "', 'x', 'y', 'z')"]:
            start = time.monotonic()
            assert executor.execute(sql).error_kind == "runtime", sql
            assert time.monotonic() - start < 1.5, sql
        for sql in ["SELECT printf('%5.2f|%-6s|%d|%%|%x|%q|%c|%w|%Q', 3.14159, 'ab', 42, 255, 'it''s', 'z', 'a\"b', NULL)",
                    "SELECT printf('%*d|%.*s|%,d|%!.3g|%.*c', 6, 42, 2, 'abcdef', 1234567, 2.5, ' 3x', 'y')",
                    "SELECT format('%s-%s', 1, x'4142')", "SELECT printf(NULL)", "SELECT printf(42)",
                    "SELECT length(printf('%.1000000c', 'x'))"]:
            assert executor.execute(sql).rows == tuple(reference.execute(sql).fetchall()), sql
