"""The miniature reproduction (caper_jax/experiments/miniature.py and what it shares with the Spider
verifier: stages.py, samples.py, report.py): wiring, report and config checks.

The stages themselves are the trainers and the evaluator, tested in their own files; here the pieces
only the experiments own are checked against hand-computed values, and one run of every stage at toy
size (``configs/reproduce.py:fast``) checks that the outputs are wired to the next stage's inputs.
"""
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from caper_jax.experiments import miniature, report, samples, stages
from caper_jax.experiments.settings import ReproduceSettings
from caper_jax.settings import from_config
from configs import reproduce as reproduce_config
from tests.helpers import REPO, run_train


def test_summary_is_mean_and_sample_std():
    out = report.summary({"clause": [0.2, 0.3, 0.4], "sft": [0.25]})
    assert out["clause"]["mean"] == pytest.approx(0.3)
    assert out["clause"]["std"] == pytest.approx(0.1)          # sqrt(((.1)^2 + 0 + (.1)^2) / 2)
    assert out["clause"]["values"] == [0.2, 0.3, 0.4]
    assert out["sft"] == {"mean": 0.25, "std": 0.0, "values": [0.25]}


def test_unique_keeps_first_occurrences_and_drops_empty():
    assert samples.unique(["SELECT 1", "", "SELECT 2", "SELECT 1", "  "]) == ["SELECT 1", "SELECT 2"]


def test_prm_data_links_the_world_and_holds_only_policy_samples(tmp_path):
    world = tmp_path / "world"
    (world / "database" / "db").mkdir(parents=True)
    (world / "train.json").write_text("[]")
    (world / "manifest.json").write_text("{}")
    (world / "predictions_train.jsonl").write_text('{"pred": "simulated"}\n')
    train_samples = tmp_path / "train.jsonl"
    train_samples.write_text('{"db_id": "db", "question": "q", "gold": "SELECT 1", "pred": "SELECT 2"}\n')
    eval_rows = tmp_path / "predictions.jsonl"
    eval_rows.write_text(json.dumps({"db_id": "db", "question": "q2", "gold": "SELECT 3",
                                     "samples": ["SELECT 3", "SELECT 4", "SELECT 3", ""]}) + "\n")
    out = tmp_path / "prm_data"
    samples.build_prm_data(world, train_samples, eval_rows, out, "train", "dev")

    assert (out / "database").is_symlink() and (out / "database").resolve() == (world / "database").resolve()
    assert (out / "train.json").read_text() == "[]"
    assert not (out / "manifest.json").exists()   # the demo-world builder must not mistake it for a world
    assert (out / "predictions_train.jsonl").read_text() == train_samples.read_text()
    dev = [json.loads(line) for line in (out / "predictions_dev.jsonl").read_text().splitlines()]
    assert [d["pred"] for d in dev] == ["SELECT 3", "SELECT 4"]
    assert all(d["samples"] == ["SELECT 3", "SELECT 4", "SELECT 3", ""] for d in dev)   # the whole group, for disagreement
    assert all(d["gold"] == "SELECT 3" and d["question"] == "q2" for d in dev)


def test_held_back_pick_questions_are_out_of_the_prms_samples_and_golds(tmp_path):
    """report.pick_held_back: the questions the reranker is picked on are in neither the PRM's samples nor
    its training split (whose golds are fault-injected), and they are exactly the pick stage's groups."""
    world = tmp_path / "world"
    (world / "database").mkdir(parents=True)
    questions = [{"db_id": "db", "question": f"q{i}", "query": f"SELECT {i}"} for i in range(10)]
    (world / "train.json").write_text(json.dumps(questions))
    train_samples = tmp_path / "samples" / "train.jsonl"
    train_samples.parent.mkdir()
    samples.write_jsonl(train_samples, [{"db_id": "db", "question": q["question"], "gold": q["query"],
                                           "pred": f"{q['query']} + {j}"} for q in questions for j in (1, 2)])
    samples.write_jsonl(samples.groups_path(train_samples),
                          [{"db_id": "db", "question": q["question"], "gold": q["query"],
                            "samples": [f"{q['query']} + 1", f"{q['query']} + 2"]} for q in questions])
    eval_rows = tmp_path / "predictions.jsonl"
    eval_rows.write_text(json.dumps({"db_id": "db", "question": "d", "gold": "SELECT 0", "samples": ["SELECT 0"]}) + "\n")
    config = reproduce_config.get_config("fast")
    config.report.pick_questions = 4

    config.report.pick_held_back = False
    assert samples.held_back_questions(config, train_samples) == set()
    config.report.pick_held_back = True
    held = samples.held_back_questions(config, train_samples)
    picked = {(g["db_id"], g["question"], g["gold"]) for g in samples.pick_groups(config, train_samples)}
    assert len(held) == 4 and held == picked

    out = tmp_path / "prm_data"
    samples.build_prm_data(world, train_samples, eval_rows, out, "train", "dev", held)
    kept = json.loads((out / "train.json").read_text())
    assert not (out / "train.json").is_symlink() and len(kept) == 6
    assert not {(q["db_id"], q["question"], q["query"]) for q in kept} & held
    kept_samples = [json.loads(line) for line in (out / "predictions_train.jsonl").read_text().splitlines()]
    assert len(kept_samples) == 12 and not {(r["db_id"], r["question"], r["gold"]) for r in kept_samples} & held
    assert json.loads((world / "train.json").read_text()) == questions     # the world itself is untouched


