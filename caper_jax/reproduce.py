"""The miniature CAPER experiment: SFT -> sample -> annotate -> Clause-PRM -> GRPO x 3 -> evaluation.

    bash launch/reproduce_cpu.sh runs/reproduce
    python -m caper_jax.train --config=configs/reproduce.py --workdir=runs/reproduce

One process runs the stages below in order, each with the project's own trainer or evaluator (the
same code a user runs stage by stage); this module only wires their inputs and outputs and writes
the report. Every stage writes under the workdir and is skipped when its output is complete, and
the trainers resume from their checkpoints, so rerunning an interrupted command loses nothing.

    world/                   the demo world (or ``data.dir`` used in place)
    sft/                     SFT policy                          (caper_jax.sft.trainer)
    eval/sft/                greedy + k samples per held-out question, MV@k (caper_jax.eval.policy)
    samples/train.jsonl      k samples per training question of the SFT policy (distinct ones; the
                             full groups of k in train_groups.jsonl)
    prm_data/                the world's files + those samples as predictions_{train,dev}.jsonl; each
                             dev line also carries its question's k samples and the SFT policy's mean
                             log-prob per clause (the gold-free localisation baselines' inputs)
    prm/                     Clause-PRM (backbone from sft/ when prm_init="sft") trained on the annotated
                             samples (+ gold fault injection), localisation on the held-out FAILED
                             samples against every baseline (caper_jax.prm.trainer)
    rerank_pick.json         EX of every PRM reranker on a pool of TRAINING questions' samples: the one
                             the report uses (report.rerank="train") is picked here, never on test
    grpo/<variant>_s<seed>/  GRPO from the SFT policy, equal budgets (caper_jax.rl.trainer)
    eval/<variant>_s<seed>/  greedy EX, MV@k, PRM best-of-k of each GRPO policy
    results.json, results.md, grpo_curves.png, localization_per_clause.png

The held-out failures the PRM is tested on are the SFT policy's own failed samples, labelled by the
annotator's counterfactual localisation, as in the paper. All policies are sampled with the same
evaluation seed (common random numbers), so their differences are not sampling noise of the evaluation.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import pathlib
import time
from typing import AbstractSet, Any, Iterator

import jax
import numpy as np
from ml_collections import ConfigDict

from caper_jax import loop
from caper_jax.parallel import multihost
from caper_jax.rl.rewards import VARIANTS
from caper_jax.utils.subset import seeded_subset

log = logging.getLogger("caper_jax")

STAGE_ORDER = ("world", "sft", "eval_sft", "samples", "confidence", "prm", "pick", "rerank_sft", "grpo", "eval",
               "report")
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


def check_pick_held_back(config: ConfigDict) -> None:
    """Holding the pick questions back must leave the PRM some sampled training question (both pipelines)."""
    if config.report.pick_held_back and config.report.pick_questions >= config.samples.train_questions:
        raise ValueError(f"report.pick_held_back leaves the PRM no sampled question: report.pick_questions="
                         f"{config.report.pick_questions} >= samples.train_questions={config.samples.train_questions}")


def validate(config: ConfigDict) -> None:
    if config.get("pipeline", "miniature") == "spider_verifier":
        return validate_verifier(config)
    from caper_jax.eval.validate import validate_eval_config
    from caper_jax.prm import trainer as prm_trainer
    from caper_jax.rl import trainer as rl_trainer
    from caper_jax.sft import trainer as sft_trainer

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
    from caper_jax.prm import trainer as prm_trainer
    from caper_jax.rl import trainer as rl_trainer
    from caper_jax.sft import trainer as sft_trainer

    if config.get("pipeline", "miniature") == "spider_verifier":
        return {"sft": sft_trainer.dry_run(config.sft), "prm": prm_trainer.dry_run(config.prm)}
    return {"sft": sft_trainer.dry_run(config.sft), "prm": prm_trainer.dry_run(config.prm),
            "grpo": rl_trainer.dry_run(config.grpo)}


# -- stages


class StageClock:
    """Wall seconds per stage, logged as each one ends and accumulated in ``path`` across resumed runs."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:  # a stage that was already done takes no time and is not logged
            multihost.log_main("== stage %s: %.1f s", name, elapsed)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        if multihost.is_main_process():
            self.path.write_text(json.dumps(self.seconds, indent=1) + "\n")


def start_stages(out: pathlib.Path) -> StageClock:
    """The workdir, XLA's persistent compilation cache and the stage clock: the many trainer runs and
    evaluations compile the same programs again and again, and the cache turns every compile after the
    first into a lookup.

    The cache is the one the caller configured (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``), else
    ``<workdir>/jax_cache``. JAX writes the cache's own path into every program's compile options (its
    ``xla_gpu_per_fusion_autotune_cache_dir``), so entries hit only in the folder they were written in:
    a copied cache misses everything; several workdirs share compiles through one configured cache."""
    out.mkdir(parents=True, exist_ok=True)
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return StageClock(out / "stage_seconds.json")


