"""The summary every run ends with (caper_jax/utils/summary.py), on hand-made results.

The runs themselves print it at their end; tests/test_reproduce.py reads it from a real run of every
stage (SFT, PRM, GRPO, reproduction), tests/test_official_ex.py from `evaluate ex` and
tests/test_eval_policy.py from the policy evaluation.
"""
import io
import json

from caper_jax.utils import summary

PRM_RESULTS = {
    "metrics": {"eval/pair_accuracy": 0.889},
    "localization": {"prm": {"top1": 0.765, "mrr": 0.869}, "heuristic": {"top1": 0.713, "mrr": 0.834},
                     "random": {"top1": 0.338, "mrr": 0.608}, "execution": {"top1": 0.534, "mrr": 0.722}},
    "n_eval_tuples": 512, "n_failures": 204,
}


def test_formatting_helpers():
    assert summary.pct(0.765) == "76.5 %" and summary.pct(None) == "-" and summary.pct(float("nan")) == "-"
    assert summary.pct(0.275, 0.008) == "27.5 ± 0.8 %" and summary.pct(0.25, 0.0) == "25.0 %"
    assert [summary.duration(s) for s in (3.21, 465, 3725)] == ["3.2 s", "7 min 45 s", "1 h 02 min"]


def test_prm_summary_is_the_readme_table_with_the_files_that_exist(tmp_path, capsys):
    (tmp_path / "checkpoints" / "300").mkdir(parents=True)
    (tmp_path / "checkpoints" / "450").mkdir()
    (tmp_path / "hf_export").mkdir()
    for name in ("localization.md", "results.json", "loss_curve.png"):
        (tmp_path / name).write_text("x")
    text = summary.prm_run(PRM_RESULTS, tmp_path, 465.0)
    assert capsys.readouterr().out.strip() == text
    lines = text.splitlines()
    assert lines[1] == f"Clause-PRM run finished in 7 min 45 s: {tmp_path}"
    assert lines[2].split() == ["held-out", "metric", "Clause-PRM", "heuristic", "execution-only", "random"]
    assert lines[3].split() == ["pairwise", "accuracy", "(512", "tuples)", "88.9", "%", "50.0", "%"]
    assert lines[4].split() == ["top-1", "(204", "failed", "predictions)", "76.5", "%", "71.3", "%", "53.4", "%",
                                "33.8", "%"]
    assert lines[5].split() == ["MRR", "86.9", "%", "83.4", "%", "72.2", "%", "60.8", "%"]
    files = {line.split()[0]: line.split()[1:] for line in lines[6:-1]}
    assert files == {"report": [str(tmp_path / "localization.md")], "results": [str(tmp_path / "results.json")],
                     "plots": [str(tmp_path / "loss_curve.png")],   # the per-clause plot was not written
                     "checkpoint": [str(tmp_path / "checkpoints" / "450")], "export": [str(tmp_path / "hf_export")]}


def test_policy_summary_greedy_ex_and_how_training_moved(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "rollout/ex": 0.25, "rollout/reward_mean": -0.5}, {"step": 2, "rollout/ex": 0.375},
        {"step": 2, "eval/greedy_ex": 0.3}]))
    results = {"eval/greedy_ex": 0.3, "eval/executable": 0.9, "eval/n": 40}
    text = summary.policy_run("GRPO (clause)", results, tmp_path, 12.0, stream=io.StringIO())
    assert "GRPO (clause) run finished in 12.0 s" in text
    assert "held-out dev (40 questions)" in text and "30.0 %" in text and "90.0 %" in text
    assert "rollout EX (sampled groups): 25.0 % (step 1) -> 37.5 % (step 2)" in text
    assert "mean execution reward: -0.5000 (step 1)\n" in text + "\n"   # logged once
    text = summary.policy_run("SFT", {"steps": 3}, tmp_path / "none", 1.0, stream=io.StringIO())
    assert "no end-of-run EX" in text and "checkpoint" not in text


