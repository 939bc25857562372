"""configs/spider_verifier.py:fast end to end (caper_jax/experiments/spider_verifier.py): every stage of the
verifier on real Spider data at toy size.

The numbers mean nothing at this size; the test checks the wiring and the report against independent
paths: EX of the first candidate through ``verify`` (pool) equals that system's EX through
``evaluate ex``; the oracle bounds every system; the view's dev questions are the shared dev.json's.
"""
import json
import subprocess
import sys

import pytest

from caper_jax.experiments import spider_verifier
from tests.helpers import REPO, require, run_train, spider_dir

SELECTORS = {"min", "mean", "last", "vote_min", "vote_mean", "vote_last"}


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_fast_verifier_runs_every_stage(tmp_path):
    require(spider_dir() / "train_no_db" / "train_spider_questions.json")
    require(spider_dir().parent / "spider_predictions" / "PROVENANCE.md")
    out = tmp_path / "sv"
    cmd = [sys.executable, "-m", "caper_jax.train", "--config=configs/spider_verifier.py:fast", f"--workdir={out}"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    from configs.spider_verifier import SYSTEMS

    assert list(results["ex_alone"]) == list(SYSTEMS) and results["k"] == 6
    assert results["n_dev"] == 10
    assert results["first"] == pytest.approx(results["ex_alone"][SYSTEMS[0]])   # verify vs evaluate ex
    assert all(v <= results["oracle"] for v in results["ex_alone"].values())
    assert set(results["rerank"]) == SELECTORS and results["rerank_aggregate"] in SELECTORS
    assert set(results["rerank_minus_mv"]) == SELECTORS
    assert results["rerank_pick"]["split"] == "train" and results["rerank_pick"]["held_back"] is True
    # The pick questions (report.pick_held_back) are in neither the PRM's samples nor its fault-injected golds.
    from caper_jax.experiments.samples import held_back_questions
    from configs.spider_verifier import get_config
    held = held_back_questions(get_config("fast"), out / "samples" / "train.jsonl")
    assert len(held) == results["rerank_pick"]["n"] == 6
    prm_golds = {(q["db_id"], q["question"], q["query"])
                 for q in json.loads((out / "prm_data" / "train.json").read_text())}
    prm_samples = {(r["db_id"], r["question"], r["gold"]) for r in map(
        json.loads, (out / "prm_data" / "predictions_train.jsonl").read_text().splitlines())}
    assert prm_samples and not held & prm_golds and not held & prm_samples
    view_golds = {(q["db_id"], q["question"], q["query"])
                  for q in json.loads((out / "spider" / "train.json").read_text())}
    assert held <= view_golds and len(prm_golds) == len(view_golds) - len(held)
    loc = results["localization"]
    assert loc, "no real failure was localised"
    assert loc["heuristic"]["sees_gold"] is True and {"confidence", "disagreement"} <= set(loc)
    assert not any(loc[m]["sees_gold"] for m in ("prm", "confidence", "disagreement", "execution", "random"))
    # The view's dev questions are the shared ones, at the line the systems' files answer them.
    dev = json.loads((spider_dir() / "dev.json").read_text())
    view_dev = json.loads((out / "spider" / "dev.json").read_text())
    assert all(dev[r["source_index"]]["question"] == r["question"] for r in view_dev)
    from caper_jax import runs
    stored = runs.read_run(out / "prm").config
    assert stored["model"]["init_from"] == str(out / "sft") and stored["annotate"]["candidate_contrasts"]
    md = (out / "results.md").read_text()
    assert "| MV@6 |" in md and "(picked on train)" in md and "| oracle@6 |" in md
    assert "training questions' samples that the PRM never trained on" in md
    # The run ends with its own summary (the last block on stdout), its figures those of results.json.
    last_block = run.stdout.rstrip().split("=" * 78 + "\n")[-1]
    assert last_block.startswith("Spider verifier finished in"), run.stdout[-3000:]
    pool_row = next(line for line in last_block.splitlines() if line.strip().startswith("the systems' pool"))
    assert pool_row.split()[3:5] == [f"{100 * results['first']:.1f}", "%"]
    assert pool_row.split()[-2:] == [f"{100 * results['oracle']:.1f}", "%"]


@pytest.mark.parametrize("args, message", [
    (["--config.data.systems=('nope.sql',)"], "data.systems: 'nope.sql' is not in"),
    (["--config.data.spider_dir=/nonexistent"], "data.spider_dir='/nonexistent' is not a directory"),
    (["--config.eval.sampling.k=1"], "eval.sampling.k must be >= 2"),
    (["--config.prm.model.preset=big"], "prm.model.preset='big'"),
    (["--config.report.pick_questions=2000"], "report.pick_held_back leaves the PRM no sampled question"),
])
def test_bad_verifier_config_is_one_clear_error(args, message, tmp_path):
    result = run_train("--config=configs/spider_verifier.py", *args, tmp_path=tmp_path)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "w").exists()


