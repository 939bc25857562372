"""The built-in demo text-to-SQL world: five small databases, templated questions, imperfect predictions.

Everything downstream (annotation, Clause-PRM training, SFT, GRPO, evaluation) can run on it on a
fresh machine with no downloads. ``build_demo_world`` writes the Spider layout, so the same readers
(caper_jax.data.spider) serve the demo world, Spider and BIRD:

    out_dir/train.json, dev.json        [{db_id, question, query, template_id, paraphrase_id}, ...]
    out_dir/tables.json                 Spider schema records
    out_dir/database/<db>/<db>.sqlite
    out_dir/predictions_{train,dev}.jsonl
    out_dir/manifest.json               build settings and counts (written last)

Split rule (docs/demo_world.md): template number ``i`` (in ``TEMPLATES`` order) is held out on
database ``DB_IDS[i % 5]`` — dev questions are exactly those (template, database) pairs, train
questions all the others — and every literal pool is cut into a dev part and a train part, so a dev
question is a template seen in training, on a database where it was not seen, with literal values
not seen in that column. The build is a pure function of its arguments: the same seed gives the
same bytes.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import random
import re
import sqlite3

from caper_jax.demo import predictions as preds
from caper_jax.demo.schemas import DemoSchema, create_table_sql, demo_schemas, generate_rows, tables_json_entry
from caper_jax.demo.templates import SPLITS, TEMPLATES, NoValue, Slots, Template, ValuePools

DEFAULT_TRAIN_SIZE = 1500
DEFAULT_DEV_SIZE = 300
BUILD_VERSION = 7  # bump when the generator changes, so cached builds are rebuilt
_A_BEFORE_VOWEL = re.compile(r"\b([Aa]) (?=[AEIOUaeiou])")  # templates write "a {noun}"; "an airline"
_MAX_CONSECUTIVE_FAILURES = 40  # a (template, database) pair is retired after this many misses in a row


@dataclasses.dataclass
class Database:
    schema: DemoSchema
    conn: sqlite3.Connection  # in-memory; written to disk with the backup API
    pools: ValuePools


def open_databases(seed: int) -> dict[str, Database]:
    """Builds every demo database in memory, rows drawn from ``seed``."""
    databases = {}
    for schema in demo_schemas():
        conn = sqlite3.connect(":memory:")
        rows = generate_rows(schema, random.Random(f"{seed}:{schema.db_id}:rows"))
        for table in schema.tables:
            conn.execute(create_table_sql(table))
            marks = ", ".join("?" * len(table.columns))
            conn.executemany(f"INSERT INTO {table.name} VALUES ({marks})", rows[table.name])
        conn.commit()
        databases[schema.db_id] = Database(schema, conn, ValuePools(conn, schema.db_id, seed))
    return databases


def dev_database(template_index: int, db_ids: list[str]) -> str:
    """The one database on which a template is held out for dev."""
    return db_ids[template_index % len(db_ids)]


def split_pairs(db_ids: list[str], split: str) -> list[tuple[Template, str]]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [(t, db) for i, t in enumerate(TEMPLATES) for db in db_ids
            if (db == dev_database(i, db_ids)) == (split == "dev")]


def generate_examples(databases: dict[str, Database], seed: int, split: str, size: int) -> list[dict]:
    """``size`` distinct questions of one split, drawn round-robin over its (template, database) pairs.

    Round-robin keeps every pair about equally frequent; a pair that keeps producing duplicates,
    empty results or tied orderings (a template with few slots) is retired and the others fill in.
    """
    pairs = split_pairs(list(databases), split)
    rng = random.Random(f"{seed}:{split}:questions")
    active = list(range(len(pairs)))
    misses: collections.Counter[int] = collections.Counter()
    seen: set[tuple[str, str]] = set()
    examples: list[dict] = []
    while len(examples) < size and active:
        order = list(active)
        rng.shuffle(order)
        for pair in order:
            if len(examples) >= size:
                break
            template, db_id = pairs[pair]
            example = _instantiate(template, databases[db_id], split, rng, seen)
            if example is None:
                misses[pair] += 1
                if misses[pair] >= _MAX_CONSECUTIVE_FAILURES:
                    active.remove(pair)
                continue
            misses[pair] = 0
            seen.add((db_id, example["question"]))
            examples.append(example)
    if len(examples) < size:
        raise ValueError(f"the demo world has only {len(examples)} distinct {split} questions; "
                         f"asked for {size}")
    return examples


def _instantiate(template: Template, db: Database, split: str, rng: random.Random,
                 seen: set[tuple[str, str]]) -> dict | None:
    """One verified example, or None (no value in this split, a duplicate, an empty or tied result)."""
    try:
        sql, questions = template.build(Slots(db.schema, db.pools, split, rng))
    except NoValue:
        return None
    paraphrase = rng.randrange(len(questions))
    question = _A_BEFORE_VOWEL.sub(r"\1n ", questions[paraphrase])
    if (db.schema.db_id, question) in seen:
        return None
    tree = preds.parse(sql)
    gold = preds.render(tree)
    rows = preds.execute(db.conn, gold)
    if not rows or all(v is None for row in rows for v in row):
        return None
    if preds.order_is_ambiguous(db.conn, tree):
        return None
    return {"db_id": db.schema.db_id, "question": question, "query": gold,
            "template_id": template.id, "paraphrase_id": paraphrase}


def make_predictions(databases: dict[str, Database], examples: list[dict], seed: int, split: str,
                     mix: dict[str, float] | None = None,
                     surface_share: float = preds.SURFACE_SHARE) -> list[dict]:
    predictors = {db_id: preds.Predictor(db.conn, db.schema, mix, surface_share=surface_share)
                  for db_id, db in databases.items()}
    records = []
    for index, example in enumerate(examples):
        rng = random.Random(f"{seed}:prediction:{split}:{index}")
        made = predictors[example["db_id"]].predict(example["query"], rng)
        records.append({
            "index": index, "split": split, "db_id": example["db_id"], "question": example["question"],
            "gold": example["query"], "pred": made.pred, "kind": made.kind,
            "true_root_clause": made.true_root_clause, "error_kind": made.error_kind,
            "errors": list(made.errors), "surface": list(made.surface), "surface_gold": made.surface_gold,
            "harmless": list(made.harmless), "suspect": made.suspect,
            "template_id": example["template_id"],
        })
    return records


def build_demo_world(out_dir: str | pathlib.Path, seed: int = 0, *, train_size: int = DEFAULT_TRAIN_SIZE,
                     dev_size: int = DEFAULT_DEV_SIZE, prediction_mix: dict[str, float] | None = None,
                     surface_share: float = preds.SURFACE_SHARE, force: bool = False) -> pathlib.Path:
    """Writes the demo world under ``out_dir`` and returns it.

    A finished build with the same settings is reused (its manifest.json matches) unless ``force``.
    """
    if train_size < 1 or dev_size < 1:
        raise ValueError(f"train_size and dev_size must be positive, got {train_size}, {dev_size}")
    if not 0.0 <= surface_share <= 1.0:
        raise ValueError(f"surface_share must be in [0, 1], got {surface_share}")
    out = pathlib.Path(out_dir)
    settings = {"version": BUILD_VERSION, "seed": seed, "train_size": train_size, "dev_size": dev_size,
                "prediction_mix": prediction_mix or preds.PREDICTION_MIX, "surface_share": surface_share}
    manifest_path = out / "manifest.json"
    if not force and manifest_path.exists():
        if json.loads(manifest_path.read_text()).get("settings") == settings:
            return out
    if manifest_path.exists():
        manifest_path.unlink()

    databases = open_databases(seed)
    splits = {"train": generate_examples(databases, seed, "train", train_size),
              "dev": generate_examples(databases, seed, "dev", dev_size)}
    predictions = {split: make_predictions(databases, examples, seed, split, prediction_mix, surface_share)
                   for split, examples in splits.items()}

    out.mkdir(parents=True, exist_ok=True)
    for db_id, db in databases.items():
        path = out / "database" / db_id / f"{db_id}.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        with sqlite3.connect(path) as target:
            db.conn.backup(target)
        target.close()
        db.conn.close()
    _write_json(out / "tables.json", [tables_json_entry(db.schema) for db in databases.values()])
    for split, examples in splits.items():
        _write_json(out / f"{split}.json", examples)
        with open(out / f"predictions_{split}.jsonl", "w") as f:
            for record in predictions[split]:
                f.write(json.dumps(record) + "\n")
    db_ids = list(databases)
    manifest = {
        "settings": settings,
        "counts": {split: len(examples) for split, examples in splits.items()},
        "dev_database_of_template": {t.id: dev_database(i, db_ids) for i, t in enumerate(TEMPLATES)},
    }
    _write_json(manifest_path, manifest)
    return out


def _write_json(path: pathlib.Path, value) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")