def _fake_stage_outputs(out: pathlib.Path, config) -> dict:
    """results.json files as the PRM trainer and the evaluator write them, with chosen numbers."""
    (out / "prm").mkdir(parents=True)
    loc = {m: {"top1": t, "mrr": r, "n": 10, "per_clause": {"WHERE": {"top1": t, "mrr": r, "n": 10}},
               "confusion": {}}
           for m, t, r in [("prm", 0.6, 0.8), ("heuristic", 0.9, 0.95), ("random", 0.3, 0.55), ("execution", 0.2, 0.5),
                           ("disagreement", 0.4, 0.6)]}
    for m in loc:
        loc[m]["sees_gold"] = m == "heuristic"
    (out / "prm" / "results.json").write_text(json.dumps(
        {"metrics": {"eval/pair_accuracy": 0.9}, "localization": loc, "n_failures": 10}))
    ex = {"sft": [0.1], "sparse": [0.2, 0.4], "token": [0.1, 0.1], "clause": [0.3, 0.5]}
    for name, values in ex.items():
        runs = ["sft"] if name == "sft" else [miniature.run_name(name, s) for s in config.seeds]
        for run, value in zip(runs, values):
            d = out / "eval" / run
            d.mkdir(parents=True)
            metrics = {"greedy": value, "majority_vote": value + 0.05, "oracle": 0.9,
                       "prm": {"min": value + 0.1, "mean": value, "last": value, "vote_min": value + 0.07,
                               "vote_mean": value + 0.06, "vote_last": value + 0.05}}
            (d / "results.json").write_text(json.dumps({"n": 40, "metrics": metrics}))
        for s, value in zip(config.seeds if name != "sft" else (), values):
            d = out / "grpo" / miniature.run_name(name, s)
            d.mkdir(parents=True)
            (d / "metrics.jsonl").write_text("".join(
                json.dumps({"step": step, "rollout/ex": value * step, "rollout/reward_mean": value}) + "\n"
                for step in (1, 2)))
    # The training pool picked vote_min (it is not the best on these test numbers: min is).
    (out / "rerank_pick.json").write_text(json.dumps({"split": "train", "n": 50, "k": 8, "picked": "vote_min",
                                                      "ex": {"min": 0.3, "vote_min": 0.4}}))
    return ex


def _stage_order(config, out: pathlib.Path) -> tuple[str, ...]:
    settings = from_config(ReproduceSettings, config)
    return stages.stage_names(miniature.stages(settings, out, stages.StageClock(out / "stage_seconds.json")))


