"""launch/reproduce_cpu.sh and launch/spider_verifier.sh (through launch/_cpu_job.sh), run on a copy of
launch/ beside a stand-in .venv/bin/python that records its arguments: the command each one runs, where
its log goes, and the usage errors. The real jobs are what tests/test_reproduce.py and
tests/test_spider_verifier.py run through `caper_jax.train`."""
import pathlib
import shutil
import stat
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$(dirname "$0")/../../args.txt"
echo "stand-in run in $(pwd)"
"""


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(REPO / "launch", tmp_path / "launch")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def launch(tree, script, *args):
    """Runs from outside the copied tree, as a user may."""
    return subprocess.run(["bash", str(tree / "launch" / script), *args], cwd=tree.parent,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script,config,log", [("reproduce_cpu.sh", "configs/reproduce.py", "reproduce.log"),
                                               ("spider_verifier.sh", "configs/spider_verifier.py",
                                                "spider_verifier.log")])
def test_each_launcher_runs_its_config_with_the_variant_and_overrides(tree, script, config, log):
    proc = launch(tree, script, "runs/out", ":fast", "--config.seed=3")
    assert proc.returncode == 0, proc.stderr
    args = (tree / "args.txt").read_text().splitlines()
    assert args == ["-m", "caper_jax.train", f"--config={config}:fast", "--workdir=runs/out", "--config.seed=3"]
    # OUTDIR is taken from the repository root, whatever the caller's directory; the log is appended.
    assert (tree / "runs" / "out" / log).read_text() == f"stand-in run in {tree}\n"
    assert f"{log[:-4]}: " in proc.stdout and "s wall; results in runs/out/results.md" in proc.stdout

    assert launch(tree, script, "runs/out").returncode == 0      # a rerun without a variant
    assert (tree / "args.txt").read_text().splitlines()[2] == f"--config={config}"
    assert (tree / "runs" / "out" / log).read_text().count("stand-in run") == 2


@pytest.mark.parametrize("args", [(), ("--config.seed=3",)])
def test_a_launcher_without_an_outdir_prints_its_usage_and_runs_nothing(tree, args):
    proc = launch(tree, "reproduce_cpu.sh", *args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: bash launch/reproduce_cpu.sh OUTDIR [:variant]")
    assert not (tree / "args.txt").exists()


def test_prm_init_ablation_refuses_a_workdir_that_is_not_a_reproduction_and_writes_nothing(tree, tmp_path):
    """It made OUTDIR before it looked at REPRODUCTION_WORKDIR."""
    for run in (tmp_path / "missing", tree / "launch"):   # not a directory; a directory without world/ sft/ ...
        proc = launch(tree, "prm_init_ablation.sh", str(run), str(tmp_path / "out"))
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1
        assert not (tmp_path / "out").exists() and not (tree / "args.txt").exists()


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_local_launcher_prints_its_usage_when_asked(tree, flag):
    proc = launch(tree, "local.sh", flag)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: launch/local.sh [-n NUM_PROCESSES]")
    assert proc.stderr == ""
    bad = launch(tree, "local.sh", "-x")
    assert bad.returncode == 2 and "usage: launch/local.sh" in bad.stderr and bad.stdout == ""
