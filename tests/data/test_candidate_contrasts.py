"""Candidate-level contrasts: a right and a wrong prediction of one question, at the wrong one's root."""
import json
import sqlite3

import pytest

from caper_jax.data import candidate_contrasts as contrasts_lib
from caper_jax.sql.schema import Schema
from caper_jax.sql.tuples import AnnotationSettings, Annotator, tables_entry

GOLD = "SELECT name FROM person WHERE age > 30 ORDER BY name"
RIGHT = "SELECT p.name FROM person AS p WHERE 30 < p.age ORDER BY p.name"       # same result, other surface
WRONG_WHERE = "SELECT name FROM person WHERE age > 40 ORDER BY name"
WRONG_ORDER = "SELECT name FROM person WHERE age > 30 ORDER BY name DESC"


@pytest.fixture()
def world(tmp_path):
    path = tmp_path / "database" / "club" / "club.sqlite"
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE person (id INTEGER PRIMARY KEY, name TEXT, age INTEGER)")
        conn.executemany("INSERT INTO person (name, age) VALUES (?, ?)", [("ann", 25), ("bob", 35), ("cid", 45)])
    (tmp_path / "tables.json").write_text(json.dumps([tables_entry(Schema.from_sqlite(path, "club"))]))
    return tmp_path


def test_contrasts_by_hand(world):
    records = [{"db_id": "club", "question": "q", "gold": GOLD, "pred": p} for p in (WRONG_WHERE, RIGHT, WRONG_ORDER)]
    records += [{"db_id": "club", "question": "only wrong", "gold": GOLD, "pred": WRONG_WHERE},
                {"db_id": "club", "question": "only wrong", "gold": GOLD, "pred": WRONG_ORDER},
                {"db_id": "club", "question": "only right", "gold": GOLD, "pred": RIGHT}]
    annotator = Annotator(world / "database", AnnotationSettings())
    try:
        tuples = contrasts_lib.candidate_contrasts(records, annotator)
    finally:
        annotator.close()
    assert [(t["question"], t["clause"]) for t in tuples] == [("q", "WHERE"), ("q", "ORDER BY")]
    where, order = tuples
    assert (where["prefix_chosen"], where["chosen"]) == ("SELECT p.name FROM person AS p ", "WHERE 30 < p.age")
    assert (where["prefix_rejected"], where["rejected"]) == ("SELECT name FROM person ", "WHERE age > 40")
    assert where["margin"] == pytest.approx(1.0)      # reward 0 (right) - (-alpha) at the root, alpha = 1
    assert where["provenance"] == "candidate" and where["negative_sql"] == WRONG_WHERE
    assert order["chosen"].startswith("ORDER BY p.name") and order["rejected"].startswith("ORDER BY name DESC")


def test_tuples_file_gains_the_contrasts_once(world):
    (world / "predictions_train.jsonl").write_text("".join(
        json.dumps({"db_id": "club", "question": "q", "gold": GOLD, "pred": p}) + "\n" for p in (RIGHT, WRONG_WHERE)))
    base = world / "tuples" / "train-abc.jsonl"
    base.parent.mkdir()
    base.write_text('{"question": "existing"}\n')
    out = contrasts_lib.with_candidate_contrasts(world, (world / "database",), "train", AnnotationSettings(), base)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.name == "train-abc-contrasts.jsonl" and lines[0] == {"question": "existing"}
    assert [t["provenance"] for t in lines[1:]] == ["candidate"]
    assert contrasts_lib.with_candidate_contrasts(world, (world / "database",), "train", AnnotationSettings(), base) == out