def samples_stage(clock: StageClock, config: ConfigDict, data_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The SFT policy's k samples per training question (``sample_train_questions``), once; their path."""
    train_samples = out / "samples" / "train.jsonl"
    with clock("samples"):
        if not train_samples.exists():
            n = sample_train_questions(config, data_dir, out / "sft", train_samples)
            multihost.log_main("%d distinct samples of %d training questions", n, config.samples.train_questions)
    return train_samples


def confidence_stage(clock: StageClock, out: pathlib.Path, write_prm_data) -> None:
    """``write_prm_data()`` (prm_data/ with the SFT policy's clause confidences) before the PRM trains;
    a marker file records that it ran to the end, so an interrupted run writes it again."""
    marker = out / "prm_data" / "CONFIDENCE_DONE"
    with clock("confidence"):
        if not done(out / "prm") and not marker.exists():
            write_prm_data()
            marker.touch()


def pick_stage(clock: StageClock, config: ConfigDict, data_dir: pathlib.Path, train_samples: pathlib.Path,
               out: pathlib.Path) -> None:
    """``rerank_pick.json``: the reranker picked on training questions (``pick_reranker``), once."""
    with clock("pick"):
        if not (out / "rerank_pick.json").exists():
            pick = pick_reranker(config, data_dir, train_samples, out / "prm")
            (out / "rerank_pick.json").write_text(json.dumps(pick, indent=1) + "\n")
            multihost.log_main("reranker picked on %d training questions: %s (EX %s)", pick["n"], pick["picked"],
                               {k: round(v, 3) for k, v in pick["ex"].items()})


def prepare_data(config: ConfigDict, out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(Spider-layout data dir, tokenizer dir): the demo world built under ``out/world``, or data.dir."""
    from caper_jax.data.data_world import prepare_world

    if config.data.kind == "spider":
        return pathlib.Path(config.data.dir), config.sft.model.tokenizer_dir or config.sft.model.hf_dir
    c = copy.deepcopy(config.sft)
    c.unlock()
    c.seed, c.data.kind, c.data.dir = config.seed, "demo", str(out / "world")
    world = prepare_world(c, out)
    return world.dir, str(world.dir / "tokenizer")


def sample_train_questions(config: ConfigDict, data_dir: pathlib.Path, policy_dir: pathlib.Path,
                           out_path: pathlib.Path) -> int:
    """k samples per training question of the SFT policy (no greedy decode) -> prediction records."""
    from caper_jax.sql.contract import policy_prompt
    from caper_jax.eval import policy as policy_lib
    from caper_jax.policy import sampling
    from caper_jax.sql.execution import Executors

    e = config.eval
    mesh, rules = loop.mesh_and_rules(e)
    policy = policy_lib.load_policy(policy_dir, mesh, rules)
    schema_values = (policy.train_config or {}).get("data", {}).get("schema_values", 0)
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, config.sft.data.train_split, schema_values, executors,
                                                 config.samples.train_questions, config.seed)
    prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]
    s = e.sampling
    with jax.set_mesh(mesh):
        _, samples = sampling.decode(policy.model, policy.tokenizer, prompts, stop_tokens=(policy.stop_token,),
                                     k=s.k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                     max_prompt_len=s.max_prompt_len, max_new_tokens=s.max_new_tokens,
                                     batch_size=s.batch_size, seed=config.seed, greedy=False)
    records = [{"db_id": ex.db_id, "question": ex.question, "gold": ex.sql, "pred": sql}
               for ex, group in zip(examples, samples) for sql in unique(group)]
    # The whole groups of k (repeats included) are the pool the reranker is picked on: a vote needs them.
    write_jsonl(groups_path(out_path), [{"db_id": ex.db_id, "question": ex.question, "gold": ex.sql,
                                         "samples": list(group)} for ex, group in zip(examples, samples)])
    write_jsonl(out_path, records)
    return len(records)


def groups_path(train_samples: pathlib.Path) -> pathlib.Path:
    return train_samples.with_name("train_groups.jsonl")


def pick_groups(config: ConfigDict, train_samples: pathlib.Path) -> list[dict]:
    """The sampled training questions (whole groups of k) the reranker is picked on: a seeded subset of
    ``report.pick_questions``; with ``report.pick_held_back`` the PRM never trains on them."""
    groups = [json.loads(line) for line in groups_path(train_samples).read_text().splitlines() if line.strip()]
    return seeded_subset(groups, config.report.pick_questions, config.seed)


def held_back_questions(config: ConfigDict, train_samples: pathlib.Path) -> set[tuple[str, str, str]]:
    """(db_id, question, gold) of the pick questions when ``report.pick_held_back``, else nothing."""
    if not config.report.pick_held_back:
        return set()
    return {(g["db_id"], g["question"], g["gold"]) for g in pick_groups(config, train_samples)}


def picked_questions_note(pick: dict) -> str:
    """How the pick questions relate to the PRM's training data, for a report; a ``rerank_pick.json``
    written before the field existed was an in-sample pick."""
    return ("that the PRM never trained on " if pick.get("held_back") else
            "that also trained the PRM (in sample) ")


def build_prm_data(data_dir: pathlib.Path, train_samples: pathlib.Path, eval_predictions: pathlib.Path,
                   out: pathlib.Path, train_split: str, eval_split: str,
                   held_back: AbstractSet[tuple[str, str, str]] = frozenset()) -> None:
    """A Spider-layout view of the world whose predictions are the SFT policy's samples.

    The world's files are linked, not copied; its own ``predictions_*.jsonl`` (the demo world's
    simulated failures) are left out, so the PRM learns from the policy's trajectories only.
    ``held_back`` (db_id, question, gold) training questions are left out of both the samples and the
    training split's golds (no fault injection of them either): the PRM never sees them, so a choice
    made on them is out of sample.
    """
    out.mkdir(parents=True, exist_ok=True)
    split_file = out / f"{train_split}.json"
    for entry in data_dir.iterdir():
        if entry.name.startswith("predictions_") or entry.name == "manifest.json":
            continue
        link = out / entry.name
        if held_back and link == split_file:
            continue
        if not link.exists():
            link.symlink_to(entry.resolve())
    if not held_back:
        (out / f"predictions_{train_split}.jsonl").write_text(train_samples.read_text())
    else:
        questions = json.loads((data_dir / split_file.name).read_text())
        kept = [q for q in questions if (q["db_id"], q["question"], q["query"]) not in held_back]
        if split_file.is_symlink():   # a view built before without held_back: writing through it would edit the world
            split_file.unlink()
        split_file.write_text(json.dumps(kept, indent=1) + "\n")
        samples = [json.loads(line) for line in train_samples.read_text().splitlines() if line.strip()]
        write_jsonl(out / f"predictions_{train_split}.jsonl",
                    [r for r in samples if (r["db_id"], r["question"], r["gold"]) not in held_back])
    records = []
    for line in eval_predictions.read_text().splitlines():
        row = json.loads(line)
        # "samples": the question's k samples, read by the sample-disagreement baseline.
        records += [{"db_id": row["db_id"], "question": row["question"], "gold": row["gold"], "pred": sql,
                     "samples": list(row.get("samples", []))}
                    for sql in unique(row.get("samples", []))]
    write_jsonl(out / f"predictions_{eval_split}.jsonl", records)


def eval_examples(config: ConfigDict, data_dir: pathlib.Path, eval_dir: pathlib.Path) -> list:
    """The examples an evaluation in ``eval_dir`` scored (its split, subset and the policy's schema text)."""
    from caper_jax.eval import policy as policy_lib
    from caper_jax.sql.execution import Executors

    results = json.loads((eval_dir / "results.json").read_text())
    ec = results["config"]
    with Executors(policy_lib.database_dir(data_dir), timeout_s=config.eval.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, ec["data"]["split"], results["schema_values"], executors,
                                                 ec["data"]["num_examples"], ec["seed"])
    return examples


def prm_scorer(config: ConfigDict, prm_dir: pathlib.Path, mesh, rules):
    """The Clause-PRM of ``prm_dir`` as the evaluation scores with it (``config.eval.prm``'s batch and length)."""
    from caper_jax.prm.scoring import load_scorer

    e = config.eval
    return load_scorer(prm_dir, mesh=mesh, rules=rules, batch_size=e.prm.batch_size, max_len=e.prm.max_len or None)


def add_policy_confidence(config: ConfigDict, examples: list, policy_dir: pathlib.Path,
                          predictions: pathlib.Path) -> None:
    """Adds ``clause_logprob`` (the policy's mean token log-prob per clause, ``caper_jax.eval.confidence``)
    to every line of a predictions file: the confidence baseline's input. ``examples`` give each line's
    prompt as the policy reads it (its schema text); a line whose question is not among them is an error."""
    from caper_jax.eval import policy as policy_lib
    from caper_jax.eval.confidence import clause_logprobs

    e = config.eval
    mesh, rules = loop.mesh_and_rules(e)
    policy = policy_lib.load_policy(policy_dir, mesh, rules)
    by_question = {(ex.db_id, ex.question, ex.sql): ex for ex in examples}
    records = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()]
    rows = []
    for r in records:
        ex = by_question.get((r["db_id"], r["question"], r["gold"]))
        if ex is None:
            raise RuntimeError(f"{predictions}: the question {r['question']!r} is not among the examples it was "
                               "sampled for")
        rows.append({"question": ex.question, "schema": ex.schema, "evidence": ex.evidence, "sql": r["pred"]})
    with jax.set_mesh(mesh):
        values = clause_logprobs(policy, rows, max_len=e.sampling.max_prompt_len + e.sampling.max_new_tokens + 1,
                                 batch_size=e.sampling.batch_size)
    for r, v in zip(records, values):
        r["clause_logprob"] = v
    write_jsonl(predictions, records)


def rerankers(config: ConfigDict) -> tuple[str, ...]:
    """Every PRM reranker the evaluation reports: best-of-k per aggregate, then the weighted vote per aggregate."""
    aggregates = tuple(config.eval.prm.aggregates)
    return aggregates + tuple(f"vote_{how}" for how in aggregates)


def pick_reranker(config: ConfigDict, data_dir: pathlib.Path, train_samples: pathlib.Path, prm_dir: pathlib.Path
                  ) -> dict:
    """EX of every PRM reranker on the SFT policy's samples of up to ``report.pick_questions`` TRAINING
    questions (the groups of k ``sample_train_questions`` drew), and the best of them (ties: the first in
    ``rerankers`` order). The test split never takes part in the choice."""
    from caper_jax.eval import policy as policy_lib
    from caper_jax.sql.execution import Executors

    e = config.eval
    groups = pick_groups(config, train_samples)
    mesh, rules = loop.mesh_and_rules(e)
    scorer = prm_scorer(config, prm_dir, mesh, rules)
    schema_values = config.sft.data.get("schema_values", 0)
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, config.sft.data.train_split, schema_values, executors,
                                                 0, config.seed)
        by_question = {(ex.db_id, ex.question, ex.sql): ex for ex in examples}
        groups = [g for g in groups if (g["db_id"], g["question"], g["gold"]) in by_question]
        chosen = [by_question[g["db_id"], g["question"], g["gold"]] for g in groups]
        with jax.set_mesh(mesh):
            metrics, _ = policy_lib.score_examples(
                chosen, [g["samples"][0] for g in groups], [g["samples"] for g in groups], executors,
                semantics=e.data.semantics, prm_scores=scorer.score_queries, aggregates=tuple(e.prm.aggregates))
    ex = metrics["prm"]
    picked = max(rerankers(config), key=lambda how: (ex[how], -rerankers(config).index(how)))
    return {"split": config.sft.data.train_split, "n": len(groups), "k": e.sampling.k, "ex": ex,
            "majority_vote": metrics["majority_vote"], "oracle": metrics["oracle"], "picked": picked,
            "held_back": bool(config.report.pick_held_back)}


