"""One reader for the Spider and BIRD layouts (caper_jax/data/spider.py), and every consumer going through it.

Two fixtures are built in tmp_path from the files in ../shared/data/spider: a Spider layout
(dev.json, train_spider.json + train_others.json, tables.json, database/) and the same questions in
BIRD's layout (dev.json, dev_tables.json, dev_databases/; train/train.json, train/train_tables.json,
train_databases/; gold SQL under "SQL", an "evidence" key). The consumers checked: the TFDS/Grain
annotation readers (tfds_caper), the trainers' world (data/data_world.py), SFT/GRPO examples (sft/data.py),
PRM annotation (prm/trainer.annotate_split) and evaluate ex.
"""
import json
import shutil

import pytest

from caper_jax.data import spider as readers
from caper_jax.data import tfds_caper
from tests.helpers import require

DEV_DBS = ("concert_singer", "pets_1")
TRAIN_DB = "department_management"     # train_spider
OTHERS_DB = "geo"                      # train_others
N_DEV, N_TRAIN, N_OTHERS = 4, 5, 3


def _records(spider):
    every = json.loads(require(spider / "dev.json").read_text())
    dev = [e for db in DEV_DBS for e in [e for e in every if e["db_id"] == db][: N_DEV // len(DEV_DBS)]]
    train = json.loads(require(spider / "train_no_db" / "train_spider_questions.json").read_text())
    train = [{"db_id": e["db_id"], "question": e["question"], "query": e["query"]}
             for e in train if e["db_id"] == TRAIN_DB][:N_TRAIN]
    others = [line.rsplit("\t", 1) for line in (spider / "train_no_db" / "train_gold.sql").read_text().splitlines()]
    others = [{"db_id": db, "question": f"geo question {i}", "query": sql}
              for i, (sql, db) in enumerate(o for o in others if o[1] == OTHERS_DB)][:N_OTHERS]
    tables = {t["db_id"]: t for t in json.loads((spider / "tables.json").read_text())}
    return dev, train, others, tables


def _copy_db(spider, db_id, folder):
    shutil.copytree(require(spider / "database" / db_id), folder / db_id,
                    ignore=shutil.ignore_patterns("*.sql", "*.csv"))


@pytest.fixture(scope="module")
def layouts(spider, tmp_path_factory):
    dev, train, others, tables = _records(spider)
    root = tmp_path_factory.mktemp("layouts")
    s = root / "spider"
    for db in (*DEV_DBS, TRAIN_DB, OTHERS_DB):
        _copy_db(spider, db, s / "database")
    (s / "dev.json").write_text(json.dumps(dev))
    (s / "train_spider.json").write_text(json.dumps(train))
    (s / "train_others.json").write_text(json.dumps(others))
    (s / "tables.json").write_text(json.dumps([tables[db] for db in (*DEV_DBS, TRAIN_DB, OTHERS_DB)]))

    b = root / "bird"
    (b / "train").mkdir(parents=True)
    for db in DEV_DBS:
        _copy_db(spider, db, b / "dev_databases")
    for db in (TRAIN_DB, OTHERS_DB):
        _copy_db(spider, db, b / "train_databases")
    bird = lambda records, tag: [{"db_id": e["db_id"], "question": e["question"], "SQL": e["query"],  # noqa: E731
                                  "evidence": f"{tag} hint {i}"} for i, e in enumerate(records)]
    (b / "dev.json").write_text(json.dumps(bird(dev, "dev")))
    (b / "dev_tables.json").write_text(json.dumps([tables[db] for db in DEV_DBS]))
    (b / "train" / "train.json").write_text(json.dumps(bird(train + others, "train")))
    (b / "train" / "train_tables.json").write_text(json.dumps([tables[db] for db in (TRAIN_DB, OTHERS_DB)]))
    return s, b, (dev, train, others)


def test_spider_layout_questions_schemas_and_databases(layouts):
    s, _, (dev, train, others) = layouts
    assert [p.name for p in readers.split_files(s, "train")] == ["train_spider.json", "train_others.json"]
    examples = readers.load_split(s, "train")
    assert [e.query for e in examples] == [e["query"] for e in train + others]
    assert [e.index for e in examples] == list(range(N_TRAIN + N_OTHERS))
    assert [e.query for e in readers.load_split(s, "dev")] == [e["query"] for e in dev]
    assert readers.database_dirs(s) == readers.database_dirs(s, "train") == (s / "database",)
    assert readers.db_path(s, OTHERS_DB, "train") == s / "database" / OTHERS_DB / f"{OTHERS_DB}.sqlite"
    assert set(readers.load_schemas(s, "dev")) == {*DEV_DBS, TRAIN_DB, OTHERS_DB}


def test_bird_layout_questions_schemas_and_databases(layouts):
    _, b, (dev, train, others) = layouts
    assert readers.split_files(b, "train") == [b / "train" / "train.json"]
    train_examples = readers.load_split(b, "train")
    assert [e.query for e in train_examples] == [e["query"] for e in train + others]
    assert train_examples[0].evidence == "train hint 0" and "SQL" not in train_examples[0].meta
    assert [e.evidence for e in readers.load_split(b, "dev")] == [f"dev hint {i}" for i in range(len(dev))]
    # both database folders, the split's own first; a training database is found from the root
    assert readers.database_dirs(b) == (b / "dev_databases", b / "train_databases")
    assert readers.database_dirs(b, "train") == (b / "train_databases", b / "dev_databases")
    assert readers.db_path(b, TRAIN_DB, "train").parent.parent == b / "train_databases"
    assert readers.db_path(b, TRAIN_DB).parent.parent == b / "train_databases"
    assert readers.db_path(b, DEV_DBS[0], "dev").parent.parent == b / "dev_databases"
    assert readers.missing_databases(b, train_examples, "train") == {}
    with pytest.raises(readers.MissingDatabaseError, match="train_databases"):
        readers.db_path(b, "no_such_db", "train")
    assert set(readers.load_schemas(b, "train")) == {*DEV_DBS, TRAIN_DB, OTHERS_DB}
    assert readers.schema_files(b, "train")[0] == b / "train" / "train_tables.json"
    assert readers.schema_files(b, "dev")[0] == b / "dev_tables.json"


def test_bird_dev_folder_arrangement(layouts, tmp_path):
    """BIRD's download unpacks dev as dev/dev.json, dev/dev_tables.json, dev/dev_databases/."""
    _, b, _ = layouts
    root = tmp_path / "bird"
    shutil.copytree(b / "dev_databases", root / "dev" / "dev_databases")
    shutil.copy(b / "dev.json", root / "dev" / "dev.json")
    shutil.copy(b / "dev_tables.json", root / "dev" / "dev_tables.json")
    assert readers.split_files(root, "dev") == [root / "dev" / "dev.json"]
    assert readers.database_dirs(root, "dev") == (root / "dev" / "dev_databases",)
    assert set(readers.load_schemas(root, "dev")) == set(DEV_DBS)
    assert readers.missing_databases(root, readers.load_split(root, "dev"), "dev") == {}


@pytest.mark.parametrize("layout", ["spider", "bird"])
def test_annotation_readers_read_train_others_and_bird_train(layouts, layout):
    s, b, (dev, train, others) = layouts
    root = s if layout == "spider" else b
    trajectories = tfds_caper.read_trajectories(root, "train")
    assert [t["gold"] for t in trajectories] == [e["query"] for e in train + others]   # train_others too
    # questions as the prompts show them: BIRD's evidence on a Hint line, Spider's as written
    hints = [f"\nHint: train hint {i}" if layout == "bird" else "" for i in range(len(train + others))]
    assert [t["question"] for t in trajectories] == [
        (e["question"].strip() if hint else e["question"]) + hint for e, hint in zip(train + others, hints)]
    assert set(tfds_caper.read_tables(root, "train")) >= {TRAIN_DB, OTHERS_DB}
    dirs = tfds_caper.database_dirs(root, "train")
    assert all((d / TRAIN_DB).is_dir() for d in dirs[:1])
    # an explicit folder still wins ("{split}" replaced)
    assert tfds_caper.database_dirs(root, "train", "{split}_x") == (root / "train_x",)


@pytest.mark.parametrize("layout", ["spider", "bird"])
def test_world_sft_examples_and_prm_annotation_find_every_database(layouts, layout, tmp_path):
    """The trainers' world lists every database folder; SFT examples, executors and the PRM's
    annotation of the train split (train_others and BIRD's train_databases included) use it."""
    import ml_collections

    from caper_jax.data.tokenizer import build_demo_tokenizer
    from caper_jax.data.data_world import prepare_world
    from caper_jax.prm.trainer import annotate_split
    from caper_jax.sft.data import examples_from_split
    from caper_jax.sql.execution import Executors
    from caper_jax.sql.tuples import AnnotationSettings

    s, b, (dev, train, others) = layouts
    root = s if layout == "spider" else b
    build_demo_tokenizer(tmp_path / "tok")
    config = ml_collections.ConfigDict({"data": {"kind": "spider", "dir": str(root)},
                                        "model": {"tokenizer_dir": str(tmp_path / "tok"), "hf_dir": ""}})
    world = prepare_world(config, tmp_path / "w")
    expected = (root / "database",) if layout == "spider" else (root / "dev_databases", root / "train_databases")
    assert world.database_dir == expected
    assert world.db_path(TRAIN_DB, "train").is_file() and world.db_path(DEV_DBS[0], "dev").is_file()

    train_examples = examples_from_split(world.dir, "train")
    assert [e.sql for e in train_examples] == [e["query"] for e in train + others]
    assert train_examples[0].evidence == ("" if layout == "spider" else "train hint 0")
    with Executors(world.database_dir) as executors:
        for ex in [*train_examples, *examples_from_split(world.dir, "dev")]:
            assert executors.execute(ex.db_id, ex.sql).ok, ex

    path = annotate_split(world, "train", AnnotationSettings(per_query=2, semantics="bird"), tmp_path / "tuples")
    tuples = [json.loads(line) for line in path.read_text().splitlines()]
    assert tuples and {t["db_id"] for t in tuples} <= {TRAIN_DB, OTHERS_DB}
    assert TRAIN_DB in {t["db_id"] for t in tuples}   # its database was found (BIRD: train_databases/)
    # The PRM reads the prompt the policy wrote in: BIRD's evidence is the question's Hint line (GRPO's
    # PRM scores the policy's own prompt + completion).
    from caper_jax.sql.contract import policy_prompt, prm_prompt

    policy_prompts = {policy_prompt(e.question, t["schema"], e.evidence) for t in tuples[:1] for e in train_examples
                      if e.db_id == t["db_id"]}
    assert prm_prompt(tuples[0]["question"], tuples[0]["schema"]) in policy_prompts
    assert all(("\nHint: train hint " in t["question"]) == (layout == "bird") for t in tuples)


def test_prm_config_has_a_validated_annotation_semantics():
    from caper_jax.prm.settings import PrmSettings
    from caper_jax.settings import from_config
    from configs import prm as prm_config

    def annotation_settings(config):
        return from_config(PrmSettings, config).annotation

    config = prm_config.get_config()
    assert config.annotate.semantics == "spider" and annotation_settings(config).semantics == "spider"
    config.annotate.semantics = "bird"
    assert annotation_settings(config).semantics == "bird"
    config.annotate.semantics = "sets"
    with pytest.raises(ValueError, match="annotate.semantics='sets'"):
        annotation_settings(config)


def test_evaluate_ex_on_the_bird_fixture_reads_sql_keys_and_both_folders(layouts, tmp_path):
    from caper_jax.eval.ex import evaluate_ex

    _, b, (dev, train, others) = layouts
    for split, records in (("dev", dev), ("train", train + others)):
        predictions = tmp_path / f"{split}.jsonl"
        predictions.write_text("".join(json.dumps({"index": i, "pred": e["query"]}) + "\n"
                                       for i, e in enumerate(records)))
        summary = evaluate_ex(b, split, predictions, semantics="bird", report=lambda message: None)
        assert summary == {"ex": 1.0, "n": len(records), "excluded": {}, "malformed": 0}


def test_a_bad_predictions_line_is_skipped_with_its_number(tmp_path, caplog):
    from caper_jax.data.tfds_caper import read_trajectories

    (tmp_path / "dev.json").write_text(json.dumps([{"question": "q", "db_id": "d", "query": "SELECT 1"}]))
    good = {"question": "q", "db_id": "d", "gold": "SELECT 1", "pred": "SELECT 2"}
    (tmp_path / "predictions_dev.jsonl").write_bytes(
        b"{not json\n" + json.dumps(good).encode() + b'\n"\\ud800"\n[1]\n\xff\xfe\n')
    with caplog.at_level("WARNING", logger="caper_jax"):
        got = read_trajectories(tmp_path, "dev")
    assert got == [{"question": "q", "db_id": "d", "gold": "SELECT 1"}, good]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert [m.split(" line ")[1].split(" ")[0] for m in skipped] == ["1", "3", "4", "5"]


def test_bird_evidence_reaches_the_prm_rows_of_verify_and_of_predictions_lines(layouts, tmp_path):
    """verify localize's rows and the annotator's predictions lines carry the question as the prompts show
    it: a line's own evidence, else its question's from the split."""
    from caper_jax.eval.verifier import read_failures

    _, b, (dev, _, _) = layouts
    wrong = [{"index": i, "pred": "SELECT 1"} for i in range(len(dev))]
    predictions = tmp_path / "p.jsonl"
    predictions.write_text("".join(json.dumps(r) + "\n" for r in wrong))
    rows, _ = read_failures(b, "dev", predictions, report=lambda message: None)
    for row in rows:
        i = int(row["question"].rsplit("\nHint: dev hint ", 1)[1])
        assert row["question"] == dev[i]["question"].strip() + f"\nHint: dev hint {i}"
    assert rows

    shown = readers.ShownQuestions(readers.load_split(b, "dev"))
    first = {"db_id": dev[0]["db_id"], "question": dev[0]["question"]}
    assert shown(first) == dev[0]["question"].strip() + "\nHint: dev hint 0"
    assert shown({**first, "evidence": "its own"}) == dev[0]["question"].strip() + "\nHint: its own"
    assert shown({"db_id": "other", "question": " q "}) == " q "   # no evidence: as written
