"""`python -m caper_jax.train`: config mistakes are refused with one clear line, before any work."""
import pytest

from tests.helpers import run_train


@pytest.mark.parametrize("args, message", [
    (["--config=configs/prm.py", "--config.optim.lrr=1"],
     "unknown config key 'optim.lrr'; did you mean ['optim.lr'"),
    (["--config=configs/prm.py", "--config.optim.lr=abc"], "could not convert string to float"),
    (["--config=configs/prm.py:modle=tiny"], "error: invalid config: unknown config arg 'modle'; known: ['data'"),
    (["--config=configs/prm.py", "--workdri=/tmp/x"], "error: Unknown command line flag 'workdri'. Did you mean: workdir"),
    # config_flags hands back the config file's whole traceback in its error: only its last line is shown
    (["--config=configs/prm.py:steps=abc"], "Error whilst parsing config file: ValueError: config arg steps='abc' is not int"),
    (["--config=configs/prm.py", "--config.data.kind=bird"], "data.kind='bird'; expected 'demo' or 'spider'"),
    (["--config=configs/prm.py", "--config.loss.form=hinge"], "loss form 'hinge'"),
    (["--config=configs/prm.py", "--config.loss.lm_coef=-1"], "lm_coef must be >= 0, got -1.0"),
    (["--config=configs/prm.py", "--config.data.batch_size=0"], "data.batch_size=0 and data.eval_batch_size=32 must be >= 1"),
    (["--config=configs/prm.py", "--config.data.within_batch_size=-4"],
     "data.within_batch_size=-4 must be >= 0"),
    (["--config=configs/prm.py", "--config.data.counterfactual_repeat=0"],
     "data.counterfactual_repeat=0 must be >= 1"),
    (["--config=configs/prm.py", "--config.mesh_shape.fsdp=3"], "mesh shape (1, 3, 1) needs 3 devices"),
    (["--config=configs/prm.py", "--config.annotate.semantics=sets"],
     "annotate.semantics='sets'; expected 'spider' or 'bird'"),
    (["--config=configs/sft.py", "--config.data.kind=spider"], "data.kind='spider' needs --config.data.dir="),
    (["--config=configs/grpo.py", "--config.data.kind=spider", "--config.data.dir=/tmp"],
     "Spider data needs a tokenizer: set model.tokenizer_dir or model.hf_dir"),
    # Bad-input audit (2026-12-06): each of these was a traceback, or (lr) accepted.
    (["--config=configs/prm.py", "--config.trainer.stepz=3"], "unknown config key 'trainer.stepz'"),
    (["--config=configs/prmm.py"], "--config: cannot load the config file: [Errno 2] No such file"),
    (["--config=configs/prm.py", "--config.optim.lr=nan"], "optim.lr=nan must be a finite number > 0"),
    (["--config=configs/prm.py", "--config.optim.lr=inf"], "optim.lr=inf must be a finite number > 0"),
    (["--config=configs/grpo.py", "--config.policy.sft_workdir=/nonexistent/sft"],
     "policy.sft_workdir='/nonexistent/sft': /nonexistent/sft does not exist"),
])
def test_bad_config_is_one_clear_error(args, message, tmp_path):
    result = run_train(*args, tmp_path=tmp_path)
    assert result.returncode == 2, "a refused command line exits with the usage status, as every other command"
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "w").exists(), "nothing may be written for a refused config"


