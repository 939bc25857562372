"""bench/accelerator.py --tiny: the accelerator benchmark's whole program on CPU, one JSON line at the end."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_accelerator_benchmark_runs_tiny_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "bench/accelerator.py", "--tiny"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("load average at start:")
    result = json.loads(lines[-1])
    assert result["platform"] == "cpu" and result["config"] == "tiny"
    train = result["train"]
    assert train["step_s"] > 0 and train["tokens_per_s"] > 0 and train["sequences"] == 4
    # remat="layers" recomputes each layer's forward once: more executed than useful FLOPs, < 1.5x.
    assert train["model_flops"] < train["hardware_flops"] < 1.5 * train["model_flops"]
    assert train["mfu"] is None and train["peak_flops"] is None          # no peak FLOP/s known for a CPU
    layers = result["layers"]
    assert layers["gated_delta_rule_32"]["fwd_bwd_s"] > 0 and layers["attention_32"]["fwd_bwd_s"] > 0
    assert layers["delta_over_attention_32"] > 0
    assert result["decode"]["batch_2"]["new_tokens_per_s"] > 0
    assert set(result["memory"]) == {"peak_bytes_in_use", "bytes_limit"}
    assert isinstance(result["load"]["loaded"], bool)
