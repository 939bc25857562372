"""BIRD's SQL dialect (Li et al., NeurIPS 2023; BIRD dev in ../shared/data/bird_dev, CC BY-SA 4.0).

Every gold query splits into clauses, canonicalises against its schema and executes on an empty
database built from dev_tables.json, checked by SQLite itself; for the six published systems, the
predictions that do not parse are exactly those in bird_dialect_expected.json, each matching the
fault its entry names and refused by SQLite too, so a regression either way fails. Canonical forms
must stay executable where the query itself is, except the listed project faults.
"""
import json
import os
import pathlib
import sqlite3

import pytest

from bench import bird_dialect
from caper_jax.data import bird
from caper_jax.sql.canonical import CanonicalizeError, parse
from caper_jax.sql.execution import Executor
from caper_jax.sql.schema import Schema
from tests.helpers import REPO, require

EXPECTED = json.loads((pathlib.Path(__file__).with_name("bird_dialect_expected.json")).read_text())


def bird_dir() -> pathlib.Path:
    """BIRD dev lives outside the repo (../shared/data/bird_dev, or $CAPER_BIRD_DEV_DIR)."""
    return pathlib.Path(os.environ.get("CAPER_BIRD_DEV_DIR", REPO.parent / "shared" / "data" / "bird_dev"))


@pytest.fixture(scope="module")
def data() -> pathlib.Path:
    for needed in ("dev.json", "dev_tables.json", "predictions/SuperSQL.sql"):
        require(bird_dir() / needed)
    return bird_dir()


