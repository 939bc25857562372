"""The PRM training entry point as 2 CPU processes x 2 devices, against 1 process x 4 devices.

Four runs of ``python -m caper_jax.train`` (through tests/parallel/_mp_worker.py, which only adds
observation hooks), same tiny config, same mesh (fsdp=4), same data:

* reference: 1 process, 4 simulated devices, steps 1..8;
* 2 processes x 2 devices started by ``launch/local.sh`` (a crash): process 1 stalls before step 4,
  after the step-2 checkpoint is committed; the test SIGKILLs it, and local.sh stops process 0;
* the same 2-process command again (a preemption): both processes resume from step 2; once step 4
  is logged, process 1 alone gets SIGTERM, and every host saves one agreed step and exits 143;
* the same command a third time: both processes resume from that step and finish.

Checks: the 2-process loss at every step equals the 1-process loss to ``LOSS_RTOL`` (the programs
differ only in how all-reduces are grouped: in-process vs. gloo across processes, so the last
bits of the fp32 sums may differ); step 3, computed before the kill and again after the resume,
is bit-identical (same program, same restored state, same data position); all hosts report the
same resume step and the same preemption line; metrics are written once per step (process 0 only);
the HF export of the 2-process run holds the same weights as the 1-process export (gathered across
hosts).
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import xla_flags

REPO = pathlib.Path(__file__).resolve().parents[2]
TOTAL_STEPS = 8
CKPT_EVERY = 2
HANG_BEFORE_STEP = 4        # process 1 stalls here, after steps 1..3
LAST_CKPT = (HANG_BEFORE_STEP - 1) // CKPT_EVERY * CKPT_EVERY   # = 2, the newest whole checkpoint
SIGTERM_AFTER_STEP = 4      # the resumed run is preempted once it has logged this step
# 1-process vs 2-process losses differ only in the order of fp32 cross-device sums over a few
# thousand terms: ~sqrt(n) * eps ~ 1e-5 at worst (measured 1.2e-7 with 2 x 4 devices, docs/scale.md).
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
TIMEOUT_S = 600

CONFIG_ARGS = [
    f"--config=configs/prm.py:steps={TOTAL_STEPS}",
    "--config.data.demo_train_size=40", "--config.data.demo_dev_size=10",
    "--config.data.batch_size=8", "--config.data.max_len=128", "--config.data.bucket_lengths=(128,)",
    "--config.data.max_eval_tuples=8", "--config.data.eval_batch_size=8",
    "--config.log_every=1", f"--config.ckpt_every={CKPT_EVERY}", "--config.ckpt_keep=3",
    "--config.eval_every=1000",
]


def _env(tmp: pathlib.Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # Every run compiles the same step; the persistent cache lets the resumed run skip it.
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "CAPER_DISTRIBUTED",
                "CAPER_TEST_HANG"):
        env.pop(key, None)
    env.update(extra)
    return env


def _worker(workdir: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "tests.parallel._mp_worker", *CONFIG_ARGS, f"--workdir={workdir}"]


def _local(tmp: pathlib.Path, workdir: pathlib.Path, logs: pathlib.Path, **env: str) -> subprocess.Popen:
    # -g 1: after the crash, process 0 waits in a collective for its dead peer and ignores SIGTERM; local.sh
    # kills it after 1 s instead of its default 10 (test_local_sh_kills_a_process_that_ignores_sigterm).
    return subprocess.Popen(["bash", str(REPO / "launch" / "local.sh"), "-n", "2", "-d", "2", "-g", "1", "-l", str(logs),
                             "--", *_worker(workdir)], cwd=REPO, env=_env(tmp, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(workdir: pathlib.Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]


def _logged_step(workdir: pathlib.Path) -> int:
    """The newest step in metrics.jsonl while a run writes it (a line being written is skipped)."""
    steps = [0]
    with contextlib.suppress(FileNotFoundError):
        for line in (workdir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                steps.append(json.loads(line).get("step", 0))
    return max(steps)


def _preempted_lines(logs: pathlib.Path) -> dict[int, list[str]]:
    return {i: [line for line in (logs / f"process_{i}.log").read_text().splitlines() if line.startswith("preempted:")]
            for i in (0, 1)}


def _resume_steps(logs: pathlib.Path) -> dict[int, int]:
    out = {}
    for log in sorted(logs.glob("process_*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("MP_WORKER {"):
                record = json.loads(line.removeprefix("MP_WORKER "))
                out[record["process"]] = record["resumed_step"]
    return out


def _committed(checkpoints: pathlib.Path, step: int) -> bool:
    return (checkpoints / str(step) / "caper_manifest.json").is_file()


def _wait_until(predicate, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (status {proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow   # four training processes on two cores, a real SIGKILL and a real SIGTERM
def test_two_processes_match_one_through_a_crash_and_a_preemption(tmp_path):
    reference_dir, multi_dir, logs = tmp_path / "one", tmp_path / "two", tmp_path / "logs"
    multi_dir.mkdir()

    # 1 x 4 reference and the first 2 x 2 run side by side (separate workdirs, separate worlds).
    reference_log = tmp_path / "reference.log"
    with reference_log.open("w") as log:   # a file, not a pipe: nobody reads it until the end
        reference = subprocess.Popen(
            _worker(reference_dir), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env=_env(tmp_path, JAX_PLATFORMS="cpu", NPROC="16", XLA_FLAGS=xla_flags(4)))

    # A crash: process 1 freezes after the step-2 checkpoint and is killed; local.sh stops process 0.
    first = _local(tmp_path, multi_dir, logs / "first", CAPER_TEST_HANG=f"1:{HANG_BEFORE_STEP}")
    _wait_until(lambda: (multi_dir / "hung_1").exists() and _committed(multi_dir / "checkpoints", LAST_CKPT), first,
                f"process 1 stalls after the step-{LAST_CKPT} checkpoint")
    os.kill(int((logs / "first" / "process_1.pid").read_text()), signal.SIGKILL)
    out, _ = first.communicate(timeout=TIMEOUT_S)
    assert first.returncode != 0, out[-3000:]   # local.sh reports the killed process and stops the other
    assert _resume_steps(logs / "first") == {0: -1, 1: -1}
    before_kill = dict(_losses(multi_dir))
    assert sorted(before_kill) == list(range(1, HANG_BEFORE_STEP))
    assert not _committed(multi_dir / "checkpoints", LAST_CKPT + CKPT_EVERY)

    # A preemption notice that reaches one host only: JAX's preemption service names one step at which every
    # host saves (caper_jax.loop.StopRequest), and each stops with the same one line, status 143.
    second = _local(tmp_path, multi_dir, logs / "second")
    _wait_until(lambda: _logged_step(multi_dir) >= SIGTERM_AFTER_STEP, second, f"step {SIGTERM_AFTER_STEP}")
    os.kill(int((logs / "second" / "process_1.pid").read_text()), signal.SIGTERM)
    out, _ = second.communicate(timeout=TIMEOUT_S)
    assert second.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert _resume_steps(logs / "second") == {0: LAST_CKPT, 1: LAST_CKPT}   # all hosts agree
    lines = _preempted_lines(logs / "second")
    assert len(lines[0]) == len(lines[1]) == 1 and lines[0] == lines[1], (lines, out[-3000:])
    saved = int(lines[0][0].split("saving step ")[1].split()[0])
    assert SIGTERM_AFTER_STEP <= saved < TOTAL_STEPS, f"preempted at step {saved}, not before the last step"
    assert _committed(multi_dir / "checkpoints", saved), sorted((multi_dir / "checkpoints").iterdir())

    third = _local(tmp_path, multi_dir, logs / "third")
    out, _ = third.communicate(timeout=TIMEOUT_S)
    assert third.returncode == 0, out[-4000:]
    assert _resume_steps(logs / "third") == {0: saved, 1: saved}
    assert reference.wait(timeout=TIMEOUT_S) == 0, reference_log.read_text()[-4000:]

    # Process 0 alone writes metrics: one line per step; the steps after the step-2 checkpoint ran twice, and
    # the resumed run's rows replaced the first pass's (loop.TrainingRun.resume rewinds metrics.jsonl).
    losses = _losses(multi_dir)
    assert [s for s, _ in losses] == list(range(1, TOTAL_STEPS + 1))
    multi = dict(losses)
    for step in range(1, HANG_BEFORE_STEP):
        assert multi[step] == before_kill[step]   # kept up to the checkpoint, a bit-identical replay after it
    one = dict(_losses(reference_dir))
    # Every logged value is a number (steps/s of the first log line included): JSON has no NaN.
    for row in (json.loads(line) for line in (reference_dir / "metrics.jsonl").read_text().splitlines()):
        assert all(np.isfinite(v) for v in row.values() if isinstance(v, float)), row
    assert sorted(one) == sorted(multi) == list(range(1, TOTAL_STEPS + 1))
    np.testing.assert_allclose([multi[s] for s in sorted(multi)], [one[s] for s in sorted(one)], rtol=LOSS_RTOL)

    # Reports and the HF export exist once, and the export gathered the cross-host shards correctly.
    for name in ("results.json", "localization.md", "loss_curve.png", "hf_export/config.json"):
        assert (multi_dir / name).is_file(), name
    exported, expected = _safetensors(multi_dir / "hf_export"), _safetensors(reference_dir / "hf_export")
    assert sorted(exported) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(exported[name], value, atol=WEIGHT_ATOL, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Cluster launchers, run against stand-ins for scontrol/srun/gcloud that record what they are asked.


def _fake_bin(tmp: pathlib.Path, name: str, body: str) -> None:
    path = tmp / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_launchers_are_valid_bash():
    for script in ("local.sh", "tpu_pod.sh", "gpu_slurm.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=True)


def test_local_sh_kills_a_process_that_ignores_sigterm(tmp_path):
    """Process 1 fails; process 0 ignores SIGTERM (as one waiting in a collective for a dead peer does): local.sh
    sends it SIGKILL once the -g grace is over and exits with the failed process's status.
    Process 1 fails only once process 0 has set its trap: failing at once, local.sh's SIGTERM could reach process 0
    before bash ran `trap` (seen on CI: 0.03 s)."""
    ready = shlex.quote(str(tmp_path / "trap_set"))
    script = (f'if [ "$JAX_PROCESS_ID" = 1 ]; then for _ in $(seq 300); do [ -e {ready} ] && exit 3; sleep 0.05; done; '
              f'exit 4; fi; trap "" TERM; touch {ready}; exec sleep 60')
    start = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "-n", "2", "-g", "1", "-l", str(tmp_path), "--",
                           "bash", "-c", script], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    assert "exited with status 3; stopping the others" in proc.stderr
    assert 1.0 <= elapsed < 8, elapsed   # TERM ignored for the 1-s grace, then KILL: not the default 10 s, nor 60
    bad = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "-g", "soon", "--", "true"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: -g must be a whole number of seconds"


def test_slurm_launcher_wires_every_task_to_the_first_node(tmp_path):
    _fake_bin(tmp_path, "scontrol", 'printf "gpu-a17\\ngpu-a18\\ngpu-b02\\n"\n')
    # srun: run the task command once per task, as SLURM would on each node.
    _fake_bin(tmp_path, "srun", 'for i in $(seq 0 $((SLURM_NTASKS - 1))); do SLURM_PROCID=$i "${@:3}"; done\n')
    venv = tmp_path / "venv"
    _fake_bin(tmp_path, "python", 'echo "$JAX_COORDINATOR_ADDRESS $JAX_NUM_PROCESSES $JAX_PROCESS_ID $PWD $*"\n')
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(tmp_path / "bin" / "python")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-a[17-18],gpu-b02",
               SLURM_NTASKS="3", CAPER_VENV=str(venv), CAPER_REPO=str(REPO), CAPER_WORKDIR="/shared/run",
               CAPER_CONFIG="configs/prm.py:model=qwen35_9b", CAPER_ARGS="--config.data.dir=/data/spider")
    out = subprocess.run(["bash", str(REPO / "launch" / "gpu_slurm.sbatch")], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out == [f"gpu-a17:12355 3 {i} {REPO} -m caper_jax.train --config=configs/prm.py:model=qwen35_9b "
                   f"--workdir=/shared/run --config.data.dir=/data/spider" for i in range(3)]


def test_tpu_launcher_runs_the_same_command_on_all_workers(tmp_path):
    log = tmp_path / "gcloud.log"
    _fake_bin(tmp_path, "gcloud", f'printf "%s\\n" "$@" > {log}\n')
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", PROJECT="proj", ZONE="us-east5-a",
               TPU_NAME="caper-v5p", BUCKET="bkt", RUN="prm9b", CAPER_ARGS="--config.model.hf_dir=/ckpt/q9b")
    subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh"), "train"], env=env, check=True)
    args = log.read_text().splitlines()
    assert args[:6] == ["compute", "tpus", "tpu-vm", "ssh", "caper-v5p", "--worker=all"]
    assert "--zone=us-east5-a" in args and "--project=proj" in args
    command = " ".join(next(a for a in args if a.startswith("--command=")).split())
    assert ("CAPER_DISTRIBUTED=auto .venv/bin/python -m caper_jax.train "
            "--config='configs/prm.py:model=qwen35_9b,data=spider' --workdir=/gcs/bkt/caper/prm9b "
            "--config.model.hf_dir=/ckpt/q9b") in command
    missing = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh"), "train"], capture_output=True, text=True,
                             env={**env, "BUCKET": ""}, check=False)
    assert missing.returncode != 0 and "BUCKET" in missing.stderr
