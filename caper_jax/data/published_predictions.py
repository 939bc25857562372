"""Spider-dev predictions of six published systems, and their failures by execution.

The files live in ``../shared/data/spider_predictions/`` (provenance, licences and formats in its
PROVENANCE.md): four ``.sql`` files of 1034 lines in dev.json order and two DIN-SQL CSVs with a
``PREDICTED SQL`` column, read by ``caper_jax.data.spider.read_sql_predictions`` (tabs inside a
line are spaces: c3sql_chatgpt.sql line 771 holds tabs inside its SQL). A *failure* is an example
with a database whose prediction does not execute to gold's result the Spider way (``results_equal``: bags, ordered iff gold has ORDER BY, any column order).
"""
from __future__ import annotations

import json
import os
import pathlib

from caper_jax.data.spider import read_sql_predictions
from caper_jax.sql.execution import Executors, order_matters, results_equal

SYSTEMS = ("dail_sql_gpt4.sql", "dail_sql_gpt4_sc.sql", "graphix_t5.sql", "c3sql_chatgpt.sql",
           "din_sql_gpt4.csv", "din_sql_codex.csv")


def failures(spider_dir: str | os.PathLike, predictions_dir: str | os.PathLike,
             systems: tuple[str, ...] = SYSTEMS) -> list[dict]:
    """Every failure of the given systems: ``{system, index, db_id, question, gold, pred}``.

    Examples whose database is missing (``wta_1`` here) are skipped.
    """
    spider_dir, predictions_dir = pathlib.Path(spider_dir), pathlib.Path(predictions_dir)
    examples = json.loads((spider_dir / "dev.json").read_text())
    out = []
    with Executors(spider_dir / "database") as executors:
        for system in systems:
            predictions = read_sql_predictions(predictions_dir / system)
            if len(predictions) != len(examples):
                raise ValueError(f"{system}: {len(predictions)} predictions for {len(examples)} examples")
            for index, (example, pred) in enumerate(zip(examples, predictions)):
                db_id = example["db_id"]
                if not executors.db_path(db_id).is_file():
                    continue
                gold = executors.execute(db_id, example["query"])
                result = executors.execute(db_id, pred)
                if result.ok and results_equal(gold, result, ordered=order_matters(example["query"])):
                    continue
                out.append({"system": system, "index": index, "db_id": db_id,
                            "question": example["question"], "gold": example["query"], "pred": pred})
    return out


__all__ = ["SYSTEMS", "failures"]
