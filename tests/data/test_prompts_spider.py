"""Schema serialisation, prompts, and the Spider/BIRD/demo readers (Spider dev via the `spider` fixture)."""
import collections
import json
import logging
import sqlite3

import pytest

from caper_jax.data import spider as readers  # `spider` is the fixture with the data's path
from caper_jax.demo.world import build_demo_world
from caper_jax.sql import contract
from tests.helpers import require

ENTRY = {
    "db_id": "toy",
    "table_names_original": ["people", "pet"],
    "column_names_original": [[-1, "*"], [0, "id"], [0, "Home Town"], [0, "age"], [1, "pet_id"], [1, "owner"],
                              [1, "kind"]],
    "column_types": ["text", "number", "text", "number", "number", "number", "text"],
    "primary_keys": [1, 4],
    "foreign_keys": [[5, 1]],
}


def test_serialize_schema_hand_written():
    assert contract.serialize_schema(ENTRY) == (
        'people(id number PK, "Home Town" text, age number)\n'
        "pet(pet_id number PK, owner number → people.id, kind text)")


def test_serialize_schema_lists_most_frequent_values(tmp_path):
    db = tmp_path / "toy.sqlite"
    conn = sqlite3.connect(db)
    conn.execute('CREATE TABLE people (id INTEGER PRIMARY KEY, "Home Town" TEXT, age INTEGER)')
    conn.execute("CREATE TABLE pet (pet_id INTEGER PRIMARY KEY, owner INTEGER, kind TEXT)")
    towns = ["Oslo", "Lyon", "Oslo", "Turin", "Lyon", "Oslo", None, "O'Hare"]
    conn.executemany("INSERT INTO people VALUES (?, ?, ?)", [(i, t, 30) for i, t in enumerate(towns)])
    conn.executemany("INSERT INTO pet VALUES (?, ?, ?)", [(1, 0, "cat"), (2, 1, "dog"), (3, 2, "cat")])
    conn.commit()
    conn.close()
    text = contract.serialize_schema(ENTRY, max_values=2, db_path=db)
    counts = collections.Counter(t for t in towns if t is not None)
    top = sorted(counts, key=lambda t: (-counts[t], t))[:2]
    assert text == (f"people(id number PK, \"Home Town\" text ('{top[0]}', '{top[1]}'), age number)\n"
                    "pet(pet_id number PK, owner number → people.id, kind text ('cat', 'dog'))")
    assert "'O''Hare'" in contract.serialize_schema(ENTRY, max_values=4, db_path=db)


def test_serialize_schema_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="db_path"):
        contract.serialize_schema(ENTRY, max_values=3)
    with pytest.raises(contract.SchemaError):
        contract.serialize_schema({"db_id": "x", "table_names_original": ["t"]})
    with pytest.raises(contract.SchemaError, match="column types"):
        contract.serialize_schema({**ENTRY, "column_types": ["text"]})
    with pytest.raises(FileNotFoundError):
        contract.serialize_schema(ENTRY, max_values=1, db_path=tmp_path / "absent.sqlite")


def test_prompts_hold_schema_question_and_hint():
    schema = contract.serialize_schema(ENTRY)
    text = contract.policy_prompt("  How many pets?  ", schema)
    assert text == f"<|im_start|>user\n{schema}\nQuestion: How many pets?<|im_end|>\n<|im_start|>assistant\n"
    hinted = contract.policy_prompt("Q?", schema, evidence="pets are animals")
    assert "\nHint: pets are animals<|im_end|>" in hinted
    assert contract.prm_prompt("Q?", schema, "e") == contract.policy_prompt("Q?", schema, "e")
    # the PRM's inputs carry the question as shown (prompt_question): the same prompt, hint included
    assert contract.prm_prompt(contract.prompt_question(" Q? ", " e "), schema) == contract.policy_prompt(
        " Q? ", schema, " e ") == f"<|im_start|>user\n{schema}\nQuestion: Q?\nHint: e<|im_end|>\n<|im_start|>assistant\n"
    assert contract.prompt_question("  Q?  ", "") == "  Q?  "   # no evidence: the split's text, unchanged


