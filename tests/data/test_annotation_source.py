"""Grain streaming of annotation and the TFDS ArrayRecord build, on a small Spider subset.

References: the Annotator applied record by record (what the stream and the dataset must contain),
SQLite (mutation negatives change the result), and iterator checkpoints (resume = uninterrupted).
"""
import json

import pytest

from caper_jax.data import annotation_source as source
from caper_jax.data import tfds_caper
from caper_jax.sql.execution import Executor, order_matters, results_equal
from caper_jax.sql.mutations import MUTATION_KINDS
from caper_jax.sql.tuples import AnnotationSettings, Annotator, PreferenceTuple

DB = "concert_singer"
SETTINGS = AnnotationSettings(per_query=2)


@pytest.fixture(scope="module")
def manual_dir(spider, tmp_path_factory):
    """Spider layout: 5 dev questions, 2 predictions (one wrong, one right), tables.json, database."""
    root = tmp_path_factory.mktemp("spider_subset")
    dev = [e for e in json.loads((spider / "dev.json").read_text()) if e["db_id"] == DB][:5]
    (root / "dev.json").write_text(json.dumps(dev))
    tables = [e for e in json.loads((spider / "tables.json").read_text()) if e["db_id"] == DB]
    (root / "tables.json").write_text(json.dumps(tables))
    (root / "database" / DB).mkdir(parents=True)
    (root / "database" / DB / f"{DB}.sqlite").symlink_to(spider / "database" / DB / f"{DB}.sqlite")
    predictions = [
        {"db_id": DB, "question": "older than 30", "gold": "SELECT name FROM singer WHERE age > 30",
         "pred": "SELECT name FROM singer WHERE age > 40"},
        {"db_id": DB, "question": "all", "gold": "SELECT count(*) FROM singer", "pred": "SELECT COUNT(*) FROM singer"},
    ]
    (root / "predictions_dev.jsonl").write_text("".join(json.dumps(p) + "\n" for p in predictions))
    return root


@pytest.fixture(scope="module")
def expected(manual_dir):
    annotator = Annotator(manual_dir / "database", SETTINGS, tfds_caper.read_tables(manual_dir))
    per_record = [[t.as_dict() for t in annotator(r).tuples]
                  for r in tfds_caper.read_trajectories(manual_dir, "dev")]
    annotator.close()
    return per_record


def test_trajectories_and_annotation(manual_dir, expected):
    records = tfds_caper.read_trajectories(manual_dir, "dev")
    assert len(records) == 7 and records[5]["pred"] == "SELECT name FROM singer WHERE age > 40"
    # wrong prediction: counterfactual; correct one: nothing (its gold has a question record) ...
    assert [len(x) > 0 for x in expected[5:]] == [True, False]
    assert expected[5][0]["provenance"] == "counterfactual"
    # ... unless asked to mutate its gold
    annotator = Annotator(manual_dir / "database", SETTINGS, mutate_correct=True)
    mutated = annotator(records[6])
    assert mutated.source == "mutation" and mutated.tuples
    kinds = {f"{source}:{k}" for k in MUTATION_KINDS for source in ("mutation", "within")}
    assert {t.provenance for t in mutated.tuples} <= kinds
    annotator.close()
    with Executor(manual_dir / "database" / DB / f"{DB}.sqlite") as executor:
        for tuples in expected:
            for t in tuples:
                assert t["margin"] >= SETTINGS.margin_floor and t["schema"].startswith("stadium(")
                if t["provenance"].startswith("mutation:"):
                    gold, neg = executor.execute(t["gold_sql"]), executor.execute(t["negative_sql"])
                    assert not results_equal(gold, neg, ordered=order_matters(t["gold_sql"]))


