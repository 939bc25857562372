"""bench/fma_peak.py: the FMA kernel computes the recurrence it is timed for, a kernel that does not is
refused, and the script runs end to end on this machine's cores."""
import json
import os
import platform
import shutil
import stat
import subprocess
import sys

import pytest

from bench import fma_peak

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
x86_with_compiler = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not (shutil.which("cc") or shutil.which("gcc")),
    reason="the FMA kernel is x86-64 C")


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def test_expected_checksum_is_the_recurrence_by_hand():
    # acc <- 2 acc + 1 three times from acc_j = j gives 8 j + 7; summed over j = 0..11: 8 * 66 + 12 * 7.
    assert fma_peak.expected_checksum(3, 2.0, 1.0, lanes=1) == 612
    assert fma_peak.expected_checksum(3, 2.0, 1.0, lanes=16) == 16 * 612
    assert fma_peak.expected_checksum(5, 1.0, 0.0, lanes=8) == 8 * 66


def test_a_kernel_that_computes_something_else_is_refused(tmp_path):
    fake = tmp_path / "fma"
    fake.write_text("#!/bin/sh\necho lanes=16 seconds=0.001 checksum=9000\n")   # 16 * 612 = 9792
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(SystemExit, match="is not 9792"):
        fma_peak.verify_kernel(str(fake), core=cores()[0])


@x86_with_compiler
def test_the_kernel_computes_the_recurrence_on_every_lane(tmp_path):
    binary = fma_peak.build(str(tmp_path))
    (result,) = fma_peak.run_kernel(binary, 3, 2.0, 1.0, [cores()[0]])
    with open("/proc/cpuinfo") as f:
        avx512 = " avx512f " in f.read()
    assert result["lanes"] == (16 if avx512 else 8)
    assert result["checksum"] == fma_peak.expected_checksum(3, 2.0, 1.0, result["lanes"])


@x86_with_compiler
def test_end_to_end_on_every_core(tmp_path):
    out = tmp_path / "peak.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "fma_peak.py"), "--iterations", "200000",
                           "--gemm", "64", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [r["core"] for r in result["cores"]] == cores()
    for r in result["cores"]:
        assert r["checksum"] == 66 * r["lanes"]          # x = 1, y = 0 keeps acc_j = j
        assert r["gflops"] > 0
    assert result["peak_gflops"] == pytest.approx(sum(r["gflops"] for r in result["cores"]))
    assert result["gemm_share"] == pytest.approx(result["gemm_gflops"] / result["peak_gflops"])
    assert "% of the FMA peak" in proc.stdout
    assert os.listdir(tmp_path) == ["peak.json"]       # the kernel is built in a temporary folder