def test_reproduce_summary_has_the_headline_rows(tmp_path):
    results = {"localization_top1": 0.619, "localization_mrr": 0.78, "localization_n": 438, "pair_accuracy": 0.746,
               "baselines": {"heuristic": {"top1": 0.982, "mrr": 0.99, "sees_gold": True},
                             "random": {"top1": 0.314, "mrr": 0.587, "sees_gold": False}},
               "ex": {"sft": {"mean": 0.275, "std": 0.0}, "clause": {"mean": 0.261, "std": 0.024}},
               "mv8": {"sft": {"mean": 0.233, "std": 0.0}, "clause": {"mean": 0.258, "std": 0.014}},
               "rerank8": {"min": {"sft": {"mean": 0.217, "std": 0.0}, "clause": {"mean": 0.219, "std": 0.005}}},
               "rerank_aggregate": "min", "k": 8, "n_eval_questions": 120}
    (tmp_path / "results.md").write_text("x")
    text = summary.reproduce_run(results, tmp_path, 1145.0, stream=io.StringIO())
    assert "Reproduction finished in 19 min 5 s" in text
    assert "top-1 (438 failed predictions)" in text and "61.9 %" in text and "98.2 %" in text
    clause = next(line for line in text.splitlines() if line.split()[:1] == ["clause"])
    assert clause.split() == ["clause", "26.1", "±", "2.4", "%", "25.8", "±", "1.4", "%", "21.9", "±", "0.5", "%"]
    assert "see the gold (reference only): heuristic" in text and str(tmp_path / "results.md") in text


def test_evaluate_ex_summary_goes_to_the_given_stream():
    stream = io.StringIO()
    text = summary.evaluate_ex_run({"ex": 0.828, "n": 972, "excluded": {"missing_db": 62}, "malformed": 0,
                                    "mv": {"n": 5, "first": 0.2, "vote": 0.4, "any": 0.8}},
                                   "p.sql", "spider_official", 1.0, stream=stream)
    assert stream.getvalue().strip() == text
    assert "EX (spider_official) finished in 1.0 s: p.sql" in text and "82.8 %" in text and "missing_db 62" in text
    assert "majority vote 40.0 %" in text


def test_verify_summaries_show_every_selection_and_no_pairwise_row(tmp_path):
    rerank = summary.verify_rerank_run(
        {"n": 4, "first": 0.25, "vote": 0.5, "prm": 0.75, "aggregate": "min", "any": 1.0,
         "prm_by_aggregate": {"min": 0.75, "vote_min": 0.5}, "excluded": {}, "malformed": 1},
        "c.jsonl", "spider", 2.0, stream=io.StringIO())
    header, row = [line.split("  ") for line in rerank.splitlines()[2:4]]
    assert [c.strip() for c in header if c.strip()] == ["selection (EX)", "first", "majority vote", "PRM min",
                                                        "PRM vote_min", "any (oracle)"]
    assert [c.strip() for c in row if c.strip()] == ["4 lines", "25.0 %", "50.0 %", "75.0 %", "50.0 %", "100.0 %"]
    assert "chosen by: PRM min = 75.0 %; excluded none; malformed lines 1" in rerank
    (tmp_path / "localization.md").write_text("x")
    localize = summary.verify_localize_run(
        {"n": 3, "localization": {"prm": {"top1": 2 / 3, "mrr": 0.8}, "random": {"top1": 0.2, "mrr": 0.5}}},
        {"correct": 7}, tmp_path, 1.0, stream=io.StringIO())
    assert "pairwise" not in localize and "skipped correct 7" in localize
    top1 = next(line for line in localize.splitlines() if line.strip().startswith("top-1"))
    assert top1.split() == ["top-1", "(3", "failed", "predictions)", "66.7", "%", "20.0", "%"]
    assert str(tmp_path / "localization.md") in localize


def test_spider_verifier_summary_marks_the_picked_reranker(tmp_path):
    text = summary.spider_verifier_run(
        {"localization": {"prm": {"top1": 0.5, "mrr": 0.75, "n": 8, "sees_gold": False},
                          "heuristic": {"top1": 0.25, "mrr": 0.5, "n": 8, "sees_gold": True}},
         "pair_accuracy": 0.625, "k": 6, "n_dev": 10, "first": 0.7, "mv": 0.8, "oracle": 0.9,
         "rerank": {"min": 0.6, "vote_min": 0.8}, "rerank_aggregate": "vote_min", "ex_alone": {"a.sql": 0.4}},
        tmp_path, 3.0, stream=io.StringIO())
    rows = {line.strip().split("  ")[0]: line.split() for line in text.splitlines()}
    assert rows["top-1 (8 failed predictions)"][-4:] == ["50.0", "%", "25.0", "%"]
    assert "PRM vote_min (picked)" in text and "PRM min (picked)" not in text
    assert rows["the systems' pool"][3:] == ["70.0", "%", "80.0", "%", "60.0", "%", "80.0", "%", "90.0", "%"]
    assert "reference only): heuristic" in text and "each system alone: a.sql 40.0 %" in text
