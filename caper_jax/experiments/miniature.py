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

import copy
import dataclasses
import functools
import json
import logging
import pathlib

import jax
import numpy as np
from ml_collections import ConfigDict

from caper_jax import loop
from caper_jax.data.data_world import prepare_world
from caper_jax.eval import policy as policy_lib
from caper_jax.eval.validate import validate_eval_config
from caper_jax.experiments import report
from caper_jax.experiments.rerankers import pick_stage, prm_scorer, rerankers
from caper_jax.experiments.samples import (add_policy_confidence, build_prm_data, check_pick_held_back,
                                           confidence_stage, held_back_questions, samples_stage,
                                           train_samples_path, write_jsonl)
from caper_jax.experiments.stages import Stage, StageClock, completion, run_experiment, with_report
from caper_jax.prm import trainer as prm_trainer
from caper_jax.prm.localization import SEES_GOLD, best_fair_baseline
from caper_jax.rl import trainer as rl_trainer
from caper_jax.rl.rewards import VARIANTS
from caper_jax.sft import trainer as sft_trainer
from caper_jax.sql.execution import Executors
from caper_jax.utils import summary as summary_lib
from caper_jax.utils.monitoring import read_metrics

log = logging.getLogger("caper_jax")

PRM_INITS = ("sft", "random")


# -- configuration


def stage_configs(config: ConfigDict, out: pathlib.Path, data_dir: pathlib.Path, tokenizer_dir: str) -> dict:
    """The per-stage configs, wired to each other's outputs under ``out``.

    Every stage reads the world as Spider layout (``data.kind="spider"``) once it exists, so no
    stage rebuilds the demo world with its own seed.
    """
    def wired(base: ConfigDict, seed: int) -> ConfigDict:
        c = copy.deepcopy(base)
        c.unlock()
        c.seed = seed
        if "data" in c and "kind" in c.data:
            c.data.kind, c.data.dir = "spider", str(data_dir)
        if "model" in c and tokenizer_dir:
            c.model.tokenizer_dir = tokenizer_dir
        return c

    seed = config.seed
    sft = wired(config.sft, seed)
    prm = wired(config.prm, seed)
    prm.data.dir = str(out / "prm_data")
    # The SFT policy is the PRM's stand-in for the paper's pretrained LLM (issue 21 item 2).
    prm.model.init_from = str(out / "sft") if config.prm_init == "sft" else ""
    grpo = {}
    for variant in config.variants:
        for s in config.seeds:
            g = wired(config.grpo, s)
            g.reward.variant = variant
            g.policy.sft_workdir = str(out / "sft")
            g.prm.workdir = str(out / "prm") if variant != "sparse" else ""
            grpo[run_name(variant, s)] = g
    return {"sft": sft, "prm": prm, "grpo": grpo}


def eval_config(config: ConfigDict, data_dir: pathlib.Path, policy: pathlib.Path, prm: str) -> ConfigDict:
    c = copy.deepcopy(config.eval)
    c.unlock()
    c.seed = config.seed                    # the same sampling keys for every policy
    c.policy.workdir = str(policy)
    c.prm.path = prm
    c.data.dir = str(data_dir)
    return c


def run_name(variant: str, seed: int) -> str:
    return f"{variant}_s{seed}"


def validate(config: ConfigDict) -> None:
    if not config.variants or any(v not in VARIANTS for v in config.variants):
        raise ValueError(f"variants={tuple(config.variants)}; expected a non-empty subset of {VARIANTS}")
    if not config.seeds or len(set(config.seeds)) != len(config.seeds):
        raise ValueError(f"seeds={tuple(config.seeds)} must be non-empty and distinct")
    if config.data.kind not in ("demo", "spider"):
        raise ValueError(f"data.kind={config.data.kind!r}; expected 'demo' or 'spider'")
    if config.data.kind == "spider" and not config.data.dir:
        raise ValueError("data.kind='spider' needs --config.data.dir=<Spider/BIRD layout directory>")
    if config.samples.train_questions < 1:
        raise ValueError(f"samples.train_questions must be >= 1, got {config.samples.train_questions}")
    if config.eval.sampling.k < 2:
        raise ValueError(f"eval.sampling.k must be >= 2 (MV@k and best-of-k), got {config.eval.sampling.k}")
    selectors = rerankers(config)
    if config.report.rerank != "train" and config.report.rerank not in selectors:
        raise ValueError(f"report.rerank={config.report.rerank!r} is not in {('train', *selectors)} "
                         "('train': the reranker that is best on the training pool)")
    if config.report.pick_questions < 1:
        raise ValueError(f"report.pick_questions must be >= 1, got {config.report.pick_questions}")
    check_pick_held_back(config)
    if config.prm_init not in PRM_INITS:
        raise ValueError(f"prm_init={config.prm_init!r}; expected one of {PRM_INITS}")
    placeholder = pathlib.Path("/nonexistent")
    configs = stage_configs(config, placeholder, placeholder, "tokenizer")
    configs["prm"].model.init_from = ""     # the SFT run does not exist yet; the PRM trainer checks it then
    for name, check, cfg in [("sft", sft_trainer.validate, configs["sft"]),
                             ("prm", prm_trainer.validate, configs["prm"]),
                             *[(f"grpo.{k}", rl_trainer.validate, g) for k, g in configs["grpo"].items()]]:
        try:
            check(cfg)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{name}: {e}") from e
    try:
        # The evaluator checks that its paths exist; the policies are not trained yet.
        validate_eval_config(eval_config(config, pathlib.Path.cwd(), pathlib.Path.cwd(), ""))
    except (ValueError, KeyError) as e:
        raise ValueError(f"eval: {e}") from e


