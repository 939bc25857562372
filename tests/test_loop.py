"""caper_jax.sections and caper_jax.loop: the config rules the three trainers share (one rule each), and the
run loop's logging, resume and non-finite stop on a toy state."""
from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog

from caper_jax import loop
from caper_jax.utils.errors import NonFiniteLossError
from caper_jax.utils.monitoring import read_metrics
from caper_jax.utils.optim import init_state, learning_rate


def _trainers():
    from caper_jax.prm import trainer as prm
    from caper_jax.rl import trainer as grpo
    from caper_jax.sft import trainer as sft
    from configs import grpo as grpo_config
    from configs import prm as prm_config
    from configs import sft as sft_config

    return {"prm": (prm.validate, prm_config.get_config), "sft": (sft.validate, sft_config.get_config),
            "grpo": (grpo.validate, grpo_config.get_config)}


@pytest.mark.parametrize("trainer", ["prm", "sft"])
def test_bucket_lengths_must_strictly_increase(trainer):
    """One rule (SFT's): sorted and without repeats; the PRM check used to let (128, 128, 384) through."""
    validate, get_config = _trainers()[trainer]
    config = get_config()
    validate(config)
    top = config.data.bucket_lengths[-1]
    for bad in [(top, top), (top, top // 2), (top // 2, top + 1)]:
        config.data.bucket_lengths = bad
        with pytest.raises(ValueError, match="must be increasing and <= data.max_len"):
            validate(config)


@pytest.mark.parametrize("trainer", ["prm", "sft", "grpo"])
def test_unknown_preset_is_accepted_only_with_an_hf_dir(trainer):
    """One rule (PRM's and SFT's): an HF directory brings its architecture; GRPO used to refuse it."""
    validate, get_config = _trainers()[trainer]
    config = get_config()
    config.model.preset = "qwen35_0b"
    with pytest.raises(ValueError, match="model.preset='qwen35_0b'; expected one of .* or model.hf_dir"):
        validate(config)
    config.model.hf_dir = "/ckpt/Qwen3.5"
    validate(config)


@pytest.mark.parametrize("trainer", ["prm", "sft", "grpo"])
def test_shared_checks_refuse_the_same_way(trainer):
    validate, get_config = _trainers()[trainer]
    for field, value, message in [("model.remat", "some", "model.remat='some'; expected one of"),
                                  ("data.kind", "bird", "data.kind='bird'; expected 'demo' or 'spider'"),
                                  ("optim.lr", 0.0, "optim.lr > 0"), ("log_every", 0, "log_every must be >= 1"),
                                  ("ckpt_every", 0, "ckpt_every must be >= 1")]:
        config = get_config()
        section, _, key = field.rpartition(".")
        (config[section] if section else config)[key] = value
        with pytest.raises(ValueError, match=message):
            validate(config)


def _toy_run(tmp_path, total_steps=5):
    """A TrainingRun over a three-number state (no model): what the loop does around any trainer's step."""
    from caper_jax.settings import replace
    from caper_jax.sft import trainer as sft
    from configs import sft as sft_config

    settings = replace(sft.validate(sft_config.get_config()), {
        "log_every": 2, "ckpt_every": 2, "ckpt_keep": 2, "optim.total_steps": total_steps, "optim.lr": 0.1,
        "optim.warmup_steps": 0, "optim.max_consecutive_nonfinite": 1, "export_hf": False})
    run = loop.TrainingRun.start(settings, tmp_path / "run")
    run.use_mesh()
    state = init_state({"w": jnp.zeros(3)}, optax.sgd(0.1))
    return run, run.resume(state, None, run_record=None)


def _count(state, step):
    state = state.replace(step=state.step + 1, params={"w": state.params["w"] + 1})
    return state, {"loss": jnp.float32(step)}


def test_loop_logs_window_means_and_resumes(tmp_path):
    run, state = _toy_run(tmp_path)
    state = run.train(state, _count, log_line=lambda s: f"  loss {s['train/loss']:.1f}")
    run.finish(None, curves=["train/loss"], png="loss.png", title="toy")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in rows] == [(2, 1.5), (4, 3.5), (5, 5.0)]
    assert list(rows[0]) == ["step", "train/loss", "train/lr", "train/steps_per_s"]
    # the rate the logged step's update applied: the schedule at step - 1 (optim.learning_rate_per_update)
    assert [r["train/lr"] for r in rows] == pytest.approx([float(learning_rate(run.settings.optim)(s - 1))
                                                          for s in (2, 4, 5)])

    run, state = _toy_run(tmp_path, total_steps=6)
    assert int(state.step) == 5 and float(state.params["w"][0]) == 5.0
    run.train(state, _count, log_line=lambda s: "")
    run.finish(None, curves=[], png="loss.png", title="toy")
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [2, 4, 5, 6]


def test_a_resumed_run_logs_no_step_twice(tmp_path):
    """Interrupted after step 5 was logged but before its checkpoint was written: steps 5.. are redone,
    so the first pass's row at step 5 goes (in TensorBoard it is hidden by purge_step)."""
    import shutil

    run, state = _toy_run(tmp_path)
    run.train(state, _count, log_line=lambda s: "")
    run.finish(None, curves=[], png="loss.png", title="toy")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "5")
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [2, 4, 5]
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "train/lo')          # the half-written line of a killed process

    run, state = _toy_run(tmp_path, total_steps=7)
    assert int(state.step) == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [2, 4]
    run.train(state, _count, log_line=lambda s: "")
    run.finish(None, curves=[], png="loss.png", title="toy")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in rows] == [(2, 1.5), (4, 3.5), (6, 5.5), (7, 7.0)]
    # The resumed writer's event file starts with tensorboardX's purge marker: a SessionLog START at step 5,
    # which makes TensorBoard hide the first pass's events from step 5 on.
    starts = [(event.step, event.session_log.status) for path in (tmp_path / "run" / "tensorboard").iterdir()
              for event in _events(path) if event.HasField("session_log")]
    assert starts == [(5, SessionLog.START)]


