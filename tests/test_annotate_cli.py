"""The annotate command line (localize, tuples, inject) on a Spider database, malformed lines included.

References: SQLite (every negative really changes the result) and the input file itself (every
good line answered in order, every bad one reported by line number).
"""
import json
import subprocess
import sys

import pytest

from caper_jax.sql.execution import Executor, order_matters, results_equal
from tests.helpers import REPO

LOCALIZE_LINES = [
    {"gold": "SELECT name FROM singer WHERE age > 30", "pred": "select Name from singer where Age > 40",
     "question": "Singers older than 30?"},
    {"gold": "SELECT name FROM singer WHERE age > 30", "pred": "SELECT T1.name FROM singer AS T1 WHERE 30 < T1.age"},
    "this line is not JSON",
    {"gold": "SELECT name FROM singer"},                                   # no pred
    ["a", "list"],                                                         # not an object
    {"gold": "SELECT name FROM nowhere_table", "pred": "SELECT 1"},        # gold does not run
    {"gold": "SELECT count(*) FROM singer WHERE country = 'France'", "pred": "SELECT count(*) FROM singer"},
]


def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n\n")


def annotate(*args):
    return subprocess.run([sys.executable, "-m", "caper_jax.annotate", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def db_path(spider):
    return spider / "database" / "concert_singer" / "concert_singer.sqlite"


def test_localize_command(tmp_path, db_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, LOCALIZE_LINES)
    proc = annotate("localize", "--db", db_path, "--input", inp, "--output", out)
    assert proc.returncode == 0, proc.stderr
    for number in (3, 4, 5, 6):
        assert f"in.jsonl:{number}: skipped" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["gold"] for r in rows] == [LOCALIZE_LINES[i]["gold"] for i in (0, 1, 6)]
    assert [(r["correct"], r["root_clause"]) for r in rows] == [(False, "WHERE"), (True, None), (False, "WHERE")]
    assert rows[0]["question"] == "Singers older than 30?"
    assert rows[0]["root_node"] == "40" and rows[0]["clause_rewards"] == {"SELECT": 0.0, "FROM": 0.0, "WHERE": -1.0}
    assert rows[0]["edit_script"] == [{"op": "relabel", "source": "Literal:40", "target": "Literal:30",
                                       "source_sql": "40", "target_sql": "30"}]
    assert rows[2]["root_node"] is None and rows[2]["clause_rewards"]["WHERE"] == -1.0
    assert [r["root_key"] for r in rows] == ["WHERE", None, "WHERE"]


def test_inject_command(tmp_path, db_path):
    golds = ["SELECT name FROM singer WHERE age > 30 ORDER BY age DESC",
             "SELECT T2.name, count(*) FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id "
             "GROUP BY T1.stadium_id"]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"gold": golds[0]}, "{broken", {"gold": golds[1]}, {"gold": 3}])
    proc = annotate("inject", "--db", db_path, "--input", inp, "--output", out, "--per_query", 2)
    assert proc.returncode == 0, proc.stderr
    assert "in.jsonl:2: skipped" in proc.stderr and "in.jsonl:4: skipped" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({r["gold"] for r in rows}) == sorted(golds)
    assert all(sum(r["gold"] == g for r in rows) <= 2 for g in golds)
    with Executor(db_path) as executor:
        for r in rows:
            assert set(r) >= {"gold", "negative", "clause", "mutation", "margin"}
            assert r["margin"] == 1.0 and r["clause"] in ("SELECT", "FROM", "WHERE", "GROUP BY", "ORDER BY")
            gold, negative = executor.execute(r["gold"]), executor.execute(r["negative"])
            assert negative.ok and not results_equal(gold, negative, ordered=order_matters(r["gold"]))


TUPLE_LINES = [
    {"gold": "SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id",
     "pred": "SELECT T1.name FROM singer AS T1, singer_in_concert AS T2 WHERE T1.age = T2.singer_id",
     "question": "Names of singers in concerts?"},
    {"gold": "SELECT name FROM singer WHERE age > 30", "pred": "SELECT T1.name FROM singer AS T1 WHERE 30 < T1.age"},
    "{not json",
    {"gold": "SELECT name FROM singer"},                                    # no pred
    {"gold": "SELECT name FROM nowhere_table", "pred": "SELECT 1"},         # gold does not run
    {"gold": "SELECT name, age FROM singer ORDER BY age", "pred": "SELECT name, CAST(age AS TEXT) FROM singer ORDER BY age"},
    {"gold": "SELECT name FROM singer WHERE age > 30", "pred": "SELECT name FROM singer WHERE age > 40"},
]


