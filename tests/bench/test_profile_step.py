"""bench/profile_step.py --tiny: the profile's table is consistent with the wall time and with the HLO.

The GEMM count is checked against a count made here, independently of the profile's HLO parser and
of the trace: the dot-holding instructions of the compiled step's HLO text, each computation's
count multiplied by the known trip counts of the whiles that run it.
"""
import json
import re

import jax

from bench import profile_step


def executed_dot_instructions(hlo: str) -> dict[str, int]:
    """Instruction name -> executions per call, for every dot / fusion whose body holds a dot."""
    bodies = {}
    for match in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", hlo, re.M | re.S):
        bodies[match.group(1)] = match.group(2)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
    holds_dot = {name for name, body in bodies.items() if re.search(r" dot\(", body)}
    counts: dict[str, int] = {}

    def visit(computation: str, times: int) -> None:
        for line in bodies[computation].splitlines():
            name = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = ", line)
            if not name:
                continue
            name = name.group(1)
            fused = re.search(r"\bfusion\(.*calls=%?([\w.\-]+)", line)
            if re.search(r" dot\(", line) or (fused and fused.group(1) in holds_dot):
                counts[name] = counts.get(name, 0) + times
            loop = re.search(r" while\(.*body=%?([\w.\-]+)", line)
            if loop:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                visit(loop.group(1), times * int(trips.group(1)))

    visit(entry, 1)
    return counts


def test_tiny_profile_adds_up_and_counts_the_hlo_dots(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)   # nothing may land in the working directory
    result = profile_step.main(["--tiny", "--steps", "1", "--repeats", "1", "--trace_dir", str(tmp_path / "trace")])
    out = tmp_path / "trace" / "profile_step.json"   # without --json the result lies beside the trace
    assert json.loads(out.read_text())["train"]["categories"] == result["train"]["categories"]
    assert list(cwd.iterdir()) == []
    train = result["train"]
    cats = train["categories"]
    assert set(cats) == set(profile_step.CATEGORIES)

    op_sum = sum(row["time_s"] for name, row in cats.items() if name != profile_step.GAPS)
    assert 0 < op_sum <= train["wall_s"] * (1 + 1e-9)
    assert abs(op_sum - train["op_time_s"]) < 1e-9
    assert abs(sum(row["share"] for row in cats.values()) - 1) < 1e-6
    assert abs(sum(row["share"] for row in train["parts"].values()) + cats[profile_step.GAPS]["share"] - 1) < 1e-6

    # The compiled HLO text of the executable that ran (the script saves Compiled.as_text()).
    with open(train["hlo_path"]) as f:
        expected = executed_dot_instructions(f.read())
    assert any(n > 1 for n in expected.values())        # the tiny config keeps a while loop over chunks
    gemm_ops = {r["op"]: r["count"] for r in train["ops"] if r["category"] == profile_step.GEMM}
    assert gemm_ops == expected
    assert cats[profile_step.GEMM]["count"] == sum(expected.values()) and cats[profile_step.GEMM]["time_s"] > 0

    # The source walk reaches past the shared _dense helper to its caller, and each layer part shows up.
    parts = train["parts"]
    for part in ("gated delta rule", "attention", "MLP", "norms", "LM head + loss/sampling"):
        assert parts[part]["time_s"] > 0, part
    assert parts["MLP"]["gemm_time_s"] > 0
    for name in (profile_step.DELTA, profile_step.ATTENTION, profile_step.NORMS, profile_step.LOSS):
        assert cats[name]["count"] > 0, name
    assert train["matmul_flops"] > 0 and train["gemm_gflops"] > 0
    assert jax.devices()[0].platform == "cpu"


def test_attribute_charges_idle_time_after_a_pool_finished_dot_inside_a_call():
    # Two threads. t=0-10 a plain dot's event (thread A), then nothing until 40 (Eigen's pool finishing
    # it), then a fusion 40-50 on A overlapping a copy 45-55 on B, then idle 55-70, then a dot 70-72,
    # idle 72-90 (outside the call window, which ends at 80), an op 90-100 in a second window.
    events = [
        {"ts": 0, "dur": 10, "tid": "A"},    # 0: plain dot
        {"ts": 40, "dur": 10, "tid": "A"},   # 1: fusion
        {"ts": 45, "dur": 10, "tid": "B"},   # 2: copy
        {"ts": 70, "dur": 2, "tid": "A"},    # 3: plain dot, its idle tail leaves the window at 80
        {"ts": 90, "dur": 10, "tid": "B"},   # 4: op of the next call
    ]
    pool = [True, False, False, True, False]
    windows = [(0, 80), (85, 100)]
    charged, after_end = profile_step.attribute(events, windows, pool)
    assert charged == [10, 5 + 2.5, 2.5 + 5, 2, 10]          # overlap 45-50 split between the two
    assert after_end == [30, 0, 0, 0, 0]                      # 10-40 only: 55-70 follows a copy;
    # 72-90 runs past its call's window (the host's time between calls), so no op gets it.
    assert profile_step.attribute(events)[1] == [0] * 5      # without windows nothing is charged
