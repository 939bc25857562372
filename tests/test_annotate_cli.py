"""The annotate command line (localize, inject) on a Spider database, malformed lines included.

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
    from caper_jax.annotate import settings_from_config
    from caper_jax.sql.tuples import AnnotationSettings
    from configs import annotate as annotate_config
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
