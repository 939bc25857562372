"""Which held-out predictions the PRM's localisation test uses, and with which root clause."""
import json
import sqlite3
import types

from caper_jax.prm.evaluation import PrmEvaluator
from caper_jax.sql.schema import Schema
from caper_jax.sql.tuples import tables_entry

GOLD = "SELECT name FROM person WHERE age > 30 ORDER BY name"


def _world(tmp_path, predictions: list[dict]):
    db_dir = tmp_path / "database" / "club"
    db_dir.mkdir(parents=True)
    path = db_dir / "club.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE person (id INTEGER PRIMARY KEY, name TEXT, age INTEGER)")
        conn.executemany("INSERT INTO person (name, age) VALUES (?, ?)",
                         [("ann", 25), ("bob", 35), ("cid", 45), ("dan", 31)])
    (tmp_path / "tables.json").write_text(json.dumps([tables_entry(Schema.from_sqlite(path, "club"))]))
    (tmp_path / "dev.json").write_text(json.dumps([{"db_id": "club", "question": "q", "query": GOLD}]))
    with (tmp_path / "predictions_dev.jsonl").open("w") as f:
        for p in predictions:
            f.write(json.dumps({"db_id": "club", "question": "q", "gold": GOLD, **p}) + "\n")
    return types.SimpleNamespace(dir=tmp_path, database_dir=tmp_path / "database")


def test_failures_use_the_construction_label_else_the_annotators_root(tmp_path):
    world = _world(tmp_path, [
        {"pred": "SELECT name FROM person WHERE age > 40 ORDER BY name"},             # wrong literal: WHERE
        {"pred": "SELECT name FROM person WHERE age > 30 ORDER BY name DESC"},        # wrong direction: ORDER BY
        {"pred": "SELECT p.name FROM person AS p WHERE 30 < p.age ORDER BY p.name"},  # right (surface only)
        {"pred": "SELECT FROM WHERE"},                                                # does not parse
        {"pred": "SELECT age FROM person WHERE age > 30 ORDER BY name", "true_root_clause": "SELECT"},
    ])
    rows = PrmEvaluator._failures(world, "dev")
    assert [(r["sql"].split(" WHERE ")[1], r["root"]) for r in rows] == [
        ("age > 40 ORDER BY name", "WHERE"),
        ("age > 30 ORDER BY name DESC", "ORDER BY"),
        ("age > 30 ORDER BY name", "SELECT"),
    ]
    assert rows[0]["gold_units"][2] == ("WHERE", "WHERE age > 30")