def _events(path):
    """The records of a TensorBoard event file (TFRecord framing: length, its CRC, data, data CRC)."""
    import struct

    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        event = Event()
        event.ParseFromString(data[offset + 12: offset + 12 + length])
        yield event
        offset += 12 + length + 4


def test_metric_writer_writes_tensorboard_scalars_without_importing_torch(tmp_path):
    """torch is installed here (a test dependency): tensorboardX would import it (1.4 s, ~200 MB) in every
    process that writes metrics. A fresh process writes two scalars; torch was never imported, is importable
    afterwards, and the event file holds both values."""
    import subprocess
    import sys

    from tests.helpers import REPO

    code = ("import sys; import numpy as np; from caper_jax.utils.monitoring import MetricWriter; "
            f"w = MetricWriter({str(tmp_path)!r}); w.write(3, {{'train/loss': 0.25, 'eval/x y': np.float32(2)}}); "
            "print('torch' in sys.modules); import torch; print(torch.ones(1).item())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "1.0"]
    scalars = {value.tag: (event.step, value.simple_value) for path in (tmp_path / "tensorboard").iterdir()
               for event in _events(path) for value in event.summary.value}
    assert scalars == {"train/loss": (3, 0.25), "eval/x_y": (3, 2.0)}
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 3, "train/loss": 0.25, "eval/x y": 2.0}]


def test_loop_stops_on_consecutive_refused_updates(tmp_path):
    run, state = _toy_run(tmp_path)

    def refuse(state, step):
        return state.replace(step=state.step + 1, nonfinite=state.nonfinite + 1), {"loss": jnp.float32(jnp.nan)}

    with pytest.raises(NonFiniteLossError, match=r"step 2: 2 consecutive non-finite losses/gradients \(limit 1\); "
                                                 r"the updates were refused and the last good checkpoint in .*"
                                                 r"checkpoints is intact\. Lower optim.lr or check the data\."):
        run.train(state, refuse, log_line=lambda s: "")


