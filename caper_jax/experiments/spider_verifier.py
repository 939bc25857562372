"""The Clause-PRM as a plug-and-play verifier on real candidates: the paper's third experiment, on Spider.

    bash launch/spider_verifier.sh runs/spider_verifier
    python -m caper_jax.train --config=configs/spider_verifier.py --workdir=runs/spider_verifier

The stages (``stages``; each skipped once its output exists, ``caper_jax.experiments.stages``):

    stage       output under the workdir
    view        spider/                  a Spider layout of links: the training and dev questions whose
                                         database exists, a BPE tokenizer trained on the training prompts + SQL
    sft         sft/                     a tiny policy SFT'd on the view's training questions
    samples     samples/train.jsonl      its k samples per training question
    confidence  prm_data/                those samples + the six systems' dev candidates as predictions, with
                                         the policy's clause confidences (the gold-free baselines' inputs)
    prm         prm/                     a Clause-PRM (backbone from sft/) trained on the training split only;
                                         localisation of the systems' real dev failures against the baselines
    pick        rerank_pick.json         the reranker picked on training questions the PRM never trained on
    verify      verify.json              EX on dev of each system alone, MV@n, every PRM reranker, oracle@n
    report      results.json, results.md
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib

import jax
import numpy as np

from caper_jax import loop
from caper_jax.data.spider import load_schemas, load_split, read_system_predictions
from caper_jax.eval import policy as policy_lib
from caper_jax.eval import verifier
from caper_jax.eval.ex import evaluate_ex
from caper_jax.experiments import report
from caper_jax.experiments.rerankers import pick_stage, prm_scorer
from caper_jax.experiments.samples import (add_policy_confidence, build_prm_data, confidence_stage,
                                           held_back_questions, samples_stage, train_samples_path, write_jsonl)
from caper_jax.experiments.settings import SpiderVerifierSettings
from caper_jax.experiments.stages import Stage, StageClock, completion, run_experiment, with_report
from caper_jax.parallel import multihost
from caper_jax.prm import trainer as prm_trainer
from caper_jax.prm.localization import best_fair_baseline
from caper_jax.settings import from_config, replace
from caper_jax.sft import trainer as sft_trainer
from caper_jax.sql.contract import policy_prompt, serialize_schema
from caper_jax.sql.execution import Executors
from caper_jax.utils import summary as summary_lib
from caper_jax.utils.subset import seeded_subset

log = logging.getLogger("caper_jax")


# -- settings


def validate(config) -> SpiderVerifierSettings:
    """The config built into ``SpiderVerifierSettings`` (its values and each stage's checked there), then what
    the machine answers: the data folders and the systems' files exist, each wired stage's ``check_job``."""
    settings = from_config(SpiderVerifierSettings, config)
    for key, path in (("spider_dir", settings.data.spider_dir), ("predictions_dir", settings.data.predictions_dir)):
        if not pathlib.Path(path).is_dir():
            raise ValueError(f"data.{key}={path!r} is not a directory")
    for name in settings.data.systems:
        if not (pathlib.Path(settings.data.predictions_dir) / name).is_file():
            raise ValueError(f"data.systems: {name!r} is not in {settings.data.predictions_dir}")
    stages = stage_settings(settings, pathlib.Path("/nonexistent"))
    # The SFT run does not exist yet; the PRM trainer checks it then.
    prm = replace(stages["prm"], {"model.init_from": ""})
    for name, check, stage in (("sft", sft_trainer.check_job, stages["sft"]), ("prm", prm_trainer.check_job, prm)):
        try:
            check(stage)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{name}: {e}") from e
    return settings


def dry_run(settings: SpiderVerifierSettings) -> dict:
    """The SFT and PRM trainers' dry runs (compiled step, FLOPs, per-device memory) on the current devices."""
    return {"sft": sft_trainer.dry_run(settings.sft), "prm": prm_trainer.dry_run(settings.prm)}


def stage_settings(settings: SpiderVerifierSettings, out: pathlib.Path) -> dict:
    """SFT on the view's training questions; the PRM on prm_data/ with the SFT run as its backbone."""
    view = out / "spider"
    common = {"seed": settings.seed, "data.kind": "spider", "model.tokenizer_dir": str(view / "tokenizer")}
    return {"sft": replace(settings.sft, {**common, "data.dir": str(view)}),
            "prm": replace(settings.prm, {**common, "data.dir": str(out / "prm_data"),
                                          "model.init_from": str(out / "sft")})}


# -- stages


@dataclasses.dataclass(frozen=True)
class Verified:
    """The verify stage's output: ``verify.json`` and ``verify_choices.jsonl`` whose every graded line
    carries each candidate's verdict and each selector's pick. A workdir verified before those fields
    existed runs the stage again, as the report's paired rerank-minus-vote intervals are computed from them."""
    out: pathlib.Path

    def exists(self) -> bool:
        choices = self.out / "verify_choices.jsonl"
        if not (self.out / "verify.json").exists() or not choices.exists():
            return False
        rows = [json.loads(line) for line in choices.read_text().splitlines() if line.strip()]
        if any(r.get("correct") is not None and "choices" not in r for r in rows):
            multihost.log_main("%s predates the per-candidate verdicts: running the verify stage again", choices)
            return False
        return True


def stages(settings: SpiderVerifierSettings, out: pathlib.Path, clock: StageClock) -> list[Stage]:
    """The pipeline, stage by stage (the module docstring's table); ``clock`` gives the report its times."""
    view = out / "spider"
    staged = stage_settings(settings, out)
    train_samples = train_samples_path(out)
    # The six systems' dev candidates, read once the view exists and only by the stages that need them.
    candidates = functools.cache(lambda: system_candidates(settings, view))

    def write_view() -> None:
        multihost.log_main("Spider view: %s", build_spider_view(settings, view))

    def write_prm_data() -> None:
        pools = out / "systems_dev.jsonl"   # the six systems' candidates as an evaluation's sample rows
        write_jsonl(pools, [{"db_id": c["db_id"], "question": c["question"], "gold": c["gold"],
                             "samples": c["candidates"]} for c in candidates()])
        build_prm_data(view, train_samples, pools, out / "prm_data", "train", "dev",
                       held_back_questions(settings, train_samples))
        with Executors(policy_lib.database_dir(view), timeout_s=settings.eval.timeout_s) as executors:
            examples, _ = policy_lib.usable_examples(view, "dev", settings.sft.data.schema_values, executors, 0,
                                                     settings.seed)
        add_policy_confidence(settings, examples, out / "sft", out / "prm_data" / "predictions_dev.jsonl")

    def write_verify() -> None:
        verified = verify_systems(settings, view, candidates(), out)
        (out / "verify.json").write_text(json.dumps(verified, indent=1) + "\n")

    work = [
        Stage("view", view / "tokenizer" / "tokenizer.json", write_view),
        Stage("sft", completion(out / "sft"), functools.partial(sft_trainer.run, staged["sft"], str(out / "sft"))),
        samples_stage(settings, view, out),
        confidence_stage(out, write_prm_data),
        Stage("prm", completion(out / "prm"), functools.partial(prm_trainer.run, staged["prm"], str(out / "prm"))),
        pick_stage(settings, view, train_samples, out),
        Stage("verify", Verified(out), write_verify),
    ]
    return with_report(work, clock, functools.partial(collect, settings, out),
                       lambda results, order: report.write_verifier_report(results, out, order))


def run(settings: SpiderVerifierSettings, workdir: str) -> dict:
    """SFT -> samples -> Clause-PRM (SFT-initialised) -> localisation and reranking of six real systems."""
    return run_experiment(functools.partial(stages, settings), workdir, summary_lib.spider_verifier_run)


def build_spider_view(settings: SpiderVerifierSettings, view: pathlib.Path) -> dict:
    """A Spider-layout folder of links: database/ and tables.json; train.json = the training questions
    whose database is present (a seeded subset of ``data.train_questions`` when > 0, from
    train_no_db/train_spider_questions.json); dev.json = the dev questions whose database is present
    (a seeded subset of ``data.dev_questions``), each with ``source_index``, its line in the systems'
    files; and a byte-level BPE tokenizer trained on the training prompts + SQL only."""
    # Deferred: it loads transformers (seconds), which only building the view needs, not a settings check or a resume.
    from caper_jax.data.tokenizer import SPECIAL_TOKENS, SQL_WORDS, build_demo_tokenizer

    src = pathlib.Path(settings.data.spider_dir).resolve()
    view.mkdir(parents=True, exist_ok=True)
    for name in ("database", "tables.json"):
        if not (view / name).exists():
            (view / name).symlink_to(src / name)
    present = {p.name for p in (src / "database").iterdir() if (p / f"{p.name}.sqlite").is_file()}
    rng = np.random.default_rng(settings.seed)   # one stream: the dev subset is drawn after the train subset
    train = [r for r in json.loads((src / "train_no_db" / "train_spider_questions.json").read_text())
             if r["db_id"] in present]
    train = seeded_subset([{"db_id": r["db_id"], "question": r["question"], "query": r["query"]} for r in train],
                          settings.data.train_questions, rng)
    dev = [dict(r, source_index=i) for i, r in enumerate(json.loads((src / "dev.json").read_text()))
           if r["db_id"] in present]
    dev = seeded_subset(dev, settings.data.dev_questions, rng)
    (view / "train.json").write_text(json.dumps(train))
    (view / "dev.json").write_text(json.dumps(dev))
    schemas = load_schemas(view)
    corpus = [" ".join(SQL_WORDS), " ".join(w.lower() for w in SQL_WORDS)]
    for r in train:
        prompt = policy_prompt(r["question"], serialize_schema(schemas[r["db_id"]]))
        for special in SPECIAL_TOKENS:
            prompt = prompt.replace(special, "\n")
        corpus.append(prompt + r["query"])
    build_demo_tokenizer(view / "tokenizer", vocab_size=settings.data.vocab_size, seed=settings.seed, corpus=corpus)
    return {"train": len(train), "dev": len(dev), "databases": len(present)}


def system_candidates(settings: SpiderVerifierSettings, view: pathlib.Path) -> list[dict]:
    """Per dev question of the view: index (in the view's dev.json), db_id, question, gold, and the
    systems' predictions in ``data.systems`` order (``caper_jax.data.spider.read_sql_predictions``)."""
    full = load_split(settings.data.spider_dir, "dev")
    per_system = read_system_predictions(settings.data.predictions_dir, settings.data.systems, full)
    dev = json.loads((view / "dev.json").read_text())
    return [{"index": i, "db_id": r["db_id"], "question": r["question"], "gold": r["query"],
             "candidates": [preds[r["source_index"]] for preds in per_system]} for i, r in enumerate(dev)]


def verify_systems(settings: SpiderVerifierSettings, view: pathlib.Path, candidates: list[dict],
                   out: pathlib.Path) -> dict:
    """EX of each system alone (``evaluate ex``) and of the pool: first, MV@n, every PRM reranker, oracle@n."""
    pool = out / "systems_candidates.jsonl"
    write_jsonl(pool, [{"index": c["index"], "candidates": c["candidates"]} for c in candidates])
    alone = {}
    for j, name in enumerate(settings.data.systems):
        path = out / "systems" / f"{name}.jsonl"
        write_jsonl(path, [{"index": c["index"], "pred": c["candidates"][j]} for c in candidates])
        alone[name] = evaluate_ex(view, "dev", path, semantics=settings.verify.semantics,
                                  report=lambda message: log.info("%s", message))["ex"]
    mesh, rules = loop.mesh_and_rules(settings.eval)
    scorer = prm_scorer(settings, out / "prm", mesh, rules)
    with jax.set_mesh(mesh):
        summary = verifier.rerank(scorer, view, "dev", pool, aggregate="min", semantics=settings.verify.semantics,
                                output=out / "verify_choices.jsonl", report=lambda message: log.info("%s", message))
    return {"alone": alone, "pool": summary}


# -- results


def collect(settings: SpiderVerifierSettings, out: pathlib.Path) -> dict:
    """results.json's content from the stages' own results files."""
    prm = json.loads((out / "prm" / "results.json").read_text())
    localization = prm.get("localization", {})
    pick = json.loads((out / "rerank_pick.json").read_text())
    verified = json.loads((out / "verify.json").read_text())
    pool = verified["pool"]
    how = pick["picked"]
    return {
        "localization": {m: {"top1": s["top1"], "mrr": s["mrr"], "n": s["n"], "sees_gold": s.get("sees_gold")}
                         for m, s in localization.items()},
        "best_fair_baseline": best_fair_baseline(localization),
        "ex_alone": verified["alone"],
        "n_dev": pool["n"],
        "first": pool["first"],
        "mv": pool["vote"],
        "rerank": pool["prm_by_aggregate"],
        "rerank_aggregate": how,
        "rerank_pick": pick,
        "oracle": pool["any"],
        "rerank_minus_mv": rerank_minus_vote(out / "verify_choices.jsonl"),
        "k": len(settings.data.systems),
        "pair_accuracy": prm["metrics"].get("eval/pair_accuracy"),
        "n_train_tuples_file": str(out / "prm" / "tuples"),
    }


def rerank_minus_vote(choices_path: pathlib.Path) -> dict[str, dict]:
    """Per selector: EX of its pick minus EX of the majority vote's, paired over the same dev questions,
    with the 95 % t-interval of the mean difference (``verify --output`` lines: each selector's pick and
    every candidate's verdict)."""
    rows = [json.loads(line) for line in choices_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("candidate_correct")]
    vote = [float(r["candidate_correct"][r["vote_choice"]]) for r in rows]
    out = {}
    for selector in (rows[0]["choices"] if rows else {}):
        picked = [float(r["candidate_correct"][r["choices"][selector]]) for r in rows]
        interval = report.paired_interval(picked, vote)
        out[selector] = {k: interval[k] for k in ("mean", "lo", "hi", "n", "confidence")}
    return out