def test_collect_and_report_from_stage_outputs(tmp_path):
    config = reproduce_config.get_config("seeds=2")
    ex = _fake_stage_outputs(tmp_path, config)
    results = miniature.collect(config, tmp_path)
    results["seconds"] = {"sft": 12.0}
    report.write_miniature_report(config, results, tmp_path, _stage_order(config, tmp_path))

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["localization_top1"] == 0.6 and saved["localization_mrr"] == 0.8
    assert saved["baselines"] == {"heuristic": {"top1": 0.9, "mrr": 0.95, "sees_gold": True},
                                  "random": {"top1": 0.3, "mrr": 0.55, "sees_gold": False},
                                  "execution": {"top1": 0.2, "mrr": 0.5, "sees_gold": False},
                                  "disagreement": {"top1": 0.4, "mrr": 0.6, "sees_gold": False}}
    assert saved["best_fair_baseline"] == "disagreement"        # the heuristic sees gold: not a competitor
    assert saved["rerank_aggregate"] == "vote_min"               # report.rerank="train": the training pool's pick
    assert list(saved["rerank8"]) == ["min", "mean", "last", "vote_min", "vote_mean", "vote_last"]
    for name, values in ex.items():
        assert saved["ex"][name]["mean"] == pytest.approx(np.mean(values))
        assert saved["mv8"][name]["mean"] == pytest.approx(np.mean(values) + 0.05)
        assert saved["rerank8"]["min"][name]["mean"] == pytest.approx(np.mean(values) + 0.1)
        assert saved["rerank8"]["vote_last"][name]["mean"] == pytest.approx(np.mean(values) + 0.05)
    # Paired by seed: clause (0.3, 0.5) - sparse (0.2, 0.4) = (0.1, 0.1): no spread, a zero-width interval;
    # clause - token = (0.2, 0.4): mean 0.3, sd 0.1414, t(0.975, 1) = 12.706 -> 0.3 ± 12.706 * 0.1414 / sqrt(2).
    paired = saved["paired_differences"]
    assert paired["greedy_ex"]["clause-sparse"]["lo"] == pytest.approx(0.1)
    assert paired["greedy_ex"]["clause-sparse"]["hi"] == pytest.approx(0.1)
    token = paired["greedy_ex"]["clause-token"]
    assert token["mean"] == pytest.approx(0.3) and token["n"] == 2
    assert token["hi"] - token["mean"] == pytest.approx(12.7062 * np.std([0.2, 0.4], ddof=1) / np.sqrt(2), rel=1e-4)
    assert paired["rerank_minus_mv"]["sft"]["lo"] is None and paired["rerank_minus_mv"]["sft"]["mean"] == \
        pytest.approx(0.02)
    # vote_min - MV = +0.02 in every one of the 6 GRPO runs (3 variants x 2 seeds): zero spread.
    assert paired["rerank_minus_mv_grpo_pooled"]["n"] == 6
    assert paired["rerank_minus_mv_grpo_pooled"]["lo"] == pytest.approx(0.02)
    assert saved["ex"]["sparse"]["std"] == pytest.approx(np.std([0.2, 0.4], ddof=1))
    assert saved["curves"]["clause"]["rollout/ex"] == pytest.approx([0.4, 0.8])   # mean over seeds, per step
    md = (tmp_path / "results.md").read_text()
    assert "| Clause-PRM | no | 60.0 | 80.0 |" in md and "| heuristic | **yes** (reference only) | 90.0 |" in md
    assert "| GRPO, clause-level (CAPER) | 40.0 ± 14.1 |" in md
    assert "| sparse | 35.0 | 40.0 (+5.0) | 30.0 (-5.0) |" in md
    assert "Greedy EX, clause minus token GRPO: +30.0 points [95 % t-interval -97.1, +157.1] over 2 pairs" in md
    # In words: PRM 60 vs disagreement 40 on n = 10 -> SE sqrt(.24/10 + .24/10) = .219, ±42.9: not shown.
    assert "1. **The Clause-PRM localises root causes better than gold-free methods**: not shown." in md
    assert "+20.0 points, approximate 95 % interval ±42.9 (n = 10)" in md
    assert "2. **Clause-level GRPO beats sparse and token-level GRPO in EX**: not shown." in md
    assert "3. **PRM reranking beats majority vote**: supported for the reranker `vote_min`" in md
    assert "misses the paper's +0.7" not in md   # +2.0 points meets it
    assert (tmp_path / "grpo_curves.png").stat().st_size > 0
    assert (tmp_path / "localization_per_clause.png").stat().st_size > 0
    assert md.endswith("| stage | seconds |\n|---|---|\n| sft | 12 |\n")


def test_report_without_held_out_failures_says_so(tmp_path):
    """A toy policy may leave no failure to localise (the :fast run): Table 1 said the PRM was measured
    against "`None`" and pointed to a plot that is not written."""
    config = reproduce_config.get_config("seeds=2")
    _fake_stage_outputs(tmp_path, config)
    results = miniature.collect(config, tmp_path)
    results |= {"seconds": {}, "localization_n": 0, "localization_top1": None, "localization_mrr": None,
                "baselines": {}, "best_fair_baseline": None, "localization_per_clause": {}}
    report.write_miniature_report(config, results, tmp_path, _stage_order(config, tmp_path))
    md = (tmp_path / "results.md").read_text()
    table1 = md.split("## Table 1")[1].split("## Table 2")[0]
    assert "nothing to localise" in table1 and "None" not in table1 and "| method |" not in table1
    assert "localization_per_clause.png" not in md and not (tmp_path / "localization_per_clause.png").exists()