@pytest.fixture(scope="module")
def databases(data, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("bird_empty")
    bird.build_empty_databases(data / "dev_tables.json", out)
    return out


@pytest.fixture(scope="module")
def gold_outcomes(data, databases):
    return bird_dialect.survey(data, databases, systems=())


@pytest.fixture(scope="module")
def prediction_outcomes(data, databases):
    return bird_dialect.survey(data, databases, gold=False)


def _flat(keys):
    return [tuple(k) if isinstance(k, list) else (k,) for k in keys]


def test_empty_databases_are_dev_tables_json_as_sqlite_reads_them(data, databases):
    """SQLite's own catalogue of each built file lists dev_tables.json's tables, columns (order,
    spelling, declared type, whose case SQLite does not keep), primary keys (composite ones in key
    order) and foreign keys, and holds no row."""
    entries = json.loads((data / "dev_tables.json").read_text())
    assert len(entries) == 11
    for entry in entries:
        path = bird.database_path(databases, entry["db_id"])
        tables = entry["table_names_original"]
        columns = entry["column_names_original"]
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            assert [n for (n,) in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid")] == tables
            keys = set()
            for t, table in enumerate(tables):
                info = connection.execute("SELECT name, type, pk FROM pragma_table_info(?)", (table,)).fetchall()
                own = [(i, name) for i, (owner, name) in enumerate(columns) if owner == t]
                assert [(n, ty.lower()) for n, ty, _ in info] == [(name, entry["column_types"][i]) for i, name in own]
                key = sorted((pk, n) for n, _, pk in info if pk)
                if key:
                    keys.add(tuple(next(i for i, name in own if name == n) for _, n in key))
                foreign = {(row[3], row[2], row[4]) for row in connection.execute(
                    "SELECT * FROM pragma_foreign_key_list(?)", (table,))}
                assert foreign == {(columns[a][1], tables[columns[b][0]], columns[b][1])
                                   for a, b in entry["foreign_keys"] if columns[a][0] == t}
                quoted = '"' + table.replace('"', '""') + '"'
                assert connection.execute(f"SELECT count(*) FROM {quoted}").fetchone() == (0,)
            assert keys == set(_flat(entry["primary_keys"]))
        finally:
            connection.close()


def test_schema_from_dev_tables_json_equals_the_sqlite_catalogue(data, databases):
    for entry in json.loads((data / "dev_tables.json").read_text()):
        written = Schema.from_spider(entry)
        catalogue = Schema.from_sqlite(bird.database_path(databases, entry["db_id"]), entry["db_id"])
        assert written.tables == catalogue.tables and written.columns == catalogue.columns
        assert set(written.foreign_keys) == set(catalogue.foreign_keys)


def test_builder_quotes_every_name_and_never_overwrites(tmp_path):
    entry = {"db_id": "odd", "table_names_original": ["order", "a b"],
             "column_names_original": [[-1, "*"], [0, "id"], [0, 'say "hi" (%)'], [1, "order"], [1, "x-1"]],
             "column_types": ["text", "integer", "text", "integer", "real"],
             "primary_keys": [1, [3, 4]], "foreign_keys": [[3, 1]]}
    path = bird.build_empty_database(entry, bird.database_path(tmp_path, "odd"))
    with Executor(path) as executor:   # the project's sandboxed executor reads it, BIRD's backquotes too
        result = executor.execute('SELECT T1.`say "hi" (%)`, T2."x-1" FROM `order` AS T1 '
                                  'JOIN "a b" AS T2 ON T1.id = T2."order"')
        assert result.ok and result.rows == () and result.columns == ('say "hi" (%)', "x-1")
    schema = Schema.from_sqlite(path, "odd")
    assert [c.name for c in schema.primary_keys("a b")] == ["order", "x-1"]
    assert [(f.table, f.column, f.ref_table, f.ref_column) for f in schema.foreign_keys] == [
        ("a b", "order", "order", "id")]
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        bird.build_empty_database(entry, path)
    assert path.read_bytes() == before
    for broken in ({**entry, "column_types": ["text"]}, {**entry, "primary_keys": [[1, 3]]},
                   {**entry, "foreign_keys": [[3, 99]]}, {"db_id": "x"}):
        with pytest.raises(bird.SchemaEntryError):
            bird.build_empty_database(broken, tmp_path / "broken.sqlite")
        assert not list(tmp_path.glob("broken*"))   # nothing half-written is left behind


def test_every_gold_splits_canonicalises_and_executes(gold_outcomes):
    assert len(gold_outcomes) == 1534
    assert [o.index for o in gold_outcomes if o.parse_error] == []
    assert [o.index for o in gold_outcomes if not o.qualified] == []      # every column resolved
    assert [(o.index, o.execution_error) for o in gold_outcomes if o.execution_error] == []
    _assert_units_tile(gold_outcomes)
    assert _canonical_failures(gold_outcomes) == _expected_canonical_failures({bird_dialect.GOLD})


def _assert_units_tile(outcomes):
    """split_clauses(nested=True) spans start at their clause's keyword, subquery units included
    (backquoted names, CAST, IIF, … inside them), and the top-level units cover the text but for
    whitespace and a final ';'."""
    for outcome in outcomes:
        if outcome.parse_error:
            continue
        sql, where = outcome.sql, (outcome.source, outcome.index)
        assert outcome.units, where
        for name, start, end, _ in outcome.units:
            assert sql[start:end].split(None, 1)[0].upper() == name.split()[0], where
        position = 0
        for _, start, end, depth in outcome.units:
            if depth == 0:
                assert not sql[position:start].strip(), where
                position = end
        assert sql[position:].strip() in ("", ";"), where


def _canonical_failures(outcomes):
    return {(o.source, o.index + 1) for o in outcomes if o.canonical_error}


def _expected_canonical_failures(sources):
    return {(e["source"], e["line"]) for e in EXPECTED["canonical_forms_not_executable"] if e["source"] in sources}


@pytest.mark.slow   # ~9,200 predictions parsed, canonicalised and executed twice: ~25 s of CPU
def test_prediction_parse_errors_are_the_listed_faults_of_the_predictions(prediction_outcomes):
    systems = {o.source for o in prediction_outcomes}
    assert systems == {"C3_SQL", "DAILSQL", "DAILSQL_SC", "SFT_CodeS_15B_EK", "SFT_CodeS_7B_EK", "SuperSQL"}
    assert len(prediction_outcomes) == 6 * 1534
    failing = {(o.source, o.index + 1): o for o in prediction_outcomes if o.parse_error}
    listed = {(e["system"], e["line"]): e for e in EXPECTED["prediction_parse_errors"]}
    assert sorted(failing) == sorted(listed)
    for key, outcome in failing.items():
        with pytest.raises(CanonicalizeError):   # canonicalize's own parser refuses it as well
            parse(outcome.sql)
        assert bird_dialect.fault_kind(outcome.sql) == listed[key]["kind"], key
        kind = outcome.execution_error.split(":")[0]
        assert kind in ("parse", "forbidden"), (key, outcome.execution_error)   # SQLite refuses it too
    _assert_units_tile(prediction_outcomes)
    assert _canonical_failures(prediction_outcomes) == _expected_canonical_failures(systems)


@pytest.mark.slow   # shares the predictions' survey with the test above
def test_report_prints_each_source_and_every_listed_canonical_failure(gold_outcomes, prediction_outcomes):
    text = bird_dialect.report(gold_outcomes + prediction_outcomes)
    assert "| gold | 1534 | 1534 (100.0 %) | 0 | 0 | 1534 (100.0 %) |" in text
    for entry in EXPECTED["prediction_parse_errors"]:
        assert f"| `{entry['kind']}` |" in text
    for source, line in _expected_canonical_failures({bird_dialect.GOLD} | {o.source for o in prediction_outcomes}):
        assert f"| {source} {line - 1} |" in text


@pytest.mark.parametrize("sql, kind", [
    ("SELECT ```sql SELECT 1 ```", "text_around_sql"),
    ("SELECT 1; SELECT 2", "two_statements"),
    ("SELECT a FROM t WHERE b = 'x\\'s y'", "backslash_quote"),
    ("SELECT a FROM t WHERE b = 'Women's Soccer'", "unescaped_quote"),
    ("SELECT (SELECT a FROM t WHERE SUBSTR(b", "truncated"),
    ("SELECT CASE WHEN a = 1 THEN", "truncated"),
    ("SELECT a FROM t WHERE b = '20", "truncated"),
    ("SELECT a FROM t WHERE T 2.b > 1", "split_token"),
    ("SELECT a FROM t WHERE b > = 1", "split_token"),
    ("SELECT a FROM t WHERE b = 'Women''s Soccer' AND (c = 1", "truncated"),   # a doubled quote is no fault
    ("SELECT a FROM t WHERE b = 'Women''s Soccer' AND c = 1", "unknown"),
])
def test_fault_kinds_by_hand(sql, kind):
    assert bird_dialect.fault_kind(sql) == kind


def test_bench_refuses_a_folder_without_bird_dev(tmp_path, capsys):
    assert bird_dialect.main(["--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "dev.json" in err[0]