def rerank_saved_samples(config: ConfigDict, data_dir: pathlib.Path, eval_dir: pathlib.Path, prm_dir: pathlib.Path
                         ) -> dict:
    """Adds PRM best-of-k to an evaluation whose samples were drawn before the PRM existed."""
    from caper_jax.eval import policy as policy_lib
    from caper_jax.sql.execution import Executors

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


def run(config: ConfigDict, workdir: str) -> dict:
    if config.get("pipeline", "miniature") == "spider_verifier":
        return run_verifier(config, workdir)
    from caper_jax.eval import policy as policy_lib
    from caper_jax.prm import trainer as prm_trainer
    from caper_jax.rl import trainer as rl_trainer
    from caper_jax.sft import trainer as sft_trainer

    started = time.perf_counter()
    out = pathlib.Path(workdir)
    clock = start_stages(out)

    with clock("world"):
        data_dir, tokenizer_dir = prepare_data(config, out)
    configs = stage_configs(config, out, data_dir, tokenizer_dir)
    with clock("sft"):
        if not done(out / "sft"):
            sft_trainer.run(configs["sft"], str(out / "sft"))
    with clock("eval_sft"):
        if not done(out / "eval" / "sft"):
            policy_lib.run(eval_config(config, data_dir, out / "sft", ""), out / "eval" / "sft")
    train_samples = samples_stage(clock, config, data_dir, out)

    def write_prm_data():
        build_prm_data(data_dir, train_samples, out / "eval" / "sft" / "predictions.jsonl", out / "prm_data",
                       configs["prm"].data.train_split, configs["prm"].data.eval_split,
                       held_back_questions(config, train_samples))
        add_policy_confidence(config, eval_examples(config, data_dir, out / "eval" / "sft"), out / "sft",
                              out / "prm_data" / f"predictions_{configs['prm'].data.eval_split}.jsonl")

    confidence_stage(clock, out, write_prm_data)
    with clock("prm"):
        if not done(out / "prm"):
            prm_trainer.run(configs["prm"], str(out / "prm"))
    pick_stage(clock, config, data_dir, train_samples, out)
    with clock("rerank_sft"):
        if "prm" not in json.loads((out / "eval" / "sft" / "results.json").read_text())["metrics"]:
            rerank_saved_samples(config, data_dir, out / "eval" / "sft", out / "prm")
    for name, grpo_config in configs["grpo"].items():
        with clock("grpo"):
            if not done(out / "grpo" / name):
                rl_trainer.run(grpo_config, str(out / "grpo" / name))
        with clock("eval"):
            if not done(out / "eval" / name):
                policy_lib.run(eval_config(config, data_dir, out / "grpo" / name, str(out / "prm")),
                               out / "eval" / name)
    with clock("report"):
        results = collect(config, out)
        results["seconds"] = dict(clock.seconds)
        write_report(config, results, out)
    multihost.log_main("results: %s", out / "results.md")
    from caper_jax.utils import summary as summary_lib

    summary_lib.reproduce_run(results, out, time.perf_counter() - started)
    return results