def test_a_workdir_verified_before_the_per_candidate_verdicts_is_verified_again(tmp_path, monkeypatch):
    """verify_choices.jsonl lines written before they carried candidate_correct, vote_choice and choices
    would leave the paired rerank-minus-vote interval out of the report without a word: the verify stage
    runs again instead (every other stage is done, so nothing else reruns), and once only."""
    import jax

    from configs.spider_verifier import get_config

    out = tmp_path / "sv"
    for path, text in [("spider/tokenizer/tokenizer.json", "{}"), ("sft/results.json", "{}"),
                       ("samples/train.jsonl", ""), ("prm/results.json", '{"metrics": {}, "localization": {}}'),
                       ("rerank_pick.json", '{"picked": "min", "split": "train", "n": 2}')]:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
    pool = {"n": 2, "first": 0.5, "vote": 0.5, "prm_by_aggregate": {"min": 1.0}, "any": 1.0}
    (out / "verify.json").write_text(json.dumps({"alone": {}, "pool": pool}))
    (out / "verify_choices.jsonl").write_text("".join(json.dumps({"index": i, "chosen": 0, "correct": True}) + "\n"
                                                      for i in range(2)))   # the old lines
    verified = []

    def verify_systems(config, view, candidates, out):
        verified.append(out)
        (out / "verify_choices.jsonl").write_text("".join(json.dumps(
            {"index": i, "chosen": 0, "correct": True, "candidate_correct": [True, False], "vote_choice": i,
             "choices": {"min": 0}}) + "\n" for i in range(2)))
        return {"alone": {}, "pool": pool}

    monkeypatch.setattr(spider_verifier, "system_candidates", lambda config, view: [])
    monkeypatch.setattr(spider_verifier, "verify_systems", verify_systems)
    cache = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        results = spider_verifier.run(spider_verifier.validate(get_config("fast")), str(out))
        assert verified == [out]
        assert results["rerank_minus_mv"]["min"]["n"] == 2 and results["rerank_minus_mv"]["min"]["mean"] == 0.5
        spider_verifier.run(spider_verifier.validate(get_config("fast")), str(out))
        assert verified == [out]   # the new lines are complete: no second verification
    finally:   # run points XLA's persistent cache at the workdir; the rest of the session must not
        jax.config.update("jax_compilation_cache_dir", cache[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", cache[1])


def test_rerank_minus_vote_is_paired_per_question(tmp_path):
    """Hand-computed: 4 questions; min picks right where the vote is wrong once and wrong where it is
    right once (difference 0), vote_min agrees with the vote everywhere but on one gain (+1/4)."""
    rows = [  # candidate verdicts, the vote's pick, each selector's pick
        ([True, False], 1, {"min": 0, "vote_min": 0}),
        ([True, False], 0, {"min": 1, "vote_min": 0}),
        ([False, True], 1, {"min": 1, "vote_min": 1}),
        ([False, False], 0, {"min": 0, "vote_min": 0}),
    ]
    path = tmp_path / "choices.jsonl"
    path.write_text("".join(json.dumps({"candidate_correct": c, "vote_choice": v, "choices": ch}) + "\n"
                            for c, v, ch in rows) + json.dumps({"correct": None, "excluded": "missing_db"}) + "\n")
    paired = spider_verifier.rerank_minus_vote(path)
    assert paired["min"]["n"] == paired["vote_min"]["n"] == 4
    assert paired["min"]["mean"] == 0.0 and paired["vote_min"]["mean"] == 0.25
    # differences (0, 0, 0, 1): sd 0.5, t(0.975, 3) = 3.182 -> half-width 3.182 * 0.5 / 2
    assert paired["vote_min"]["lo"] == pytest.approx(0.25 - 0.7955, abs=1e-3)
    assert paired["vote_min"]["hi"] == pytest.approx(0.25 + 0.7955, abs=1e-3)
