"""The world-seed spread report against hand-computed means and sample standard deviations."""
import json

import pytest

from caper_jax.eval import world_seeds

POLICIES = ("sft", "sparse", "token", "clause")


def fake_results(top1: float, ex: float, mv: float, vote: float) -> dict:
    """A reproduction's results.json with only the fields the report reads."""
    cell = lambda v: {"mean": v, "std": 0.0, "values": [v]}   # noqa: E731
    return {
        "localization_top1": top1, "localization_mrr": top1 + 0.1, "localization_n": 100,
        "pair_accuracy": 0.8,
        "baselines": {"heuristic": {"top1": 0.9, "mrr": 0.95, "sees_gold": True},
                      "confidence": {"top1": 0.5, "mrr": 0.7, "sees_gold": False}},
        "best_fair_baseline": "confidence",
        "ex": {p: cell(ex) for p in POLICIES}, "mv8": {p: cell(mv) for p in POLICIES},
        "oracle8": {p: cell(0.4) for p in POLICIES},
        "rerank8": {"min": {p: cell(mv - 0.05) for p in POLICIES}, "vote_last": {p: cell(vote) for p in POLICIES}},
        "rerank_aggregate": "vote_last",
        "paired_differences": {"greedy_ex": {"clause-sparse": {"mean": ex - 0.2}}},
        "seconds": {"sft": 300.0, "prm": 300.0},
    }


def test_cells_are_mean_and_sample_std_in_percent():
    runs = [fake_results(0.60, 0.20, 0.25, 0.26), fake_results(0.70, 0.30, 0.25, 0.22)]
    text = world_seeds.spread_report(runs, ["s0", "s1"])
    # top-1 60 and 70: mean 65, sample std sqrt(((5)^2 + (5)^2) / 1) = 7.07
    assert "| Clause-PRM | no | 65.0 ± 7.1 (60.0 / 70.0) |" in text
    # PRM minus the best gold-free baseline: 10 and 20 points
    assert "PRM top-1 minus it: 15.0 ± 7.1 (10.0 / 20.0) points" in text
    assert "| heuristic | **yes** (reference only) |" in text
    # greedy 20 / 30, MV 25 / 25, the picked reranker (vote_last) 26 / 22
    assert "| clause | 25.0 ± 7.1 (20.0 / 30.0) | 25.0 ± 0.0 (25.0 / 25.0) | 24.0 ± 2.8 (26.0 / 22.0) |" in text
    # Table 3: vote_last - MV = +1 and -3 points; min - MV = -5 both times
    assert "| sft | -5.0 ± 0.0 (-5.0 / -5.0) | -1.0 ± 2.8 (1.0 / -3.0) |" in text
    assert "- clause-sparse: 5.0 ± 7.1 (0.0 / 10.0)" in text
    assert "(minutes): 10.0 / 10.0" in text


def test_cli_writes_the_report_and_refuses_unfinished_runs(tmp_path, capsys):
    dirs = []
    for i, top1 in enumerate((0.5, 0.6, 0.7)):
        d = tmp_path / f"rep_s{i}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(fake_results(top1, 0.2, 0.25, 0.25)))
        dirs.append(str(d))
    out = tmp_path / "spread.md"
    with pytest.raises(SystemExit) as done:
        world_seeds.app.run(world_seeds.main, argv=["world_seeds", f"--output={out}", *dirs])
    assert done.value.code == 0
    assert "| Clause-PRM | no | 60.0 ± 10.0 (50.0 / 60.0 / 70.0) |" in out.read_text()

    (tmp_path / "unfinished").mkdir()
    assert world_seeds.main(["world_seeds", dirs[0], str(tmp_path / "unfinished")]) == 2
    assert "no results.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 2 runs"):
        world_seeds.read_runs(dirs[:1])

    no_failures = tmp_path / "no_failures"
    no_failures.mkdir()
    (no_failures / "results.json").write_text(json.dumps({**fake_results(0.5, 0.2, 0.25, 0.25),
                                                          "localization_top1": None}))
    assert world_seeds.main(["world_seeds", dirs[0], str(no_failures)]) == 2
    assert "no localisation figures" in capsys.readouterr().err