def dry_run(config: ConfigDict) -> dict:
    """The three trainers' dry runs (compiled step, FLOPs, per-device memory) on the current devices."""
    return {"sft": sft_trainer.dry_run(config.sft), "prm": prm_trainer.dry_run(config.prm),
            "grpo": rl_trainer.dry_run(config.grpo)}


# -- stages


def data_paths(config: ConfigDict, out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(Spider-layout data dir, tokenizer dir): the demo world's under ``out/world``, or data.dir's."""
    if config.data.kind == "spider":
        return pathlib.Path(config.data.dir), config.sft.model.tokenizer_dir or config.sft.model.hf_dir
    return out / "world", str(out / "world" / "tokenizer")


def build_world(config: ConfigDict, out: pathlib.Path) -> None:
    """The demo world under ``out/world`` (``prepare_world`` reuses a complete one); data.dir is used in place."""
    if config.data.kind == "spider":
        return
    c = copy.deepcopy(config.sft)
    c.unlock()
    c.seed, c.data.kind, c.data.dir = config.seed, "demo", str(out / "world")
    prepare_world(c, out)


@dataclasses.dataclass(frozen=True)
class Reranked:
    """An evaluation whose results.json holds PRM reranking (its samples were drawn before the PRM existed)."""
    results: pathlib.Path

    def exists(self) -> bool:
        return "prm" in json.loads(self.results.read_text())["metrics"]


def stages(config: ConfigDict, out: pathlib.Path, clock: StageClock) -> list[Stage]:
    """The pipeline, stage by stage (the module docstring's table); ``clock`` gives the report its times."""
    data_dir, tokenizer_dir = data_paths(config, out)
    configs = stage_configs(config, out, data_dir, tokenizer_dir)
    train_samples = train_samples_path(out)
    eval_sft = out / "eval" / "sft"

    def write_prm_data() -> None:
        build_prm_data(data_dir, train_samples, eval_sft / "predictions.jsonl", out / "prm_data",
                       configs["prm"].data.train_split, configs["prm"].data.eval_split,
                       held_back_questions(config, train_samples))
        add_policy_confidence(config, eval_examples(config, data_dir, eval_sft), out / "sft",
                              out / "prm_data" / f"predictions_{configs['prm'].data.eval_split}.jsonl")

    work = [
        Stage("world", None, functools.partial(build_world, config, out)),
        Stage("sft", completion(out / "sft"), functools.partial(sft_trainer.run, configs["sft"], str(out / "sft"))),
        Stage("eval_sft", completion(eval_sft),
              functools.partial(policy_lib.run, eval_config(config, data_dir, out / "sft", ""), eval_sft)),
        samples_stage(config, data_dir, out),
        confidence_stage(out, write_prm_data),
        Stage("prm", completion(out / "prm"), functools.partial(prm_trainer.run, configs["prm"], str(out / "prm"))),
        pick_stage(config, data_dir, train_samples, out),
        Stage("rerank_sft", Reranked(completion(eval_sft)),
              functools.partial(rerank_saved_samples, config, data_dir, eval_sft, out / "prm")),
    ]
    for name, grpo_config in configs["grpo"].items():
        policy = out / "grpo" / name
        work += [Stage("grpo", completion(policy), functools.partial(rl_trainer.run, grpo_config, str(policy))),
                 Stage("eval", completion(out / "eval" / name),
                       functools.partial(policy_lib.run, eval_config(config, data_dir, policy, str(out / "prm")),
                                         out / "eval" / name))]
    return with_report(work, clock, functools.partial(collect, config, out),
                       lambda results, order: report.write_miniature_report(config, results, out, order))


def run(config: ConfigDict, workdir: str) -> dict:
    return run_experiment(functools.partial(stages, config), workdir, summary_lib.reproduce_run)


def eval_examples(config: ConfigDict, data_dir: pathlib.Path, eval_dir: pathlib.Path) -> list:
    """The examples an evaluation in ``eval_dir`` scored (its split, subset and the policy's schema text)."""
    results = json.loads((eval_dir / "results.json").read_text())
    ec = results["config"]
    with Executors(policy_lib.database_dir(data_dir), timeout_s=config.eval.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, ec["data"]["split"], results["schema_values"], executors,
                                                 ec["data"]["num_examples"], ec["seed"])
    return examples


def rerank_saved_samples(config: ConfigDict, data_dir: pathlib.Path, eval_dir: pathlib.Path, prm_dir: pathlib.Path
                         ) -> dict:
    """Adds PRM best-of-k to an evaluation whose samples were drawn before the PRM existed."""
    results = json.loads((eval_dir / "results.json").read_text())
    rows = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines()]
    examples = eval_examples(config, data_dir, eval_dir)
    if [ex.question for ex in examples] != [r["question"] for r in rows]:
        raise RuntimeError(f"{eval_dir}: its predictions no longer match the examples of {data_dir}")
    e = config.eval
    mesh, rules = loop.mesh_and_rules(e)
    scorer = prm_scorer(config, prm_dir, mesh, rules)
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors, jax.set_mesh(mesh):
        metrics, new_rows = policy_lib.score_examples(
            examples, [r["greedy"] for r in rows], [r["samples"] for r in rows], executors,
            semantics=results["config"]["data"]["semantics"], prm_scores=scorer.score_queries,
            aggregates=tuple(e.prm.aggregates))
    results.update(metrics=metrics, prm=str(prm_dir))
    write_jsonl(eval_dir / "predictions.jsonl", new_rows)
    (eval_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


# -- results

def collect(config: ConfigDict, out: pathlib.Path) -> dict:
    """results.json's content from the stages' own results files."""
    prm = json.loads((out / "prm" / "results.json").read_text())
    # Empty when no held-out sample both failed and parsed (a policy that writes only garbage).
    localization = prm.get("localization", {})
    if "prm" not in localization:
        log.warning("%s: no held-out failed sample could be localised; Table 1 stays empty", out / "prm")
    evals = {"sft": [json.loads((out / "eval" / "sft" / "results.json").read_text())]}
    for variant in config.variants:
        evals[variant] = [json.loads((out / "eval" / run_name(variant, s) / "results.json").read_text())
                          for s in config.seeds]
    pick = json.loads((out / "rerank_pick.json").read_text()) if (out / "rerank_pick.json").exists() else None
    if config.report.rerank == "train":
        if pick is None:
            raise FileNotFoundError(f"{out / 'rerank_pick.json'} is missing: report.rerank='train' needs the pick stage")
        how = pick["picked"]
    else:
        how = config.report.rerank
    selectors = [s for s in rerankers(config) if all(s in r["metrics"].get("prm", {}) for runs in evals.values()
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
    grpo_runs = [v for v in config.variants if v in ex]
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
        "prm_init": config.prm_init,
        "ex": report.summary(ex),
        "mv8": report.summary(mv),
        "rerank8": rerank,
        "oracle8": report.summary(per_policy(lambda m: m["oracle"])),
        "rerank_aggregate": how,
        "rerank_pick": pick,
        "paired_differences": paired,
        "k": config.eval.sampling.k,
        "n_eval_questions": evals["sft"][0]["n"],
        "seeds": list(config.seeds),
        "grpo_steps": config.grpo.optim.total_steps,
        "curves": grpo_curves(config, out),
    }


def grpo_curves(config: ConfigDict, out: pathlib.Path) -> dict[str, dict[str, list[float]]]:
    """Per variant: rollout reward and EX by step, averaged over seeds."""
    curves = {}
    for variant in config.variants:
        runs = [read_metrics(out / "grpo" / run_name(variant, s) / "metrics.jsonl") for s in config.seeds]
        steps = sorted({r["step"] for rows in runs for r in rows if "rollout/ex" in r})
        curves[variant] = {"step": steps}
        for key in ("rollout/ex", "rollout/reward_mean"):
            curves[variant][key] = [float(np.mean([r[key] for rows in runs for r in rows
                                                   if r.get("step") == step and key in r])) for step in steps]
    return curves