def test_an_evaluate_hook_needs_eval_every(tmp_path):
    run, state = _toy_run(tmp_path)
    with pytest.raises(ValueError, match="eval_every=0 must be >= 1 when an evaluate hook is given"):
        run.train(state, _count, log_line=lambda s: "", evaluate=lambda state: {})


def test_a_policy_run_stopped_during_its_export_writes_no_results_json(tmp_path, monkeypatch):
    """results.json marks a stage done (caper_jax.experiments.stages.completion), so it comes after the HF export."""
    import types

    import caper_jax.models
    from caper_jax.settings import replace

    run, state = _toy_run(tmp_path)
    run.train(state, _count, log_line=lambda s: "")
    run.settings = replace(run.settings, {"export_hf": True})

    class Stopped(Exception):
        pass

    def killed(*args, **kwargs):
        raise Stopped("stopped during the export")

    monkeypatch.setattr(caper_jax.models, "to_hf", killed)
    with pytest.raises(Stopped):
        loop.finish_policy_run(run, {"steps": 5}, [], types.SimpleNamespace(config=None), None, curves=[],
                               png="loss.png", title="toy")
    assert not (run.workdir / "results.json").exists()


def test_a_run_resumed_past_its_total_steps_is_refused(tmp_path):
    """Rerun with a smaller optim.total_steps (a typo: 3 for 30), a workdir at step 5 "finished" at once
    and wrote the step-5 model's evaluation as step 3's; now it says so."""
    from caper_jax.utils.errors import CheckpointError

    run, state = _toy_run(tmp_path)
    run.train(state, _count, log_line=lambda s: "")
    run.finish(None, curves=[], png="loss.png", title="toy")
    with pytest.raises(CheckpointError, match=r"holds step 5, past optim.total_steps=3"):
        _toy_run(tmp_path, total_steps=3)
    run, state = _toy_run(tmp_path, total_steps=5)     # the same total: resumes as before
    assert int(state.step) == 5


def test_sigterm_saves_the_current_step_and_stops(tmp_path):
    """A preemption notice (a real SIGTERM to this process) during step 3: the step is finished and saved
    although ckpt_every=2 would not save it, the run stops with Preempted, SIGTERM's handler is given
    back, and the same run resumes at step 3."""
    import os
    import signal

    from caper_jax import checkpoint as ckpt_lib
    from caper_jax.utils.errors import Preempted

    run, state = _toy_run(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)

    def preempted(state, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return _count(state, step)

    with pytest.raises(Preempted, match="stopped by SIGTERM after saving step 3") as stopped:
        run.train(state, preempted, log_line=lambda s: "")
    assert stopped.value.step == 3 and signal.getsignal(signal.SIGTERM) is handler
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert ckpt_lib.verify(ckpt_dir / "3") is None, sorted(ckpt_dir.iterdir())
    run.checkpointer.close()
    run, state = _toy_run(tmp_path)
    assert int(state.step) == 3 and float(state.params["w"][0]) == 3.0
    run.checkpointer.close()


def test_ctrl_c_finishes_the_checkpoint_being_written(tmp_path):
    """Ctrl-C right after a save used to leave <step>.orbax-checkpoint-tmp (the step lost) and orbax's
    commit threads printing tracebacks as the interpreter shut down; the save in flight is now finished."""
    from caper_jax import checkpoint as ckpt_lib

    run, state = _toy_run(tmp_path)

    def interrupted(state, step):
        if step == 3:
            raise KeyboardInterrupt
        return _count(state, step)

    with pytest.raises(KeyboardInterrupt):
        run.train(state, interrupted, log_line=lambda s: "")
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert (ckpt_dir / "2").is_dir() and ckpt_lib.verify(ckpt_dir / "2") is None, sorted(ckpt_dir.iterdir())
    run.checkpointer.close()