@pytest.mark.parametrize("args, message", [
    (["--config=configs/reproduce.py", "--config.sft.optim.lrr=1"],
     "unknown config key 'sft.optim.lrr'; did you mean ['sft.optim.lr'"),
    (["--config=configs/reproduce.py", "--config.report.rerank=max"], "report.rerank='max' is not in"),
    (["--config=configs/reproduce.py", "--config.prm_init=hf"], "prm_init='hf'; expected 'sft' or 'random'"),
    (["--config=configs/reproduce.py", "--config.grpo.rl.group_size=0"], "grpo."),
    (["--config=configs/reproduce.py:seeds=0"], "seeds=() must be non-empty"),
    (["--config=configs/reproduce.py", "--config.eval.sampling.k=1"], "eval.sampling.k must be >= 2"),
    (["--config=configs/reproduce.py", "--config.report.pick_held_back=True", "--config.report.pick_questions=400"],
     "report.pick_held_back leaves the PRM no sampled question"),
])
def test_bad_reproduce_config_is_one_clear_error(args, message, tmp_path):
    result = run_train(*args, tmp_path=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_every_stage_runs_and_a_rerun_resumes_without_redoing_work(tmp_path):
    """configs/reproduce.py:fast (toy steps, 2 variants x 1 seed): every stage's output exists and the
    report holds what the issue asks for. A second run, after the clause GRPO run and its evaluation were
    deleted, skips every stage whose output exists, redoes those two and gives the same figures."""
    out = tmp_path / "rep"
    cmd = [sys.executable, "-m", "caper_jax.train", "--config=configs/reproduce.py:fast,seeds=1",
           "--config.variants=('sparse','clause')"]
    first = subprocess.run(cmd + [f"--workdir={out}"], cwd=REPO, capture_output=True, text=True,
                           timeout=1800)  # slow on a shared 2-core box
    assert first.returncode == 0, first.stderr[-3000:]
    # Every stage ends with its summary on screen, the reproduction with its headline rows and files.
    for title in ("SFT run finished", "Clause-PRM run finished", "GRPO (sparse) run finished",
                  "GRPO (clause) run finished", "Reproduction finished"):
        assert title in first.stdout, (title, first.stdout[-3000:])
    final = first.stdout.split("Reproduction finished")[-1]
    assert "Clause-PRM" in final and "MV@" in final and str(out / "results.md") in final
    results = json.loads((out / "results.json").read_text())
    for key in ("localization_top1", "localization_mrr", "baselines", "ex", "mv8", "rerank8", "paired_differences"):
        assert key in results
    # The gold-free baselines had their inputs: the SFT policy's clause log-probs and the k samples (a toy
    # policy may write no parseable failure at all: then Table 1 is empty).
    if results["localization_n"]:
        assert {"confidence", "disagreement", "heuristic"} <= set(results["baselines"])
        assert results["baselines"]["heuristic"]["sees_gold"] is True
    dev = [json.loads(line) for line in (out / "prm_data" / "predictions_dev.jsonl").read_text().splitlines()]
    assert all(len(d["samples"]) == 2 and "clause_logprob" in d for d in dev)
    # The PRM started from the SFT run; the reranker was picked on training questions.
    from caper_jax import runs
    prm_config = runs.read_run(out / "prm").config
    assert prm_config["model"]["init_from"] == str(out / "sft")
    pick = json.loads((out / "rerank_pick.json").read_text())
    assert pick["split"] == "train" and results["rerank_aggregate"] == pick["picked"]
    assert pick["held_back"] is True   # the default: the PRM never trained on the pick questions
    assert "TRAINING questions' samples that the PRM never trained on" in (out / "results.md").read_text()
    assert set(results["rerank8"]) == set(pick["ex"]) == {"min", "mean", "last", "vote_min", "vote_mean", "vote_last"}
    assert set(results["ex"]) == {"sft", "sparse", "clause"}
    assert results["ex"]["sparse"]["values"] and len(results["ex"]["sparse"]["values"]) == 1
    assert (out / "grpo" / "clause_s0" / "checkpoints").is_dir() and (out / "prm" / "checkpoints").is_dir()
    train_rows = [json.loads(line) for line in (out / "prm_data" / "predictions_train.jsonl").read_text().splitlines()]
    assert train_rows and all(s["pred"].strip() for s in train_rows)
    assert "## Table 2" in (out / "results.md").read_text()
    seconds = json.loads((out / "stage_seconds.json").read_text())

    # The rerun redoes the GRPO run that reads the PRM and the evaluation after it, from the stored SFT
    # checkpoint and PRM: its figures must come out the same to the digit (a lost seed, an unordered set or
    # a wall-clock dependence there shows up here); the stages whose outputs exist cost nothing.
    shutil.rmtree(out / "grpo" / "clause_s0")
    shutil.rmtree(out / "eval" / "clause_s0")
    second = subprocess.run(cmd + [f"--workdir={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "GRPO (clause) run finished" in second.stdout and "GRPO (sparse) run finished" not in second.stdout
    again = json.loads((out / "stage_seconds.json").read_text())
    for stage in ("sft", "samples", "prm"):   # done stages cost nothing the second time
        assert again[stage] - seconds[stage] < 1.0, (stage, seconds[stage], again[stage])
    assert again["grpo"] - seconds["grpo"] >= 1.0   # the clause run was redone
    redone = json.loads((out / "results.json").read_text())
    assert set(redone) == set(results)
    assert {k: v for k, v in redone.items() if k != "seconds"} == {k: v for k, v in results.items() if k != "seconds"}


def test_stages_use_the_configured_compilation_cache_else_the_workdirs(tmp_path):
    """A cache the caller configured is kept (JAX writes a cache's path into each program's compile
    options, so a copied cache never hits: runs share compiles only through one folder)."""
    import jax

    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "shared"))
        stages.start_stages(tmp_path / "w1")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "shared")
        jax.config.update("jax_compilation_cache_dir", None)
        stages.start_stages(tmp_path / "w2")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "w2" / "jax_cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def test_run_stages_skips_a_stage_whose_output_exists_and_times_each_by_name(tmp_path):
    """The resume rule: a stage runs until its output exists, never after; shared names add up."""
    ran = []

    def make(path):
        def function():
            ran.append(path.name)
            path.write_text("done")
            return path.name
        return function

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    b.write_text("from an earlier run")
    pipeline = [stages.Stage("first", a, make(a)), stages.Stage("second", b, make(b)),
                stages.Stage("first", stages.AnyOf((c, a)), make(c)),   # a exists by then: skipped
                stages.Stage("always", None, lambda: ran.append("always"))]
    clock = stages.StageClock(tmp_path / "stage_seconds.json")
    returned = stages.run_stages(pipeline, clock)
    assert ran == ["a", "always"] and returned == {"first": "a", "always": None}
    assert not c.exists() and b.read_text() == "from an earlier run"
    assert stages.stage_names(pipeline) == ("first", "second", "always")
    assert set(json.loads((tmp_path / "stage_seconds.json").read_text())) == {"first", "second", "always"}
    stages.run_stages(pipeline, stages.StageClock(tmp_path / "stage_seconds.json"))
    assert ran == ["a", "always", "always"]


