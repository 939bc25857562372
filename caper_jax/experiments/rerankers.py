"""The PRM rerankers of both pipelines: their names, the PRM scorer, and the pick on training questions.

    pick_stage   rerank_pick.json: EX of every reranker on the SFT policy's samples of TRAINING questions
                 and the best of them, the one the report's headline uses; the test split never takes part
"""
from __future__ import annotations

import json
import pathlib

import jax

from caper_jax import loop
from caper_jax.eval import policy as policy_lib
from caper_jax.experiments.samples import pick_groups
from caper_jax.experiments.settings import rerankers
from caper_jax.experiments.stages import Stage
from caper_jax.parallel import multihost
from caper_jax.prm.scoring import load_scorer
from caper_jax.sql.execution import Executors


def prm_scorer(settings, prm_dir: pathlib.Path, mesh, rules):
    """The Clause-PRM of ``prm_dir`` as the evaluation scores with it (``config.eval.prm``'s batch and length)."""
    e = settings.eval
    return load_scorer(prm_dir, mesh=mesh, rules=rules, batch_size=e.prm.batch_size, max_len=e.prm.max_len or None)


def pick_stage(settings, data_dir: pathlib.Path, train_samples: pathlib.Path, out: pathlib.Path) -> Stage:
    """``rerank_pick.json``: the reranker picked on training questions (``pick_reranker``), once."""
    path = out / "rerank_pick.json"

    def pick() -> None:
        picked = pick_reranker(settings, data_dir, train_samples, out / "prm")
        path.write_text(json.dumps(picked, indent=1) + "\n")
        multihost.log_main("reranker picked on %d training questions: %s (EX %s)", picked["n"], picked["picked"],
                           {k: round(v, 3) for k, v in picked["ex"].items()})

    return Stage("pick", path, pick)


def pick_reranker(settings, data_dir: pathlib.Path, train_samples: pathlib.Path, prm_dir: pathlib.Path
                  ) -> dict:
    """EX of every PRM reranker on the SFT policy's samples of up to ``report.pick_questions`` TRAINING
    questions (the groups of k ``sample_train_questions`` drew), and the best of them (ties: the first in
    ``rerankers`` order). The test split never takes part in the choice."""
    e = settings.eval
    groups = pick_groups(settings, train_samples)
    mesh, rules = loop.mesh_and_rules(e)
    scorer = prm_scorer(settings, prm_dir, mesh, rules)
    schema_values = settings.sft.data.schema_values
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, settings.sft.data.train_split, schema_values, executors,
                                                 0, settings.seed)
        by_question = {(ex.db_id, ex.question, ex.sql): ex for ex in examples}
        groups = [g for g in groups if (g["db_id"], g["question"], g["gold"]) in by_question]
        chosen = [by_question[g["db_id"], g["question"], g["gold"]] for g in groups]
        with jax.set_mesh(mesh):
            metrics, _ = policy_lib.score_examples(
                chosen, [g["samples"][0] for g in groups], [g["samples"] for g in groups], executors,
                semantics=e.data.semantics, prm_scores=scorer.score_queries, aggregates=e.prm.aggregates)
    ex = metrics["prm"]
    picked = max(rerankers(settings.eval), key=lambda how: (ex[how], -rerankers(settings.eval).index(how)))
    return {"split": settings.sft.data.train_split, "n": len(groups), "k": e.sampling.k, "ex": ex,
            "majority_vote": metrics["majority_vote"], "oracle": metrics["oracle"], "picked": picked,
            "held_back": settings.report.pick_held_back}