def test_prompts_with_the_real_qwen35_tokenizer(qwen35, spider):
    """Qwen3.5's tokenizer reads the prompt's chat markers as its single special tokens (248045, 248046), the
    schema and question between them as text; prompt_batch left-pads with <|endoftext|> (248044) and cuts
    from the left, so the tail every SQL continues (``<|im_start|>assistant\\n``) is always kept."""
    import numpy as np

    from caper_jax.policy.prompts import prompt_batch

    tok, _ = qwen35
    schemas = {db_id: contract.serialize_schema(e) for db_id, e in readers.load_schemas(spider, "dev").items()}
    examples = readers.load_split(spider, "dev")[:40]
    prompts = [contract.policy_prompt(e.question, schemas[e.db_id]) for e in examples]
    tail = tok("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert tail == [248046, 198, 248045, 74455, 198]
    for prompt, ids in zip(prompts, tok(prompts, add_special_tokens=False)["input_ids"]):
        assert ids[0] == 248045 and ids[-5:] == tail and ids.count(248045) == 2 and ids.count(248046) == 1
        assert tok.decode(ids) == prompt
    ids, mask = prompt_batch(prompts, tok, max_prompt_len=96, multiple=32)
    lengths = [len(x) for x in tok(prompts, add_special_tokens=False)["input_ids"]]
    assert ids.shape[1] == min(96, -(-max(lengths) // 32) * 32) and max(lengths) > 96   # some are cut
    for row, n in enumerate(lengths):
        kept = min(n, ids.shape[1])
        assert mask[row].sum() == kept and (ids[row, : ids.shape[1] - kept] == 248044).all()
        full = tok(prompts[row], add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(ids[row, ids.shape[1] - kept:], full[-kept:])


def test_spider_dev_reader(spider, caplog):
    raw = json.loads((spider / "dev.json").read_text())
    with caplog.at_level(logging.WARNING, logger="caper_jax.data.spider"):
        examples = readers.load_split(spider, "dev")
    assert len(examples) == len(raw) == 1034
    assert [(e.db_id, e.question, e.query) for e in examples] == [(r["db_id"], r["question"], r["query"]) for r in raw]
    assert examples[5].index == 5 and "query_toks" in examples[5].meta and examples[5].evidence == ""
    missing = readers.missing_databases(spider, examples)
    expected = {db: n for db, n in collections.Counter(r["db_id"] for r in raw).items()
                if not (spider / "database" / db / f"{db}.sqlite").is_file()}
    assert missing == expected and "wta_1" in missing
    assert "wta_1" in caplog.text
    kept = readers.load_split(spider, "dev", drop_missing=True)
    assert len(kept) == 1034 - sum(missing.values()) and all(e.db_id not in missing for e in kept)


def test_spider_schemas_and_paths(spider):
    schemas = readers.load_schemas(spider)
    raw = json.loads((spider / "tables.json").read_text())
    assert set(schemas) == {e["db_id"] for e in raw}
    for entry in raw:
        text = contract.serialize_schema(schemas[entry["db_id"]])
        assert len(text.splitlines()) == len(entry["table_names_original"])
    path = readers.db_path(spider, "concert_singer")
    tables = {r[0] for r in sqlite3.connect(f"file:{path}?mode=ro", uri=True)
              .execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == set(schemas["concert_singer"]["table_names_original"])
    with pytest.raises(readers.MissingDatabaseError, match="wta_1"):
        readers.db_path(spider, "wta_1")


def test_split_given_as_a_file(spider):
    path = require(spider / "train_no_db" / "train_spider_questions.json")
    examples = readers.load_split(spider, "train_no_db/train_spider_questions.json")
    assert len(examples) == len(json.loads(path.read_text()))


def test_bird_layout(tmp_path):
    (tmp_path / "dev_databases" / "debit").mkdir(parents=True)
    sqlite3.connect(tmp_path / "dev_databases" / "debit" / "debit.sqlite").execute("CREATE TABLE t (a INTEGER)")
    records = [{"question_id": 0, "db_id": "debit", "question": "How many?", "evidence": "count rows",
                "SQL": "SELECT COUNT(*) FROM t", "difficulty": "simple"},
               {"question_id": 1, "db_id": "gone", "question": "Q", "evidence": None, "SQL": "SELECT 1",
                "difficulty": "moderate"}]
    (tmp_path / "dev.json").write_text(json.dumps(records))
    (tmp_path / "dev_tables.json").write_text(json.dumps([{**ENTRY, "db_id": "debit"}]))
    examples = readers.load_split(tmp_path, "dev")
    assert examples[0].query == "SELECT COUNT(*) FROM t" and examples[0].evidence == "count rows"
    assert examples[0].meta == {"question_id": 0, "difficulty": "simple"} and examples[1].evidence == ""
    assert readers.missing_databases(tmp_path, examples) == {"gone": 1}
    assert readers.db_path(tmp_path, "debit").parent.name == "debit"
    assert set(readers.load_schemas(tmp_path)) == {"debit"}


def test_reader_errors(tmp_path):
    with pytest.raises(readers.DataError, match="no 'dev' split"):
        readers.load_split(tmp_path, "dev")
    with pytest.raises(readers.DataError, match="no schema file"):
        readers.load_schemas(tmp_path)
    (tmp_path / "dev.json").write_text(json.dumps([{"db_id": "x", "question": "q"}]))
    with pytest.raises(readers.DataError, match="query/SQL"):
        readers.load_split(tmp_path, "dev")
    (tmp_path / "dev.json").write_text("{not json")
    with pytest.raises(readers.DataError, match="not valid JSON"):
        readers.load_split(tmp_path, "dev")


def test_demo_world_reads_back(tmp_path):
    world = build_demo_world(tmp_path, seed=0, train_size=80, dev_size=20)
    train = readers.load_split(world, "train")
    assert len(train) == len(set(train)) == 80 and all("template_id" in e.meta for e in train)
    assert readers.missing_databases(world, train) == {}
    schemas = readers.load_schemas(world)
    assert len(schemas) == 5
    shop = contract.serialize_schema(schemas["shop"])
    assert "product_id number PK" in shop and "supplier_id number → supplier.supplier_id" in shop