def test_the_miniature_stages_keep_the_workdir_layout(tmp_path):
    """Stage names and outputs as a workdir of the single-module orchestrator has them, so such a workdir
    resumes where it stopped (and stage_seconds.json keeps its rows)."""
    config = from_config(ReproduceSettings, reproduce_config.get_config("seeds=2"))
    pipeline = miniature.stages(config, tmp_path, stages.StageClock(tmp_path / "stage_seconds.json"))
    out = tmp_path
    grpo = [(stage, out / root / f"{variant}_s{seed}" / "results.json")
            for variant in ("sparse", "token", "clause") for seed in (0, 1)
            for stage, root in (("grpo", "grpo"), ("eval", "eval"))]
    assert [(s.name, s.output if isinstance(s.output, pathlib.Path) or s.output is None else type(s.output).__name__)
            for s in pipeline] == [
        ("world", None), ("sft", out / "sft" / "results.json"), ("eval_sft", out / "eval" / "sft" / "results.json"),
        ("samples", out / "samples" / "train.jsonl"), ("confidence", "AnyOf"), ("prm", out / "prm" / "results.json"),
        ("pick", out / "rerank_pick.json"), ("rerank_sft", "Reranked"), *grpo, ("report", None)]
    assert pipeline[4].output.outputs == (out / "prm_data" / "CONFIDENCE_DONE", out / "prm" / "results.json")
    (out / "eval" / "sft").mkdir(parents=True)
    (out / "eval" / "sft" / "results.json").write_text(json.dumps({"metrics": {"greedy": 0.5}}))
    assert not pipeline[7].done()
    (out / "eval" / "sft" / "results.json").write_text(json.dumps({"metrics": {"greedy": 0.5, "prm": {}}}))
    assert pipeline[7].done()
    assert stages.stage_names(pipeline) == ("world", "sft", "eval_sft", "samples", "confidence", "prm", "pick",
                                            "rerank_sft", "grpo", "eval", "report")