# -- results


def collect(config: ConfigDict, out: pathlib.Path) -> dict:
    """results.json's content from the stages' own results files."""
    from caper_jax.prm.localization import SEES_GOLD, best_fair_baseline

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
    rerank = {sel: summary(per_policy(lambda m, sel=sel: m["prm"][sel])) for sel in selectors}
    paired: dict[str, dict] = {"greedy_ex": {}, "rerank_minus_mv": {}}
    for other in ("sparse", "token"):
        if "clause" in ex and other in ex:
            paired["greedy_ex"][f"clause-{other}"] = paired_interval(ex["clause"], ex[other])   # paired by seed
    for name in ex:
        paired["rerank_minus_mv"][name] = paired_interval(rerank[how][name]["values"], mv[name])
    grpo_runs = [v for v in config.variants if v in ex]
    paired["rerank_minus_mv_grpo_pooled"] = paired_interval(
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
        "ex": summary(ex),
        "mv8": summary(mv),
        "rerank8": rerank,
        "oracle8": summary(per_policy(lambda m: m["oracle"])),
        "rerank_aggregate": how,
        "rerank_pick": pick,
        "paired_differences": paired,
        "k": config.eval.sampling.k,
        "n_eval_questions": evals["sft"][0]["n"],
        "seeds": list(config.seeds),
        "grpo_steps": config.grpo.optim.total_steps,
        "curves": grpo_curves(config, out),
    }


def paired_interval(a: list[float], b: list[float], confidence: float = 0.95) -> dict:
    """Mean of the paired differences a - b with its two-sided t-interval over the pairs (None below 2 pairs)."""
    from scipy import stats

    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    d = np.subtract(a, b, dtype=np.float64)
    n = len(d)
    out = {"mean": float(d.mean()) if n else float("nan"), "n": n, "values": d.tolist(), "lo": None, "hi": None,
           "confidence": confidence}
    if n >= 2:
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * d.std(ddof=1) / np.sqrt(n))
        out.update(lo=out["mean"] - half, hi=out["mean"] + half)
    return out


def summary(values: dict[str, list[float]]) -> dict[str, dict]:
    """Per policy: mean, sample std over seeds (0 for one run) and the per-seed values."""
    return {name: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                   "values": v} for name, v in values.items()}


def grpo_curves(config: ConfigDict, out: pathlib.Path) -> dict[str, dict[str, list[float]]]:
    """Per variant: rollout reward and EX by step, averaged over seeds."""
    from caper_jax.utils.monitoring import read_metrics

    curves = {}
    for variant in config.variants:
        runs = [read_metrics(out / "grpo" / run_name(variant, s) / "metrics.jsonl") for s in config.seeds]
        steps = sorted({r["step"] for rows in runs for r in rows if "rollout/ex" in r})
        curves[variant] = {"step": steps}
        for key in ("rollout/ex", "rollout/reward_mean"):
            curves[variant][key] = [float(np.mean([r[key] for rows in runs for r in rows
                                                   if r.get("step") == step and key in r])) for step in steps]
    return curves


def _pm(entry: dict) -> str:
    return f"{100 * entry['mean']:.1f} ± {100 * entry['std']:.1f}"


