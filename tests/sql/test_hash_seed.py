"""Canonical forms and the annotator's tuples do not depend on Python's string hashing.

CPython salts ``str`` hashes per process (PYTHONHASHSEED), so anything that lets a set's iteration
order reach the output changes it from one run to the next. The canonical join conditions did: the
equated-column classes were ordered by their unsorted member lists, so a query joining three tables
(Spider dev's pets_1 golds) came out with its ON conjuncts in either order, and tuples built from
such trees changed text between runs (the PRM default trained on other tuples each time). The
reference is the same code in processes with other seeds, and the order written out by hand below.
"""
import json
import os
import subprocess
import sys

from tests.helpers import REPO, require, spider_dir

DB = "pets_1"
SCRIPT = r"""
import json, pathlib, sys
from caper_jax.data.spider import read_sql_predictions
from caper_jax.data.tfds_caper import read_tables
from caper_jax.sql import canonical, equivalences
from caper_jax.sql.schema import Schema
from caper_jax.sql.tuples import AnnotationSettings, Annotator
spider, predictions, db = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
path = spider / "database" / db / f"{db}.sqlite"
schema, facts = Schema.from_sqlite(path), equivalences.SchemaFacts.from_sqlite(path)
examples = json.loads((spider / "dev.json").read_text())
records = [{"db_id": e["db_id"], "question": e["question"], "gold": e["query"], "pred": p}
           for e, p in zip(examples, read_sql_predictions(predictions)) if e["db_id"] == db]
annotator = Annotator(spider / "database", AnnotationSettings(per_query=2), read_tables(spider), mutate_correct=True)
for record in records:
    print(canonical.canonicalize(record["gold"], schema, facts=facts).tree.sql())
    print(json.dumps([t.as_dict() for t in annotator(record).tuples], sort_keys=True))
annotator.close()
"""


def run(seed: int) -> list[str]:
    spider = require(spider_dir())
    predictions = require(spider.parent / "spider_predictions" / "din_sql_gpt4.csv")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(spider), str(predictions), DB], cwd=REPO,
                         env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True,
                         timeout=600, check=True)
    return out.stdout.splitlines()


def test_canonical_forms_and_tuples_are_the_same_under_four_hash_seeds():
    # Before the fix, seeds 1-4 gave two different canonical forms of dev golds 53, 61 and 65.
    outputs = [run(seed) for seed in (1, 2, 3, 4)]
    assert len(outputs[0]) == 2 * 42 and sum(line != "[]" for line in outputs[0][1::2]) > 20
    for other in outputs[1:]:
        assert other == outputs[0]
    # The equated-column classes in sorted order: (has_pet.petid, pets.petid) before (has_pet.stuid, ...).
    assert ("SELECT COUNT(*) FROM student, has_pet JOIN pets ON has_pet.petid = pets.petid AND "
            "has_pet.stuid = student.stuid WHERE student.sex = 'F' AND pets.pettype = 'dog'") in outputs[0]
