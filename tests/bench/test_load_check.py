"""bench/_common.py: the quiet-machine rule every benchmark applies to its ratios."""
import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from bench import _common  # noqa: E402


def _check(start, end, own=2.0, cores=2):
    check = _common.LoadCheck(own=own, cores=cores, start=(start, 0.0, 0.0), print_fn=None)
    check.end = (end, 0.0, 0.0)
    return check


def test_bounds_are_half_the_cores_at_start_and_own_plus_half_at_end():
    assert not _check(1.0, 3.0).loaded                 # 2 cores: <= 1.0 at start, <= 2 + 1 at end
    assert _check(1.01, 0.0).loaded
    assert _check(0.2, 3.01).loaded
    assert not _check(0.2, 2.0, own=1.0).loaded and _check(0.2, 2.01, own=1.0).loaded


def test_mark_labels_or_refuses_ratios_of_a_loaded_run(monkeypatch):
    monkeypatch.delenv("CAPER_BENCH_REFUSE_LOADED", raising=False)
    assert _check(0.1, 0.5).mark("0.54x") == "0.54x"
    assert _check(5.0, 5.0).mark("0.54x") == "0.54x LOADED (not comparable)"
    monkeypatch.setenv("CAPER_BENCH_REFUSE_LOADED", "1")
    assert _check(5.0, 5.0).mark("0.54x") == "refused: machine loaded"


def test_start_and_finish_read_the_real_load_average():
    lines = []
    check = _common.start_load_check(own=99, cores=4, print_fn=lines.append)
    assert check.own == 4 and check.start_limit == 2.0 and check.end_limit == 6.0
    check.finish()
    assert len(lines) == 2 and lines[0].startswith("load average at start:") and "machine was" in lines[1]
    assert check.as_dict()["load_end"] is not None and check.as_dict()["loaded"] == check.loaded


def test_alternating_min_time_takes_turns_and_keeps_each_best(monkeypatch):
    calls = []
    medians = iter([3.0, 5.0, 2.0, 6.0])      # ours, reference, ours, reference
    monkeypatch.setattr(_common, "median_time", lambda fn, repeats: (fn(), next(medians))[1])
    best = _common.alternating_min_time({"ours": lambda: calls.append("ours"),
                                         "reference": lambda: calls.append("reference")}, repeats=7)
    assert calls == ["ours", "reference", "ours", "reference"]
    assert best == {"ours": 2.0, "reference": 5.0}