def write_report(config: ConfigDict, results: dict, out: pathlib.Path) -> None:
    from caper_jax.utils.monitoring import plot_bars

    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot_grpo_curves(results["curves"], out / "grpo_curves.png")
    if results["localization_n"]:
        groups = {m: {"all": (results["localization_top1"] if m == "prm" else results["baselines"][m]["top1"]),
                      **{c: v["top1"] for c, v in per.items()}}
                  for m, per in results["localization_per_clause"].items()}
        plot_bars(groups, out / "localization_per_clause.png",
                  title="Root-cause localisation top-1 by true clause", ylabel="top-1")
    k, how = results["k"], results["rerank_aggregate"]
    names = ["sft", *config.variants]
    label = {"sft": "SFT (start of every GRPO run)", "sparse": "GRPO, sparse (execution only)",
             "token": "GRPO, token-level PRM reward", "clause": "GRPO, clause-level (CAPER)"}
    seeds = len(results["seeds"])
    lines = [
        "# CAPER, miniature reproduction\n",
        f"Written by `python -m caper_jax.train --config=configs/reproduce.py` into `{out}`. Policies are "
        f"evaluated on {results['n_eval_questions']} held-out questions (unseen template × database × value "
        f"combinations), k = {k} samples each; GRPO runs {results['grpo_steps']} steps per run, {seeds} seed(s) "
        "per variant (mean ± sample std over seeds; the SFT row is one run).\n",
        "## Table 1 — root-cause localisation on held-out failures\n",
        *(localization_table(results) if results["localization_n"] else [
            "No held-out sample of the SFT policy both failed and parsed, so there is nothing to localise "
            "(a policy that writes only unparseable SQL, or too few samples, as in the `:fast` run).\n"]),
        f"\nHeld-out pairwise accuracy of the PRM: {100 * (results['pair_accuracy'] or float('nan')):.1f} %.\n",
        "## Table 2 — execution accuracy (%) of the policies\n",
        f"| policy | greedy EX | MV@{k} | PRM rerank@{k} ({how}) | oracle@{k} |", "|---|---|---|---|---|",
        *[f"| {label[n]} | {_pm(results['ex'][n])} | {_pm(results['mv8'][n])} | {_pm(results['rerank8'][how][n])} | "
          f"{_pm(results['oracle8'][n])} |" for n in names],
        "\n## Table 3 — PRM reranking against majority vote (EX %, mean over seeds)\n",
        f"Best-of-{k} by each aggregate of the clause scores, and PRM-weighted voting (`vote_*`: the result class "
        "with the largest sum of its members' sigmoid(score)). The reranker the other tables use, "
        f"`{how}`, was " + (f"picked on {results['rerank_pick']['n']} TRAINING questions' samples "
                             f"{picked_questions_note(results['rerank_pick'])}(`rerank_pick.json`), never on these."
                             if results["rerank_pick"] and
                             results["rerank_pick"]["picked"] == how else "fixed by report.rerank.") + "\n",
        f"| policy | MV@{k} | " + " | ".join(results["rerank8"]) + " |", "|---|---|" + "---|" * len(results["rerank8"]),
        *[f"| {n} | {100 * results['mv8'][n]['mean']:.1f} | " + " | ".join(
            f"{100 * r[n]['mean']:.1f} ({100 * (r[n]['mean'] - results['mv8'][n]['mean']):+.1f})"
            for r in results["rerank8"].values()) + " |" for n in names],
        "\nTraining curves per variant (mean over seeds): `grpo_curves.png`.\n",
        "## What the numbers can say\n",
        *reading(results, config),
        "\n## Which of the paper's three claims this run supports\n",
        *claims(results),
        "\n## Wall time per stage (s)\n",
        "| stage | seconds |", "|---|---|",
        *[f"| {s} | {results['seconds'][s]:.0f} |" for s in STAGE_ORDER if s in results["seconds"]],
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def localization_table(results: dict) -> list[str]:
    """Table 1 of results.md: the PRM and every baseline on the SFT policy's held-out failures."""
    return [
        f"{results['localization_n']} failed samples of the SFT policy on held-out questions; the true root "
        "clause is the annotator's counterfactual localisation; clauses ranked by score, lowest first.\n",
        "| method | sees gold | top-1 | MRR |", "|---|---|---|---|",
        f"| Clause-PRM | no | {100 * results['localization_top1']:.1f} | {100 * results['localization_mrr']:.1f} |",
        *[f"| {m} | {'**yes** (reference only)' if b['sees_gold'] else 'no'} | {100 * b['top1']:.1f} | "
          f"{100 * b['mrr']:.1f} |" for m, b in results["baselines"].items()],
        "\nA row that sees gold cannot run at inference time; the PRM is measured against the best row that "
        f"does not (`{results['best_fair_baseline']}`). confidence: the SFT policy's lowest mean clause "
        "log-prob; disagreement: the clause the question's k samples agree on least (canonical forms).\n",
        "Per clause: `localization_per_clause.png`, `prm/localization.md`.\n",
    ]


def reading(results: dict, config: ConfigDict) -> list[str]:
    """Differences the tables imply, with the resolution of the evaluation next to them."""
    n = results["n_eval_questions"]
    lines = [f"- One held-out question is {100 / n:.2f} EX points (n = {n}); a binomial standard error at "
             f"30 % EX is ±{100 * (0.3 * 0.7 / n) ** 0.5:.1f} points."]
    for key, d in results["paired_differences"]["greedy_ex"].items():
        lines.append(f"- Greedy EX, {key.replace('-', ' minus ')} GRPO: {_interval(d)} (paired by seed).")
    for name, d in results["paired_differences"]["rerank_minus_mv"].items():
        lines.append(f"- {name}: greedy EX {100 * results['ex'][name]['mean']:.1f}; PRM rerank "
                     f"({results['rerank_aggregate']}) minus MV@k {_interval(d)}.")
    return lines


def _interval(d: dict) -> str:
    """'+1.2 points [95 % t-interval -0.3, +2.7] over n pairs', or the mean alone for one pair."""
    if d["lo"] is None:
        return f"{100 * d['mean']:+.1f} points ({d['n']} run(s); no interval)"
    return (f"{100 * d['mean']:+.1f} points [{round(100 * d['confidence'])} % t-interval {100 * d['lo']:+.1f}, "
            f"{100 * d['hi']:+.1f}] over {d['n']} pairs")


def claims(results: dict) -> list[str]:
    """The paper's three claims in words: supported, not shown, or contradicted, and how surely."""
    lines = []
    n = results["localization_n"]
    fair = results["best_fair_baseline"]
    if n and fair:
        p, b = results["localization_top1"], results["baselines"][fair]["top1"]
        # Unpaired two-proportion standard error: conservative, as the per-case pairing is not kept here.
        se = float(np.sqrt(p * (1 - p) / n + b * (1 - b) / n))
        diff = p - b
        verdict = ("supported" if diff - 1.96 * se > 0 else "contradicted" if diff + 1.96 * se < 0 else "not shown")
        target = "meets" if p >= 0.8453 and results["localization_mrr"] >= 0.9060 else "misses"
        lines.append(f"1. **The Clause-PRM localises root causes better than gold-free methods**: {verdict}. "
                     f"Top-1 {100 * p:.1f} % vs {100 * b:.1f} % for the best baseline that does not see gold "
                     f"({fair}), {100 * diff:+.1f} points, approximate 95 % interval ±{196 * se:.1f} (n = {n}). "
                     f"It {target} the paper's 84.53 % top-1 / 90.60 % MRR (here {100 * p:.1f} / "
                     f"{100 * results['localization_mrr']:.1f}).")
    else:
        lines.append("1. **Localisation**: no held-out failure could be localised; nothing to say.")
    greedy = results["paired_differences"]["greedy_ex"]
    parts = []
    for key, d in greedy.items():
        if d["lo"] is None:
            parts.append(f"{key}: {_interval(d)} — one seed cannot say")
        else:
            state = "above, interval excludes 0" if d["lo"] > 0 else "below, interval excludes 0" if d["hi"] < 0 \
                else "interval includes 0"
            parts.append(f"{key}: {_interval(d)} ({state})")
    if greedy:
        los = [d["lo"] for d in greedy.values()]
        verdict = ("supported" if all(lo is not None and lo > 0 for lo in los) else
                   "contradicted" if any(d["hi"] is not None and d["hi"] < 0 for d in greedy.values()) else "not shown")
        lines.append(f"2. **Clause-level GRPO beats sparse and token-level GRPO in EX**: {verdict}. " + "; ".join(parts) + ".")
    else:
        lines.append("2. **Clause-level GRPO vs sparse/token**: the run lacks the variants to compare.")
    pooled = results["paired_differences"]["rerank_minus_mv_grpo_pooled"]
    sft = results["paired_differences"]["rerank_minus_mv"].get("sft")
    how = results["rerank_aggregate"]
    if pooled["n"]:
        verdict = ("supported" if pooled["lo"] is not None and pooled["lo"] > 0 else
                   "contradicted" if pooled["hi"] is not None and pooled["hi"] < 0 else "not shown")
        target = "meets" if pooled["mean"] >= 0.007 else "misses"
        lines.append(f"3. **PRM reranking beats majority vote**: {verdict} for the reranker `{how}`. Over the GRPO "
                     f"policies' runs: {_interval(pooled)}; SFT policy: {_interval(sft) if sft else 'n/a'}. It "
                     f"{target} the paper's +0.7 to +1.6 points. Every reranker is in Table 3.")
    elif sft:
        lines.append(f"3. **PRM reranking beats majority vote**: SFT policy only, {_interval(sft)}: one run cannot say.")
    return lines


def plot_grpo_curves(curves: dict, out_png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("rollout/reward_mean", "rollout/ex")
    fig, axes = plt.subplots(1, len(keys), figsize=(9, 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for variant, c in curves.items():
            ax.plot(c["step"], c[key], label=variant, marker=".")
        ax.set_xlabel("GRPO step")
        ax.set_title(key + " (mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


# -- small helpers


def done(stage_dir: pathlib.Path) -> bool:
    """A stage is complete once it has written its results.json (the last thing each one writes)."""
    return (stage_dir / "results.json").is_file()


def unique(items: list[str]) -> list[str]:
    """Distinct non-empty strings, first occurrence order: repeated samples would weigh a question twice."""
    return list(dict.fromkeys(s for s in items if s.strip()))


def write_jsonl(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)


# -- the plug-and-play verifier on real candidates (configs/spider_verifier.py; issue 21 item 5)

VERIFIER_STAGES = ("view", "sft", "samples", "confidence", "prm", "pick", "verify", "report")


def validate_verifier(config: ConfigDict) -> None:
    from caper_jax.prm import trainer as prm_trainer
    from caper_jax.sft import trainer as sft_trainer

    for key in ("spider_dir", "predictions_dir"):
        if not pathlib.Path(config.data[key]).is_dir():
            raise ValueError(f"data.{key}={config.data[key]!r} is not a directory")
    for name in config.data.systems:
        if not (pathlib.Path(config.data.predictions_dir) / name).is_file():
            raise ValueError(f"data.systems: {name!r} is not in {config.data.predictions_dir}")
    if config.data.train_questions < 0 or config.data.dev_questions < 0:
        raise ValueError("data.train_questions and data.dev_questions must be >= 0 (0: all)")
    if config.samples.train_questions < 1 or config.report.pick_questions < 1:
        raise ValueError("samples.train_questions and report.pick_questions must be >= 1")
    check_pick_held_back(config)
    if config.eval.sampling.k < 2:
        raise ValueError(f"eval.sampling.k must be >= 2 (a vote on the training pool), got {config.eval.sampling.k}")
    configs = verifier_configs(config, pathlib.Path("/nonexistent"))
    configs["prm"].model.init_from = ""       # the SFT run does not exist yet; the PRM trainer checks it then
    for name, check in (("sft", sft_trainer.validate), ("prm", prm_trainer.validate)):
        try:
            check(configs[name])
        except (ValueError, KeyError) as e:
            raise ValueError(f"{name}: {e}") from e


def verifier_configs(config: ConfigDict, out: pathlib.Path) -> dict:
    """SFT on the view's training questions; the PRM on prm_data/ with the SFT run as its backbone."""
    view = out / "spider"
    sft, prm = copy.deepcopy(config.sft), copy.deepcopy(config.prm)
    for c in (sft, prm):
        c.unlock()
        c.seed = config.seed
        c.data.kind = "spider"
        c.model.tokenizer_dir = str(view / "tokenizer")
    sft.data.dir = str(view)
    prm.data.dir = str(out / "prm_data")
    prm.model.init_from = str(out / "sft")
    return {"sft": sft, "prm": prm}


def build_spider_view(config: ConfigDict, view: pathlib.Path) -> dict:
    """A Spider-layout folder of links: database/ and tables.json; train.json = the training questions
    whose database is present (a seeded subset of ``data.train_questions`` when > 0, from
    train_no_db/train_spider_questions.json); dev.json = the dev questions whose database is present
    (a seeded subset of ``data.dev_questions``), each with ``source_index``, its line in the systems'
    files; and a byte-level BPE tokenizer trained on the training prompts + SQL only."""
    from caper_jax.sql.contract import policy_prompt, serialize_schema
    from caper_jax.data.spider import load_schemas
    from caper_jax.data.tokenizer import SPECIAL_TOKENS, SQL_WORDS, build_demo_tokenizer

    src = pathlib.Path(config.data.spider_dir).resolve()
    view.mkdir(parents=True, exist_ok=True)
    for name in ("database", "tables.json"):
        if not (view / name).exists():
            (view / name).symlink_to(src / name)
    present = {p.name for p in (src / "database").iterdir() if (p / f"{p.name}.sqlite").is_file()}
    rng = np.random.default_rng(config.seed)   # one stream: the dev subset is drawn after the train subset
    train = [r for r in json.loads((src / "train_no_db" / "train_spider_questions.json").read_text())
             if r["db_id"] in present]
    train = seeded_subset([{"db_id": r["db_id"], "question": r["question"], "query": r["query"]} for r in train],
                          config.data.train_questions, rng)
    dev = [dict(r, source_index=i) for i, r in enumerate(json.loads((src / "dev.json").read_text()))
           if r["db_id"] in present]
    dev = seeded_subset(dev, config.data.dev_questions, rng)
    (view / "train.json").write_text(json.dumps(train))
    (view / "dev.json").write_text(json.dumps(dev))
    schemas = load_schemas(view)
    corpus = [" ".join(SQL_WORDS), " ".join(w.lower() for w in SQL_WORDS)]
    for r in train:
        prompt = policy_prompt(r["question"], serialize_schema(schemas[r["db_id"]]))
        for special in SPECIAL_TOKENS:
            prompt = prompt.replace(special, "\n")
        corpus.append(prompt + r["query"])
    build_demo_tokenizer(view / "tokenizer", vocab_size=config.data.vocab_size, seed=config.seed, corpus=corpus)
    return {"train": len(train), "dev": len(dev), "databases": len(present)}


def system_candidates(config: ConfigDict, view: pathlib.Path) -> list[dict]:
    """Per dev question of the view: index (in the view's dev.json), db_id, question, gold, and the
    systems' predictions in ``data.systems`` order (``caper_jax.data.spider.read_sql_predictions``)."""
    from caper_jax.data.spider import load_split, read_system_predictions

    full = load_split(config.data.spider_dir, "dev")
    per_system = read_system_predictions(config.data.predictions_dir, config.data.systems, full)
    dev = json.loads((view / "dev.json").read_text())
    return [{"index": i, "db_id": r["db_id"], "question": r["question"], "gold": r["query"],
             "candidates": [preds[r["source_index"]] for preds in per_system]} for i, r in enumerate(dev)]


def run_verifier(config: ConfigDict, workdir: str) -> dict:
    """SFT -> samples -> Clause-PRM (SFT-initialised) -> localisation and reranking of six real systems."""
    from caper_jax.eval import policy as policy_lib
    from caper_jax.prm import trainer as prm_trainer
    from caper_jax.sft import trainer as sft_trainer
    from caper_jax.sql.execution import Executors
    from caper_jax.utils import summary as summary_lib

    started = time.perf_counter()
    out = pathlib.Path(workdir)
    clock = start_stages(out)
    view = out / "spider"
    configs = verifier_configs(config, out)
    with clock("view"):
        if not (view / "tokenizer" / "tokenizer.json").exists():
            multihost.log_main("Spider view: %s", build_spider_view(config, view))
    candidates = system_candidates(config, view)
    with clock("sft"):
        if not done(out / "sft"):
            sft_trainer.run(configs["sft"], str(out / "sft"))
    train_samples = samples_stage(clock, config, view, out)

    def write_prm_data():
        pools = out / "systems_dev.jsonl"   # the six systems' candidates as an evaluation's sample rows
        write_jsonl(pools, [{"db_id": c["db_id"], "question": c["question"], "gold": c["gold"],
                             "samples": c["candidates"]} for c in candidates])
        build_prm_data(view, train_samples, pools, out / "prm_data", "train", "dev",
                       held_back_questions(config, train_samples))
        with Executors(policy_lib.database_dir(view), timeout_s=config.eval.timeout_s) as executors:
            examples, _ = policy_lib.usable_examples(view, "dev", config.sft.data.schema_values, executors, 0,
                                                     config.seed)
        add_policy_confidence(config, examples, out / "sft", out / "prm_data" / "predictions_dev.jsonl")

    confidence_stage(clock, out, write_prm_data)
    with clock("prm"):
        if not done(out / "prm"):
            prm_trainer.run(configs["prm"], str(out / "prm"))
    pick_stage(clock, config, view, train_samples, out)
    with clock("verify"):
        if not verify_done(out):
            (out / "verify.json").write_text(json.dumps(verify_systems(config, view, candidates, out), indent=1) + "\n")
    with clock("report"):
        results = collect_verifier(config, out)
        results["seconds"] = dict(clock.seconds)
        write_verifier_report(results, out)
    multihost.log_main("results: %s", out / "results.md")
    summary_lib.spider_verifier_run(results, out, time.perf_counter() - started)
    return results


def verify_systems(config: ConfigDict, view: pathlib.Path, candidates: list[dict], out: pathlib.Path) -> dict:
    """EX of each system alone (``evaluate ex``) and of the pool: first, MV@n, every PRM reranker, oracle@n."""
    from caper_jax.eval import verifier
    from caper_jax.eval.ex import evaluate_ex

    pool = out / "systems_candidates.jsonl"
    write_jsonl(pool, [{"index": c["index"], "candidates": c["candidates"]} for c in candidates])
    alone = {}
    for j, name in enumerate(config.data.systems):
        path = out / "systems" / f"{name}.jsonl"
        write_jsonl(path, [{"index": c["index"], "pred": c["candidates"][j]} for c in candidates])
        alone[name] = evaluate_ex(view, "dev", path, semantics=config.verify.semantics,
                                  report=lambda message: log.info("%s", message))["ex"]
    mesh, rules = loop.mesh_and_rules(config.eval)
    scorer = prm_scorer(config, out / "prm", mesh, rules)
    with jax.set_mesh(mesh):
        summary = verifier.rerank(scorer, view, "dev", pool, aggregate="min", semantics=config.verify.semantics,
                                output=out / "verify_choices.jsonl", report=lambda message: log.info("%s", message))
    return {"alone": alone, "pool": summary}


def verify_done(out: pathlib.Path) -> bool:
    """The verify stage is complete: ``verify.json`` exists and every graded line of
    ``verify_choices.jsonl`` carries each candidate's verdict and each selector's pick. A workdir
    verified before those fields existed reruns the stage, as the paired rerank-minus-vote intervals
    of the report are computed from them."""
    choices = out / "verify_choices.jsonl"
    if not (out / "verify.json").exists() or not choices.exists():
        return False
    rows = [json.loads(line) for line in choices.read_text().splitlines() if line.strip()]
    if any(r.get("correct") is not None and "choices" not in r for r in rows):
        multihost.log_main("%s predates the per-candidate verdicts: running the verify stage again", choices)
        return False
    return True


def collect_verifier(config: ConfigDict, out: pathlib.Path) -> dict:
    from caper_jax.prm.localization import best_fair_baseline

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
        "k": len(config.data.systems),
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
        interval = paired_interval(picked, vote)
        out[selector] = {k: interval[k] for k in ("mean", "lo", "hi", "n", "confidence")}
    return out


def write_verifier_report(results: dict, out: pathlib.Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    k, how, n = results["k"], results["rerank_aggregate"], results["n_dev"]
    loc = results["localization"]
    fair = results["best_fair_baseline"]
    lines = ["# Clause-PRM as a plug-and-play verifier on Spider dev\n",
             f"Written by `python -m caper_jax.train --config=configs/spider_verifier.py` into `{out}`. The PRM "
             "is trained on Spider's training split only (fault injection on its gold + counterfactual repair of "
             "the SFT policy's failures), its backbone initialised from that SFT policy. Candidates: the "
             f"{k} published systems' predictions for {n} dev questions.\n",
             "## Localisation of the systems' real failures (annotator's root clause)\n",
             "| method | sees gold | n | top-1 | MRR |", "|---|---|---|---|---|",
             *[f"| {m} | {'**yes** (reference only)' if s['sees_gold'] else 'no'} | {s['n']} | {100 * s['top1']:.1f} | "
               f"{100 * s['mrr']:.1f} |" for m, s in loc.items()],
             "\n## EX (%) on the dev questions\n",
             "| selection | EX |", "|---|---|",
             *[f"| {name} alone | {100 * v:.1f} |" for name, v in results["ex_alone"].items()],
             f"| MV@{k} | {100 * results['mv']:.1f} |",
             *[f"| PRM {sel}@{k}{' (picked on train)' if sel == how else ''} | {100 * v:.1f} |"
               for sel, v in results["rerank"].items()],
             f"| oracle@{k} | {100 * results['oracle']:.1f} |",
             f"\nThe reranker was picked on {results['rerank_pick']['n']} training questions' samples "
             f"{picked_questions_note(results['rerank_pick'])}(`rerank_pick.json`), never on dev.",
             "\n## What it shows\n"]
    if "prm" in loc and fair:
        lines.append(f"- Localisation top-1, PRM minus the best gold-free baseline ({fair}): "
                     f"{100 * (loc['prm']['top1'] - loc[fair]['top1']):+.1f} points (n = {loc['prm']['n']}; "
                     "paper: 84.53 % top-1).")
    if n:
        paired = results["rerank_minus_mv"].get(how)
        interval = (f", 95 % interval [{100 * paired['lo']:+.1f}, {100 * paired['hi']:+.1f}] paired over the "
                    f"{paired['n']} questions" if paired and paired["lo"] is not None else "")
        lines.append(f"- PRM rerank ({how}, picked on training questions) minus MV@{k}: "
                     f"{100 * (results['rerank'][how] - results['mv']):+.1f} EX points{interval} (paper: +0.7 to "
                     f"+1.6); one question is {100 / n:.2f} points.")
        lines += ["\n## PRM rerank minus MV@k, paired per question (EX points, 95 % t-interval)\n",
                  "| selector | difference | interval |", "|---|---|---|",
                  *[f"| {sel} | {100 * d['mean']:+.1f} | [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] |"
                    for sel, d in results["rerank_minus_mv"].items() if d["lo"] is not None]]
    lines += ["\n## Wall time per stage (s)\n", "| stage | seconds |", "|---|---|",
              *[f"| {s} | {results['seconds'][s]:.0f} |" for s in VERIFIER_STAGES if s in results["seconds"]]]
    (out / "results.md").write_text("\n".join(lines) + "\n")