def test_stream_equals_record_by_record_annotation_and_resumes(manual_dir, expected):
    tables = tfds_caper.read_tables(manual_dir)
    trajectories = source.trajectory_dataset(manual_dir, "dev")
    ds = source.annotated_dataset(trajectories, manual_dir / "database", SETTINGS, tables=tables)
    stream = list(ds)
    assert stream == [t for tuples in expected for t in tuples]

    it = iter(ds)
    head = [next(it) for _ in range(len(stream) // 2 + 1)]
    state = it.get_state()
    resumed = iter(source.annotated_dataset(trajectories, manual_dir / "database", SETTINGS, tables=tables))
    resumed.set_state(state)
    assert head + list(resumed) == stream

    shards = [list(source.annotated_dataset(trajectories, manual_dir / "database", SETTINGS, tables=tables,
                                            shard_index=i, shard_count=2)) for i in range(2)]
    assert sorted(map(json.dumps, shards[0] + shards[1])) == sorted(map(json.dumps, stream))
    with pytest.raises(ValueError):
        source.annotated_dataset(trajectories, manual_dir / "database", shard_index=2, shard_count=2)


def test_tfds_build_reads_back_without_tensorflow(manual_dir, expected, tmp_path):
    from caper_jax.annotate import AnnotateSettings, run_build
    from caper_jax.settings import from_config
    from configs import annotate as annotate_config
    config = annotate_config.get_config("spider,per_query=2")
    config.data.manual_dir = str(manual_dir)
    config.data_dir = str(tmp_path)
    summary = run_build(from_config(AnnotateSettings, config))["dev"]
    assert summary["trajectories"] == 7
    flat = [t for tuples in expected for t in tuples]
    assert summary["sources"] == {"mutation": 5, "counterfactual": 1, "correct": 1} and summary["errors"] == {}
    assert summary["tuples"] == len(flat)
    assert sum(y["tuples"] for y in summary["yield_by_kind"].values()) == len(flat)

    import sys
    assert "tensorflow" not in sys.modules
    import tensorflow_datasets as tfds
    dataset_dir = next(tmp_path.glob("caper_tuples/spider_*/1.0.0"))
    builder = tfds.builder_from_directory(str(dataset_dir))
    records = source.tuple_source(builder.as_data_source()["dev"])
    got = [records[i] for i in range(len(records))]
    assert all(isinstance(t, PreferenceTuple) for t in got)
    key = lambda t: json.dumps({**t, "margin": round(t["margin"], 5)}, sort_keys=True)  # float32 margins
    assert sorted(key(t.as_dict()) for t in got) == sorted(key(t) for t in flat)


def test_transform_survives_pickling_for_grain_workers(manual_dir, expected):
    import pickle
    transform = source.AnnotateTrajectory(manual_dir / "database", SETTINGS, tfds_caper.read_tables(manual_dir))
    record = tfds_caper.read_trajectories(manual_dir, "dev")[5]
    transform.flat_map(record)                         # opens a database connection
    clone = pickle.loads(pickle.dumps(transform))
    assert clone.flat_map(record) == expected[5]


def test_bird_layout_is_read(tmp_path):
    (tmp_path / "dev.json").write_text(json.dumps([{"db_id": "x", "question": "q", "SQL": "SELECT 1",
                                                    "evidence": "e"}]))
    (tmp_path / "dev_tables.json").write_text(json.dumps([{"db_id": "x", "table_names_original": []}]))
    # the question as the prompts show it: BIRD's evidence on its Hint line (contract.prompt_question)
    assert tfds_caper.read_trajectories(tmp_path, "dev") == [{"question": "q\nHint: e", "db_id": "x", "gold": "SELECT 1"}]
    # without a split every schema file of the layout is merged (caper_jax/data/spider.py)
    assert list(tfds_caper.read_tables(tmp_path, "dev")) == ["x"] == list(tfds_caper.read_tables(tmp_path))
    (tmp_path / "dev_tables.json").unlink()
    assert tfds_caper.read_tables(tmp_path, "dev") == {}   # no schema file: the prompt serialises SQLite's


def test_missing_layout_is_a_typed_error(tmp_path):
    with pytest.raises(tfds_caper.LayoutError):
        tfds_caper.read_trajectories(tmp_path, "dev")
