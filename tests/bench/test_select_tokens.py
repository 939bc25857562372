"""bench/select_tokens.py runs end to end at a small size and reports both token choices; it exits
with an error when the sampler and the reference would choose different tokens."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_select_tokens_bench_runs_and_reports_both_choices():
    result = subprocess.run([sys.executable, "bench/select_tokens.py", "--batch", "3", "--vocab", "1000",
                             "--repeats", "3"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "token choice on [3, 1000] fp32 logits" in out and "same tokens on both sides" in out
    for line in ("greedy: sampler", "sampled: sampler"):
        assert line in out and "speed-up" in out.split(line, 1)[1].split("\n", 1)[0]
    assert "load average at start" in out and "load average at end" in out
