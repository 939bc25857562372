"""The paper's experiment in miniature: SFT -> sample -> annotate -> Clause-PRM -> GRPO x 3 -> evaluation.

    bash launch/reproduce_cpu.sh runs/reproduce
    python -m caper_jax.train --config=configs/reproduce.py --workdir=runs/reproduce

Each stage is the project's own trainer or evaluator (the code a user runs stage by stage); this
module only wires their inputs and outputs (``stages``) and collects the report's numbers
(``collect``). Every stage is skipped once its output exists and the trainers resume from their
checkpoints, so rerunning an interrupted command loses nothing (``caper_jax.experiments.stages``).

    stage       output under the workdir
    world       world/                   the demo world (or ``data.dir`` used in place)
    sft         sft/                     SFT policy                          (caper_jax.sft.trainer)
    eval_sft    eval/sft/                greedy + k samples per held-out question, MV@k (caper_jax.eval.policy)
    samples     samples/train.jsonl      k samples per training question of the SFT policy (distinct ones;
                                         the full groups of k in train_groups.jsonl)
    confidence  prm_data/                the world's files + those samples as predictions_{train,dev}.jsonl;
                                         each dev line also carries its question's k samples and the SFT
                                         policy's mean log-prob per clause (the gold-free baselines' inputs)
    prm         prm/                     Clause-PRM (backbone from sft/ when prm_init="sft") trained on the
                                         annotated samples (+ gold fault injection), localisation on the
                                         held-out FAILED samples against every baseline (caper_jax.prm.trainer)
    pick        rerank_pick.json         EX of every PRM reranker on a pool of TRAINING questions' samples: the
                                         one the report uses (report.rerank="train") is picked here, never on test
    rerank_sft  eval/sft/                PRM rerankers added to the SFT samples drawn before the PRM existed
    grpo        grpo/<variant>_s<seed>/  GRPO from the SFT policy, equal budgets (caper_jax.rl.trainer)
    eval        eval/<variant>_s<seed>/  greedy EX, MV@k, PRM best-of-k of each GRPO policy
    report      results.json, results.md, grpo_curves.png, localization_per_clause.png

The held-out failures the PRM is tested on are the SFT policy's own failed samples, labelled by the
annotator's counterfactual localisation, as in the paper. All policies are sampled with the same
evaluation seed (common random numbers), so their differences are not sampling noise of the evaluation.
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
from caper_jax.data.data_world import prepare_world
from caper_jax.eval import policy as policy_lib
from caper_jax.eval.settings import EvalSettings
from caper_jax.eval.validate import check_job as check_eval_job
from caper_jax.experiments import report
from caper_jax.experiments.rerankers import pick_stage, prm_scorer
from caper_jax.experiments.samples import (add_policy_confidence, build_prm_data, confidence_stage,
                                           held_back_questions, samples_stage, train_samples_path, write_jsonl)
from caper_jax.experiments.settings import ReproduceSettings, rerankers
from caper_jax.experiments.stages import Stage, StageClock, completion, run_experiment, with_report
from caper_jax.prm import trainer as prm_trainer
from caper_jax.prm.localization import SEES_GOLD, best_fair_baseline
from caper_jax.rl import trainer as rl_trainer
from caper_jax.settings import from_config, replace
from caper_jax.sft import trainer as sft_trainer
from caper_jax.sql.execution import Executors
from caper_jax.utils import summary as summary_lib
from caper_jax.utils.monitoring import read_metrics

log = logging.getLogger("caper_jax")


# -- settings


def stage_settings(settings: ReproduceSettings, out: pathlib.Path, data_dir: pathlib.Path, tokenizer_dir: str
                   ) -> dict:
    """The per-stage settings, wired to each other's outputs under ``out``.

    Every stage reads the world as Spider layout (``data.kind="spider"``) once it exists, so no
    stage rebuilds the demo world with its own seed.
    """
    def wired(base, seed: int, changes: dict | None = None):
        return replace(base, {"seed": seed, "data.kind": "spider", "data.dir": str(data_dir),
                              **({"model.tokenizer_dir": tokenizer_dir} if tokenizer_dir else {}), **(changes or {})})

    seed = settings.seed
    sft = wired(settings.sft, seed)
    # The SFT policy is the PRM's stand-in for the paper's pretrained LLM (issue 21 item 2).
    prm = wired(settings.prm, seed, {"data.dir": str(out / "prm_data"),
                                     "model.init_from": str(out / "sft") if settings.prm_init == "sft" else ""})
    grpo = {run_name(variant, s): wired(settings.grpo, s, {
                "reward.variant": variant, "policy.sft_workdir": str(out / "sft"),
                "prm.workdir": str(out / "prm") if variant != "sparse" else ""})
            for variant in settings.variants for s in settings.seeds}
    return {"sft": sft, "prm": prm, "grpo": grpo}


def eval_settings(settings: ReproduceSettings, data_dir: pathlib.Path, policy: pathlib.Path, prm: str
                  ) -> EvalSettings:
    return replace(settings.eval, {"seed": settings.seed,   # the same sampling keys for every policy
                                   "policy.workdir": str(policy), "prm.path": prm, "data.dir": str(data_dir)})


def run_name(variant: str, seed: int) -> str:
    return f"{variant}_s{seed}"


def validate(config) -> ReproduceSettings:
    """The config built into ``ReproduceSettings`` (its values and each stage's checked there), then each
    wired stage's ``check_job`` (devices, processes) before any stage runs."""
    settings = from_config(ReproduceSettings, config)
    placeholder = pathlib.Path("/nonexistent")
    stages = stage_settings(settings, placeholder, placeholder, "tokenizer")
    # The SFT run does not exist yet; the PRM trainer checks it then.
    prm = replace(stages["prm"], {"model.init_from": ""})
    for name, check, stage in [("sft", sft_trainer.check_job, stages["sft"]), ("prm", prm_trainer.check_job, prm),
                               *[(f"grpo.{k}", rl_trainer.check_job, g) for k, g in stages["grpo"].items()]]:
        try:
            check(stage)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{name}: {e}") from e
    try:
        # The evaluator checks that its paths exist; the policies are not trained yet.
        check_eval_job(eval_settings(settings, pathlib.Path.cwd(), pathlib.Path.cwd(), ""))
    except (ValueError, KeyError) as e:
        raise ValueError(f"eval: {e}") from e
    return settings


def dry_run(settings: ReproduceSettings) -> dict:
    """The three trainers' dry runs (compiled step, FLOPs, per-device memory) on the current devices."""
    return {"sft": sft_trainer.dry_run(settings.sft), "prm": prm_trainer.dry_run(settings.prm),
            "grpo": rl_trainer.dry_run(settings.grpo)}


# -- stages


def data_paths(settings: ReproduceSettings, out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(Spider-layout data dir, tokenizer dir): the demo world's under ``out/world``, or data.dir's."""
    if settings.data.kind == "spider":
        return pathlib.Path(settings.data.dir), settings.sft.model.tokenizer_dir or settings.sft.model.hf_dir
    return out / "world", str(out / "world" / "tokenizer")


def build_world(settings: ReproduceSettings, out: pathlib.Path) -> None:
    """The demo world under ``out/world`` (``prepare_world`` reuses a complete one); data.dir is used in place."""
    if settings.data.kind == "spider":
        return
    demo = {"seed": settings.seed, "data.kind": "demo", "data.dir": str(out / "world")}
    prepare_world(replace(settings.sft, demo), out)


@dataclasses.dataclass(frozen=True)
class Reranked:
    """An evaluation whose results.json holds PRM reranking (its samples were drawn before the PRM existed)."""
    results: pathlib.Path

    def exists(self) -> bool:
        return "prm" in json.loads(self.results.read_text())["metrics"]


def stages(settings: ReproduceSettings, out: pathlib.Path, clock: StageClock) -> list[Stage]:
    """The pipeline, stage by stage (the module docstring's table); ``clock`` gives the report its times."""
    data_dir, tokenizer_dir = data_paths(settings, out)
    staged = stage_settings(settings, out, data_dir, tokenizer_dir)
    train_samples = train_samples_path(out)
    eval_sft = out / "eval" / "sft"

    def write_prm_data() -> None:
        build_prm_data(data_dir, train_samples, eval_sft / "predictions.jsonl", out / "prm_data",
                       staged["prm"].data.train_split, staged["prm"].data.eval_split,
                       held_back_questions(settings, train_samples))
        add_policy_confidence(settings, eval_examples(settings, data_dir, eval_sft), out / "sft",
                              out / "prm_data" / f"predictions_{staged['prm'].data.eval_split}.jsonl")

    work = [
        Stage("world", None, functools.partial(build_world, settings, out)),
        Stage("sft", completion(out / "sft"), functools.partial(sft_trainer.run, staged["sft"], str(out / "sft"))),
        Stage("eval_sft", completion(eval_sft),
              functools.partial(policy_lib.run, eval_settings(settings, data_dir, out / "sft", ""), eval_sft)),
        samples_stage(settings, data_dir, out),
        confidence_stage(out, write_prm_data),
        Stage("prm", completion(out / "prm"), functools.partial(prm_trainer.run, staged["prm"], str(out / "prm"))),
        pick_stage(settings, data_dir, train_samples, out),
        Stage("rerank_sft", Reranked(completion(eval_sft)),
              functools.partial(rerank_saved_samples, settings, data_dir, eval_sft, out / "prm")),
    ]
    for name, grpo_settings in staged["grpo"].items():
        policy = out / "grpo" / name
        work += [Stage("grpo", completion(policy), functools.partial(rl_trainer.run, grpo_settings, str(policy))),
                 Stage("eval", completion(out / "eval" / name),
                       functools.partial(policy_lib.run, eval_settings(settings, data_dir, policy, str(out / "prm")),
                                         out / "eval" / name))]
    return with_report(work, clock, functools.partial(collect, settings, out),
                       lambda results, order: report.write_miniature_report(settings, results, out, order))


def run(settings: ReproduceSettings, workdir: str) -> dict:
    return run_experiment(functools.partial(stages, settings), workdir, summary_lib.reproduce_run)


def eval_examples(settings: ReproduceSettings, data_dir: pathlib.Path, eval_dir: pathlib.Path) -> list:
    """The examples an evaluation in ``eval_dir`` scored (its split, subset and the policy's schema text)."""
    results = json.loads((eval_dir / "results.json").read_text())
    ec = results["config"]
    with Executors(policy_lib.database_dir(data_dir), timeout_s=settings.eval.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, ec["data"]["split"], results["schema_values"], executors,
                                                 ec["data"]["num_examples"], ec["seed"])
    return examples


def rerank_saved_samples(settings: ReproduceSettings, data_dir: pathlib.Path, eval_dir: pathlib.Path,
                         prm_dir: pathlib.Path) -> dict:
    """Adds PRM best-of-k to an evaluation whose samples were drawn before the PRM existed."""
    results = json.loads((eval_dir / "results.json").read_text())
    rows = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines()]
    examples = eval_examples(settings, data_dir, eval_dir)
    if [ex.question for ex in examples] != [r["question"] for r in rows]:
        raise RuntimeError(f"{eval_dir}: its predictions no longer match the examples of {data_dir}")
    e = settings.eval
    mesh, rules = loop.mesh_and_rules(e)
    scorer = prm_scorer(settings, prm_dir, mesh, rules)
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors, jax.set_mesh(mesh):
        metrics, new_rows = policy_lib.score_examples(
            examples, [r["greedy"] for r in rows], [r["samples"] for r in rows], executors,
            semantics=results["config"]["data"]["semantics"], prm_scores=scorer.score_queries,
            aggregates=e.prm.aggregates)
    results.update(metrics=metrics, prm=str(prm_dir))
    write_jsonl(eval_dir / "predictions.jsonl", new_rows)
    (eval_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


# -- results

def collect(settings: ReproduceSettings, out: pathlib.Path) -> dict:
    """results.json's content from the stages' own results files."""
    prm = json.loads((out / "prm" / "results.json").read_text())
    # Empty when no held-out sample both failed and parsed (a policy that writes only garbage).
    localization = prm.get("localization", {})
    if "prm" not in localization:
        log.warning("%s: no held-out failed sample could be localised; Table 1 stays empty", out / "prm")
    evals = {"sft": [json.loads((out / "eval" / "sft" / "results.json").read_text())]}
    for variant in settings.variants:
        evals[variant] = [json.loads((out / "eval" / run_name(variant, s) / "results.json").read_text())
                          for s in settings.seeds]
    pick = json.loads((out / "rerank_pick.json").read_text()) if (out / "rerank_pick.json").exists() else None
    if settings.report.rerank == "train":
        if pick is None:
            raise FileNotFoundError(f"{out / 'rerank_pick.json'} is missing: report.rerank='train' needs the pick stage")
        how = pick["picked"]
    else:
        how = settings.report.rerank
    selectors = [s for s in rerankers(settings.eval) if all(s in r["metrics"].get("prm", {}) for runs in evals.values()
                                                     for r in runs)]

    def per_policy(pick_metric) -> dict[str, list[float]]:
        return {name: [float(pick_metric(r["metrics"])) for r in runs] for name, runs in evals.items()}

    ex, mv = per_policy(lambda m: m["greedy"]), per_policy(lambda m: m["majority_vote"])
    rerank = {sel: report.summary(per_policy(lambda m, sel=sel: m["prm"][sel])) for sel in selectors}
    paired: dict[str, dict] = {"greedy_ex": {}, "rerank_minus_mv": {}}
    for other in ("sparse", "token"):
        if "clause" in ex and other in ex:
            paired["greedy_ex"][f"clause-{other}"] = report.paired_interval(ex["clause"], ex[other])   # paired by seed
    for name in ex:
        paired["rerank_minus_mv"][name] = report.paired_interval(rerank[how][name]["values"], mv[name])
    grpo_runs = [v for v in settings.variants if v in ex]
    paired["rerank_minus_mv_grpo_pooled"] = report.paired_interval(
        [x for v in grpo_runs for x in rerank[how][v]["values"]], [x for v in grpo_runs for x in mv[v]])
    fair = best_fair_baseline(localization)
    return {
        "localization_top1": localization.get("prm", {}).get("top1"),
        "localization_mrr": localization.get("prm", {}).get("mrr"),
        "localization_n": localization.get("prm", {}).get("n", 0),
        "baselines": {m: {"top1": s["top1"], "mrr": s["mrr"], "sees_gold": s.get("sees_gold", SEES_GOLD.get(m, True))}
                      for m, s in localization.items() if m != "prm"},
        "best_fair_baseline": fair,
        "localization_per_clause": {m: s["per_clause"] for m, s in localization.items()},
        "pair_accuracy": prm["metrics"].get("eval/pair_accuracy"),
        "prm_init": settings.prm_init,
        "ex": report.summary(ex),
        "mv8": report.summary(mv),
        "rerank8": rerank,
        "oracle8": report.summary(per_policy(lambda m: m["oracle"])),
        "rerank_aggregate": how,
        "rerank_pick": pick,
        "paired_differences": paired,
        "k": settings.eval.sampling.k,
        "n_eval_questions": evals["sft"][0]["n"],
        "seeds": list(settings.seeds),
        "grpo_steps": settings.grpo.optim.total_steps,
        "curves": grpo_curves(settings, out),
    }


def grpo_curves(settings: ReproduceSettings, out: pathlib.Path) -> dict[str, dict[str, list[float]]]:
    """Per variant: rollout reward and EX by step, averaged over seeds."""
    curves = {}
    for variant in settings.variants:
        runs = [read_metrics(out / "grpo" / run_name(variant, s) / "metrics.jsonl") for s in settings.seeds]
        steps = sorted({r["step"] for rows in runs for r in rows if "rollout/ex" in r})
        curves[variant] = {"step": steps}
        for key in ("rollout/ex", "rollout/reward_mean"):
            curves[variant][key] = [float(np.mean([r[key] for rows in runs for r in rows
                                                   if r.get("step") == step and key in r])) for step in steps]
    return curves