def test_tuples_command(tmp_path, db_path):
    from caper_jax.sql import invariants
    from caper_jax.sql.contract import END_OF_SQL
    from caper_jax.sql.tuples import PreferenceTuple
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, TUPLE_LINES)
    proc = annotate("tuples", "--db", db_path, "--input", inp, "--output", out)
    assert proc.returncode == 0, proc.stderr
    for number in (3, 4, 5):
        assert f"in.jsonl:{number}: skipped" in proc.stderr
    assert "in.jsonl:2: no pairs (correct)" in proc.stderr and "in.jsonl:6: no pairs (suspect:type)" in proc.stderr
    assert "dropped pairs by reason: {}" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({r["line"] for r in rows}) == [1, 7]
    fields = set(PreferenceTuple.__dataclass_fields__)
    with Executor(db_path) as executor:
        for r in rows:
            assert set(r) == fields | {"line", "positive_sql", "dropped"} and r["dropped"] is None
            line = TUPLE_LINES[r["line"] - 1]
            assert (r["gold_sql"], r["negative_sql"], r["question"]) == (line["gold"], line["pred"],
                                                                        line.get("question", ""))
            within = r["provenance"].startswith("within")
            # The chosen state is cut from positive_sql: the prediction itself, or a repaired query
            # that returns gold's rows (SQLite is the reference).
            assert invariants.is_state_of(r["positive_sql"], r["prefix_chosen"], r["chosen"])
            assert invariants.is_state_of(r["negative_sql"], r["prefix_rejected"], r["rejected"])
            if within:
                assert r["positive_sql"] == r["negative_sql"]
            else:
                assert results_equal(executor.execute(r["gold_sql"]), executor.execute(r["positive_sql"]),
                                     ordered=order_matters(r["gold_sql"]))
    # The comma join: every pair rejects the WHERE it wrote, none prefers it.
    first = [r for r in rows if r["line"] == 1]
    assert [(r["provenance"], r["clause"], r["rejected"]) for r in first] == [
        ("counterfactual", "WHERE", "WHERE T1.age = T2.singer_id" + END_OF_SQL),
        ("within:counterfactual", "WHERE", "WHERE T1.age = T2.singer_id" + END_OF_SQL),
        ("within:counterfactual", "WHERE", "WHERE T1.age = T2.singer_id" + END_OF_SQL)]
    assert first[0]["question"] == "Names of singers in concerts?"


def test_tuples_command_skips_bad_bytes_and_surrogates_by_line(tmp_path, db_path):
    good = json.dumps(TUPLE_LINES[-1]).encode()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join([good, b'{"gold": "SELECT 1", "pred": "SELECT \xff"}',
                                  b'{"gold": "SELECT 1", "pred": "\\ud800"}', b'{"gold": 1, "pred": "x"}', good]) + b"\n")
    proc = annotate("tuples", "--db", db_path, "--input", inp, "--output", out)
    assert proc.returncode == 0, proc.stderr
    assert all(f"in.jsonl:{n}: skipped" in proc.stderr for n in (2, 3, 4)), proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["line"] for r in rows} == {1, 5} and len(rows) % 2 == 0
    assert [r for r in rows if r["line"] == 1] == [{**r, "line": 1} for r in rows if r["line"] == 5]


def test_tuples_command_shows_dropped_pairs(tmp_path, db_path):
    # Reference edges on: the FROM pair of a wrong SELECT column compares the same FROM text; the
    # command shows it with its reason instead of hiding it.
    config = tmp_path / "edges.py"
    config.write_text("from configs.annotate import get_config as base\n\n"
                      "def get_config(arg=None):\n    c = base(arg)\n    c.reference_edges = True\n    return c\n")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"gold": "SELECT name FROM singer WHERE age > 30", "pred": "SELECT country FROM singer WHERE age > 30"}])
    proc = annotate("tuples", "--db", db_path, "--input", inp, "--output", out, f"--config={config}")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    dropped = [(r["clause"], r["chosen"], r["rejected"], r["dropped"]) for r in rows if r["dropped"]]
    assert dropped == [("FROM", "FROM singer", "FROM singer", "equal_clause_texts")]
    assert "dropped pairs by reason: {'equal_clause_texts': 1}" in proc.stderr


def test_tuples_command_refuses_bad_files(tmp_path, db_path):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, TUPLE_LINES[:1])
    not_db = tmp_path / "x.sqlite"
    not_db.write_text("not a database")
    for args in (("--db", tmp_path / "none.sqlite", "--input", inp, "--output", tmp_path / "o.jsonl"),
                 ("--db", not_db, "--input", inp, "--output", tmp_path / "o.jsonl"),
                 ("--db", db_path, "--input", tmp_path / "missing.jsonl", "--output", tmp_path / "o.jsonl"),
                 ("--db", db_path, "--input", inp, "--output", inp),
                 ("--db", db_path, "--input", inp)):
        proc = annotate("tuples", *args)
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), (args, proc.returncode, proc.stderr)
        assert proc.stderr.count("\n") <= 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_usage_errors_exit_nonzero(tmp_path, db_path):
    assert annotate("localize", "--db", db_path, "--input", tmp_path / "missing.jsonl",
                    "--output", tmp_path / "o.jsonl").returncode != 0
    assert annotate("frobnicate").returncode != 0


def test_annotation_never_imports_jax():
    code = ("import sys, caper_jax.annotate, caper_jax.sql.tuples, caper_jax.sql.localize, "
            "caper_jax.data.tfds_caper; "
            "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules), 'jax imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_config_defaults_match_settings_and_variants():
    from caper_jax.annotate import AnnotateSettings
    from caper_jax.settings import from_config
    from caper_jax.sql.tuples import AnnotationSettings
    from configs import annotate as annotate_config

    def settings_from_config(config):
        return from_config(AnnotateSettings, config).annotation

    assert settings_from_config(annotate_config.get_config()) == AnnotationSettings()
    demo = annotate_config.get_config("demo,limit=5,per_query=2")
    assert (demo.name, tuple(demo.data.splits), demo.data.limit, demo.per_query) == ("demo", ("train", "dev"), 5, 2)
    bird = annotate_config.get_config("bird")
    # database folders come from the layout reader (caper_jax/data/spider.py), BIRD's included
    assert (bird.semantics, bird.max_vm_steps, bird.data.database_dir) == ("bird", 1_000_000_000, "")
    assert settings_from_config(bird).max_vm_steps == 1_000_000_000
    with pytest.raises(KeyError):
        annotate_config.get_config("sigmaa=2")
    with pytest.raises(ValueError):
        annotate_config.get_config("spider,demo")
    bad = annotate_config.get_config()
    bad.margin_floor = 2.0          # above alpha: no tuple could ever pass
    with pytest.raises(ValueError):
        settings_from_config(bad)
