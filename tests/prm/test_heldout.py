"""Which held-out predictions the PRM's localisation test uses, and with which root clause."""
import json
import sqlite3
import types

import numpy as np
import pytest

from caper_jax.prm.heldout import PrmEvaluator, localization_summaries
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


def test_gold_free_baselines_come_from_the_prediction_lines(tmp_path):
    samples = ["SELECT name FROM person WHERE age > 40 ORDER BY name",
               "SELECT p.name FROM person AS p WHERE p.age > 30 ORDER BY p.name",   # same clauses, other surface
               "SELECT name FROM person WHERE age > 30 ORDER BY name"]
    world = _world(tmp_path, [
        {"pred": samples[0], "samples": samples, "clause_logprob": [-0.1, -0.2, -2.0, -0.3]},
        {"pred": "SELECT name FROM person WHERE age > 30 ORDER BY name DESC", "samples": samples,
         "clause_logprob": [-0.1, -3.0, -0.2, -0.4]},
    ])
    rows = PrmEvaluator._failures(world, "dev")
    assert [r["root"] for r in rows] == ["WHERE", "ORDER BY"]
    # WHERE age > 40 is written by 1 of the 3 samples; the aliased sample has the same canonical clauses
    # as the gold-shaped one, so SELECT/FROM/ORDER BY agree in all 3.
    from caper_jax.prm import localization as loc
    assert loc.disagreement_scores(rows[0]["pred_forms"], rows[0]["sample_forms"]) == (1.0, 1.0, 1 / 3, 1.0)
    assert loc.disagreement_scores(rows[1]["pred_forms"], rows[1]["sample_forms"]) == (1.0, 1.0, 2 / 3, 0.0)
    prm = [np.array([0.0, 0.0, -1.0, 0.0]), np.array([0.0, -1.0, 0.0, 0.0])]   # right, then wrong (FROM)
    summaries = localization_summaries(rows, prm)
    assert set(summaries) == {"prm", "heuristic", "random", "execution", "confidence", "disagreement"}
    assert summaries["heuristic"]["sees_gold"] and not summaries["disagreement"]["sees_gold"]
    # Row 2: FROM below the true ORDER BY, which ties with SELECT and WHERE: rank 2, 3 or 4.
    assert summaries["prm"]["top1"] == 0.5
    assert summaries["prm"]["mrr"] == pytest.approx((1 + (1 / 2 + 1 / 3 + 1 / 4) / 3) / 2)
    # confidence: WHERE least sure in row 1 (right); in row 2 FROM (-3.0) is below ORDER BY (-0.4): rank 2.
    assert summaries["confidence"]["top1"] == 0.5 and summaries["confidence"]["mrr"] == pytest.approx(0.75)
    assert summaries["disagreement"]["top1"] == 1.0
    # Without the fields on every line, those baselines are left out rather than computed on a subset.
    rows[1].pop("clause_logprob")
    assert "confidence" not in localization_summaries(rows, prm)


def test_verify_localize_reads_the_baseline_inputs_too(tmp_path):
    from caper_jax.eval import verifier

    samples = ["SELECT name FROM person WHERE age > 40 ORDER BY name", GOLD]
    world = _world(tmp_path, [{"pred": samples[0], "samples": samples, "clause_logprob": [-0.1, -0.2, -2.0, -0.3]},
                              {"pred": "SELECT name FROM person WHERE age > 30 ORDER BY name DESC"}])
    rows, skipped = verifier.read_failures(world.dir, "dev", world.dir / "predictions_dev.jsonl", report=lambda m: None)
    assert skipped == {} and [r["root"] for r in rows] == ["WHERE", "ORDER BY"]
    assert rows[0]["clause_logprob"] == [-0.1, -0.2, -2.0, -0.3] and len(rows[0]["sample_forms"]) == 2
    assert "clause_logprob" not in rows[1] and "sample_forms" not in rows[1]


def test_a_prm_run_stopped_before_its_end_writes_no_results_json(tmp_path, monkeypatch):
    """results.json marks a stage done (caper_jax.experiments.stages.completion): the HF export and the rest of the
    report come before it."""
    from ml_collections import ConfigDict

    from caper_jax.prm import heldout
    from caper_jax.prm import trainer as prm_trainer

    class Stopped(Exception):
        pass

    def stopped(*args, **kwargs):
        raise Stopped("stopped")

    results = {"metrics": {"eval/pair_accuracy": 0.5}, "n_eval_tuples": 2, "n_failures": 0, "localization": {}}
    monkeypatch.setattr(prm_trainer, "export_prm_to_hf", stopped)
    with pytest.raises(Stopped):
        prm_trainer.write_outputs(ConfigDict({"export_hf": True, "export_dtype": "float32"}), tmp_path, results, None,
                                  None, main=True)
    assert not (tmp_path / "results.json").exists()
    monkeypatch.setattr(heldout, "localization_table", stopped)
    with pytest.raises(Stopped):
        heldout.write_report(results, tmp_path)
    assert not (tmp_path / "results.json").exists()