def test_dry_run_refuses_an_unknown_preset_even_with_an_hf_dir(tmp_path):
    """model.hf_dir lets a run through whatever the preset; a dry run compiles the preset's shapes."""
    result = run_train("--config=configs/prm.py", "--config.model.preset=qwen35_0b", "--config.model.hf_dir=/x",
                       "--dry_run", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "invalid config: model.preset='qwen35_0b': a dry run compiles a preset's shapes" in result.stderr, \
        result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_forked_run_answers_as_the_command_line_does(tmp_path):
    """run_train forks each run from a server that imported caper_jax.train once; the command line itself
    (a fresh interpreter) must give the same exit status and the same output."""
    args = ("--config=configs/prm.py", "--config.optim.lrr=1")
    forked, fresh = run_train(*args, tmp_path=tmp_path), run_train(*args, tmp_path=tmp_path, fresh=True)
    assert fresh.returncode == forked.returncode == 2
    assert (fresh.stdout, fresh.stderr) == (forked.stdout, forked.stderr)
    assert "unknown config key 'optim.lrr'" in fresh.stderr and "Traceback" not in fresh.stderr


def test_a_data_dir_without_a_layout_is_one_clear_error(tmp_path):
    """Whether data.dir holds a Spider/BIRD layout is found when the run opens it: one line, no traceback."""
    result = run_train("--config=configs/prm.py", "--config.data.kind=spider", f"--config.data.dir={tmp_path / 'none'}",
                       f"--config.model.tokenizer_dir={tmp_path}", tmp_path=tmp_path)
    assert result.returncode == 2
    assert f"error: data.dir {tmp_path / 'none'} does not exist" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_dry_run_check_accepts_the_reproduction_configs():
    """configs/reproduce.py and spider_verifier.py have no model of their own: their stages' are checked.
    Each config as written is accepted, and an unknown preset in any one of its stages is refused."""
    from caper_jax.experiments.settings import ReproduceSettings, SpiderVerifierSettings
    from caper_jax.loop import check_dry_run
    from caper_jax.settings import from_config, replace
    from configs import reproduce, spider_verifier

    full = reproduce.get_config("full")
    full.data.dir = "/data/spider"          # :full reads Spider/BIRD layout data from the command line
    for config, cls in ((reproduce.get_config(), ReproduceSettings), (full, ReproduceSettings),
                        (spider_verifier.get_config(), SpiderVerifierSettings)):
        assert "model" not in config, "a reproduction config's models are its stages'"
        stages = [name for name, value in config.items() if hasattr(value, "get") and "model" in value]
        assert {"sft", "prm"} <= set(stages), stages
        settings = from_config(cls, config)
        check_dry_run(settings)             # raises on a refused preset
        for stage in stages:
            # A preset the dry run cannot compile, next to an HF directory (which lets a run through).
            broken = replace(settings, {f"{stage}.model.preset": "qwen35_0b", f"{stage}.model.hf_dir": "/x"})
            with pytest.raises(ValueError, match=r"model.preset='qwen35_0b': a dry run compiles a preset's shapes"):
                check_dry_run(broken)


@pytest.mark.slow   # a real training process, stopped by a real SIGTERM
def test_sigterm_saves_the_step_it_is_on_and_exits_143(tmp_path):
    """A scheduler's preemption notice: the step in progress is finished and saved (ckpt_every=1000 saves
    only the first), one line says so and the exit status is 128 + SIGTERM (resuming from it:
    tests/test_loop.py)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO

    workdir = tmp_path / "w"
    command = [sys.executable, "-m", "caper_jax.train", "--config=configs/prm.py:steps=1000",
               "--config.data.demo_train_size=40", "--config.data.demo_dev_size=10", "--config.data.batch_size=8",
               "--config.data.max_len=128", "--config.data.bucket_lengths=(128,)", "--config.data.max_eval_tuples=8",
               "--config.data.eval_batch_size=8", "--config.log_every=1", "--config.ckpt_every=1000",
               "--config.eval_every=1000", f"--workdir={workdir}"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] >= 2, saved    # (orbax also saves the first step)
    assert f"preempted: stopped by SIGTERM after saving step {saved[-1]} in" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged[-1] == saved[-1]


def test_prm_dry_run_reports_the_step_it_compiles(tmp_path):
    """The tiny PRM's dry run: its parameter count is the preset model's (built here for real), and the
    batch it describes includes the within-trajectory groups the step compiles."""
    import jax
    from flax import nnx

    from caper_jax.models.presets import model_preset
    from caper_jax.prm.model import ClausePRM

    result = run_train("--config=configs/prm.py", "--dry_run", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    prm = ClausePRM(model_preset("tiny"), rngs=nnx.Rngs(0))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(prm, nnx.Param)))
    assert f"parameters         {n_params:,} " in result.stdout, result.stdout
    assert "preset tiny (vocabulary 256, the preset's: a run uses its tokenizer's)" in result.stdout
    assert "global batch 8 pairs + 16 within-trajectory groups x 384 tokens" in result.stdout
