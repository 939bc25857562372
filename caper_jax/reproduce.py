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
    samples/train.jsonl      k samples per training question of the SFT policy
    prm_data/                the world's files + those samples as predictions_{train,dev}.jsonl
    prm/                     Clause-PRM trained on the annotated samples (+ gold fault injection),
                             localisation on the held-out FAILED samples (caper_jax.prm.trainer)
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
from typing import Any, Iterator

import jax
import numpy as np
from ml_collections import ConfigDict

from caper_jax.parallel import multihost

log = logging.getLogger("caper_jax")

VARIANTS = ("sparse", "token", "clause")
STAGE_ORDER = ("world", "sft", "eval_sft", "samples", "prm", "rerank_sft", "grpo", "eval", "report")


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
    from caper_jax.evaluate import validate_eval_config
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
    if config.report.rerank not in tuple(config.eval.prm.aggregates):
        raise ValueError(f"report.rerank={config.report.rerank!r} is not in eval.prm.aggregates "
                         f"{tuple(config.eval.prm.aggregates)}")
    placeholder = pathlib.Path("/nonexistent")
    configs = stage_configs(config, placeholder, placeholder, "tokenizer")
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


def prepare_data(config: ConfigDict, out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(Spider-layout data dir, tokenizer dir): the demo world built under ``out/world``, or data.dir."""
    from caper_jax.data.world import prepare_world

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
    from caper_jax.data.prompts import policy_prompt
    from caper_jax.eval import policy as policy_lib
    from caper_jax.parallel import mesh as mesh_lib
    from caper_jax.sql.execution import Executors

    e = config.eval
    mesh = mesh_lib.make_mesh(e.mesh_shape.to_dict())
    rules = tuple(tuple(r) for r in e.sharding_rules)
    policy = policy_lib.load_policy(policy_dir, mesh, rules)
    schema_values = (policy.train_config or {}).get("data", {}).get("schema_values", 0)
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, config.sft.data.train_split, schema_values, executors,
                                                 config.samples.train_questions, config.seed)
    prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]
    s = e.sampling
    with jax.set_mesh(mesh):
        _, samples = policy_lib.decode(policy, prompts, k=s.k, temperature=s.temperature, top_p=s.top_p,
                                       top_k=s.top_k, max_prompt_len=s.max_prompt_len,
                                       max_new_tokens=s.max_new_tokens, batch_size=s.batch_size,
                                       seed=config.seed, greedy=False)
    records = [{"db_id": ex.db_id, "question": ex.question, "gold": ex.sql, "pred": sql}
               for ex, group in zip(examples, samples) for sql in unique(group)]
    write_jsonl(out_path, records)
    return len(records)


def build_prm_data(data_dir: pathlib.Path, train_samples: pathlib.Path, eval_predictions: pathlib.Path,
                   out: pathlib.Path, train_split: str, eval_split: str) -> None:
    """A Spider-layout view of the world whose predictions are the SFT policy's samples.

    The world's files are linked, not copied; its own ``predictions_*.jsonl`` (the demo world's
    simulated failures) are left out, so the PRM learns from the policy's trajectories only.
    """
    out.mkdir(parents=True, exist_ok=True)
    for entry in data_dir.iterdir():
        if entry.name.startswith("predictions_") or entry.name == "manifest.json":
            continue
        link = out / entry.name
        if not link.exists():
            link.symlink_to(entry.resolve())
    (out / f"predictions_{train_split}.jsonl").write_text(train_samples.read_text())
    records = []
    for line in eval_predictions.read_text().splitlines():
        row = json.loads(line)
        records += [{"db_id": row["db_id"], "question": row["question"], "gold": row["gold"], "pred": sql}
                    for sql in unique(row.get("samples", []))]
    write_jsonl(out / f"predictions_{eval_split}.jsonl", records)


def rerank_saved_samples(config: ConfigDict, data_dir: pathlib.Path, eval_dir: pathlib.Path, prm_dir: pathlib.Path
                         ) -> dict:
    """Adds PRM best-of-k to an evaluation whose samples were drawn before the PRM existed."""
    from caper_jax.eval import policy as policy_lib
    from caper_jax.parallel import mesh as mesh_lib
    from caper_jax.prm.scoring import load_scorer
    from caper_jax.sql.execution import Executors

    results = json.loads((eval_dir / "results.json").read_text())
    rows = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines()]
    ec = results["config"]
    e = config.eval
    mesh = mesh_lib.make_mesh(e.mesh_shape.to_dict())
    rules = tuple(tuple(r) for r in e.sharding_rules)
    scorer = load_scorer(prm_dir, mesh=mesh, rules=rules, batch_size=e.prm.batch_size, max_len=e.prm.max_len or None)
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, ec["data"]["split"], results["schema_values"], executors,
                                                 ec["data"]["num_examples"], ec["seed"])
        if [ex.question for ex in examples] != [r["question"] for r in rows]:
            raise RuntimeError(f"{eval_dir}: its predictions no longer match the examples of {data_dir}")
        with jax.set_mesh(mesh):
            metrics, new_rows = policy_lib.score_examples(
                examples, [r["greedy"] for r in rows], [r["samples"] for r in rows], executors,
                semantics=ec["data"]["semantics"], prm_scores=scorer.score_queries,
                aggregates=tuple(e.prm.aggregates))
    results.update(metrics=metrics, prm=str(prm_dir))
    write_jsonl(eval_dir / "predictions.jsonl", new_rows)
    (eval_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def run(config: ConfigDict, workdir: str) -> dict:
    from caper_jax.eval import policy as policy_lib
    from caper_jax.prm import trainer as prm_trainer
    from caper_jax.rl import trainer as rl_trainer
    from caper_jax.sft import trainer as sft_trainer

    out = pathlib.Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    # Nine GRPO runs and ten evaluations compile the same programs again and again; XLA's
    # persistent cache turns every compile after the first into a lookup.
    jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    clock = StageClock(out / "stage_seconds.json")

    with clock("world"):
        data_dir, tokenizer_dir = prepare_data(config, out)
    configs = stage_configs(config, out, data_dir, tokenizer_dir)
    with clock("sft"):
        if not done(out / "sft"):
            sft_trainer.run(configs["sft"], str(out / "sft"))
    with clock("eval_sft"):
        if not done(out / "eval" / "sft"):
            policy_lib.run(eval_config(config, data_dir, out / "sft", ""), out / "eval" / "sft")
    with clock("samples"):
        train_samples = out / "samples" / "train.jsonl"
        if not train_samples.exists():
            n = sample_train_questions(config, data_dir, out / "sft", train_samples)
            multihost.log_main("%d distinct samples of %d training questions", n, config.samples.train_questions)
    with clock("prm"):
        if not done(out / "prm"):
            build_prm_data(data_dir, train_samples, out / "eval" / "sft" / "predictions.jsonl", out / "prm_data",
                           configs["prm"].data.train_split, configs["prm"].data.eval_split)
            prm_trainer.run(configs["prm"], str(out / "prm"))
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
    how = config.report.rerank

    def per_policy(pick) -> dict[str, list[float]]:
        return {name: [float(pick(r["metrics"])) for r in runs] for name, runs in evals.items()}

    return {
        "localization_top1": localization.get("prm", {}).get("top1"),
        "localization_mrr": localization.get("prm", {}).get("mrr"),
        "localization_n": localization.get("prm", {}).get("n", 0),
        "baselines": {m: {"top1": s["top1"], "mrr": s["mrr"]} for m, s in localization.items() if m != "prm"},
        "localization_per_clause": {m: s["per_clause"] for m, s in localization.items()},
        "pair_accuracy": prm["metrics"].get("eval/pair_accuracy"),
        "ex": summary(per_policy(lambda m: m["greedy"])),
        "mv8": summary(per_policy(lambda m: m["majority_vote"])),
        "rerank8": summary(per_policy(lambda m: m["prm"][how])),
        "oracle8": summary(per_policy(lambda m: m["oracle"])),
        "rerank_aggregate": how,
        "k": config.eval.sampling.k,
        "n_eval_questions": evals["sft"][0]["n"],
        "seeds": list(config.seeds),
        "grpo_steps": config.grpo.optim.total_steps,
        "curves": grpo_curves(config, out),
    }


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
        f"{results['localization_n']} failed samples of the SFT policy on held-out questions; the true root "
        "clause is the annotator's counterfactual localisation; clauses ranked by score, lowest first.\n",
        "| method | top-1 | MRR |", "|---|---|---|",
        *([f"| Clause-PRM | {100 * results['localization_top1']:.1f} | {100 * results['localization_mrr']:.1f} |"]
          if results["localization_n"] else []),
        *[f"| {m} | {100 * b['top1']:.1f} | {100 * b['mrr']:.1f} |" for m, b in results["baselines"].items()],
        f"\nHeld-out pairwise accuracy of the PRM: {100 * (results['pair_accuracy'] or float('nan')):.1f} %. "
        "Per clause: `localization_per_clause.png`, `prm/localization.md`.\n",
        "## Table 2 — execution accuracy (%) of the policies\n",
        f"| policy | greedy EX | MV@{k} | PRM best-of-{k} ({how}) | oracle@{k} |", "|---|---|---|---|---|",
        *[f"| {label[n]} | {_pm(results['ex'][n])} | {_pm(results['mv8'][n])} | {_pm(results['rerank8'][n])} | "
          f"{_pm(results['oracle8'][n])} |" for n in names],
        "\n## Table 3 — PRM reranking against majority vote\n",
        f"| policy | MV@{k} | PRM best-of-{k} | Δ (EX points) |", "|---|---|---|---|",
        *[f"| {n} | {100 * results['mv8'][n]['mean']:.1f} | {100 * results['rerank8'][n]['mean']:.1f} | "
          f"{100 * (results['rerank8'][n]['mean'] - results['mv8'][n]['mean']):+.1f} |" for n in names],
        "\nTraining curves per variant (mean over seeds): `grpo_curves.png`.\n",
        "## What the numbers can say\n",
        *reading(results, config),
        "\n## Wall time per stage (s)\n",
        "| stage | seconds |", "|---|---|",
        *[f"| {s} | {results['seconds'][s]:.0f} |" for s in STAGE_ORDER if s in results["seconds"]],
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def reading(results: dict, config: ConfigDict) -> list[str]:
    """Differences the tables imply, with the resolution of the evaluation next to them."""
    n = results["n_eval_questions"]
    lines = [f"- One held-out question is {100 / n:.2f} EX points (n = {n}); a binomial standard error at "
             f"30 % EX is ±{100 * (0.3 * 0.7 / n) ** 0.5:.1f} points."]
    ex = results["ex"]
    for variant in (v for v in config.variants if v != "clause"):
        if "clause" in ex and variant in ex:
            diffs = np.subtract(ex["clause"]["values"], ex[variant]["values"])  # paired by seed
            spread = f" ± {100 * np.std(diffs, ddof=1):.1f}" if len(diffs) > 1 else ""
            lines.append(f"- Greedy EX, clause-level minus {variant} GRPO: {100 * diffs.mean():+.1f}{spread} points "
                         f"(mean ± std of the per-seed differences, {len(diffs)} seed(s)).")
    for name in ex:
        lines.append(f"- {name}: greedy EX {100 * ex[name]['mean']:.1f}; PRM best-of-k minus MV@k "
                     f"{100 * (results['rerank8'][name]['mean'] - results['mv8'][name]['mean']):+.1f} points.")
    if results["localization_n"]:
        best = max(results["baselines"].items(), key=lambda kv: kv[1]["top1"])
        lines.append(f"- Localisation top-1, Clause-PRM minus the best baseline ({best[0]}): "
                     f"{100 * (results['localization_top1'] - best[1]['top1']):+.1f} points.")
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
