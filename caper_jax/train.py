"""Train a Clause-PRM, a GRPO policy or an SFT policy from an ml_collections config.

    python -m caper_jax.train --config=configs/prm.py --workdir=runs/prm_demo
    python -m caper_jax.train --config=configs/prm.py:model=qwen35_9b --dry_run
    python -m caper_jax.train --config=configs/prm.py:model=qwen35_9b,pod=v5e-256 --compile_for=v5e-256
    python -m caper_jax.train --config=configs/grpo.py --workdir=runs/grpo_demo
    python -m caper_jax.train --config=configs/sft.py --workdir=runs/sft_demo
    python -m caper_jax.train --config=configs/reproduce.py --workdir=runs/reproduce   # the whole experiment
    python -m caper_jax.train --config=configs/spider_verifier.py --workdir=runs/spider_verifier

``--config.a.b=value`` overrides any field; an unknown key or a value of the wrong type is refused with a
clear message before anything is built or compiled. ``config.trainer`` picks the loop; each loop is a
module with ``validate(config) -> settings`` (the config turned once into the trainer's frozen settings,
``caper_jax.settings``; raises ValueError on a bad value, before anything is built), ``run(settings, workdir)``
and ``dry_run(settings)``; each trainer also ``compile_programs(settings)``, every program of its step for
``--compile_for`` (``caper_jax.parallel.compile_for``).

Exit status: 0 done; 2 a bad command line, config, workdir or input (one ``error:`` line on stderr);
1 a run stopped by non-finite losses; 130 Ctrl-C; 143 SIGTERM (after saving the current step).
"""
from __future__ import annotations

if __name__ == "__main__":   # first, before any import allocates: XLA:CPU's per-step temporaries
    from caper_jax.utils.host_memory import reexec_with_huge_pages   # in huge pages (its docstring)

    reexec_with_huge_pages()

import importlib
import logging
import pathlib
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from caper_jax.data.spider import DataError
from caper_jax.data.data_world import WorldError
from caper_jax.parallel import multihost
from caper_jax.utils import atomic, cli
from caper_jax.utils.errors import CheckpointError, NonFiniteLossError, Preempted

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/prm.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics, plots and exports go.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Lower and compile the train step on abstract shapes and "
                             "report parameters, FLOPs and per-device memory; allocate no weights.")
_COMPILE_FOR = flags.DEFINE_string(
    "compile_for", None, "A Cloud TPU slice (v5e-256, v5p-64, v6e-64, ...): compile every program of a step with "
    "the TPU compiler for it, here, with no TPU; print memory per chip and collective bytes, last a JSON line; "
    "exit 2 when a program does not fit with 5 % headroom (needs libtpu: pip install -e '.[tpu]').")

TRAINERS = {
    "prm": "caper_jax.prm.trainer",
    "grpo": "caper_jax.rl.trainer",
    "sft": "caper_jax.sft.trainer",
    # The experiments: all of the above in sequence, plus evaluation and report (caper_jax.experiments).
    "reproduce": "caper_jax.experiments.miniature",
    "spider_verifier": "caper_jax.experiments.spider_verifier",
}


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with config typos turned into one readable line instead of a traceback."""
    return cli.parse_flags(argv, flags.FLAGS, config="config")


def workdir_problem(workdir: str) -> str | None:
    """Why ``workdir`` cannot hold a run (a file, or not writable), checked before any work; else None.

    A missing workdir is fine (the trainer creates it) when its nearest existing parent is a
    writable directory. Writability is probed by creating a file, which is what counts (root,
    read-only mounts, immutable directories).
    """
    if "://" in workdir:   # pathlib would quietly turn gs://b/x into the local folder gs:/b/x
        return (f"--workdir={workdir}: URLs are not supported; mount the bucket (e.g. gcsfuse) and pass its "
                "POSIX path (docs/scale.md)")
    path = pathlib.Path(workdir)
    if path.exists() and not path.is_dir():
        return f"--workdir={workdir} is a file, not a directory"
    try:
        atomic.check_output_dir(path, flag="--workdir")
    except atomic.OutputError as error:
        return str(error)
    return None


def compile_for_slice(trainer, config, slice_name: str) -> None:
    """``--compile_for``: the trainer's every program compiled for a TPU slice (``caper_jax.parallel.compile_for``);
    exit 2 with one ``error:`` line when the slice is unknown, libtpu is missing, the config does not fit the
    slice's mesh, or a program does not fit its chip."""
    from caper_jax.loop import check_dry_run
    from caper_jax.parallel import compile_for, slices, target

    if not hasattr(trainer, "compile_programs"):
        cli.usage_error(f"--compile_for: config.trainer={config.trainer!r} has no programs of its own; compile its "
                        "stages' configs (configs/prm.py, sft.py, grpo.py)")
    try:
        tpu = slices.tpu_slice(slice_name)
        devices = slices.slice_devices(tpu)
    except ValueError as e:
        cli.usage_error(str(e))
    with target.compiling_for(devices):
        try:
            settings = trainer.validate(config)
            check_dry_run(settings)
        except (ValueError, KeyError) as e:
            cli.usage_error(f"invalid config for {tpu.name}: {e}")
        try:
            report = compile_for.compile_for(tpu, settings, trainer.compile_programs)
        except compile_for.CompileRefused as e:
            cli.usage_error(str(e))
    if (problem := compile_for.first_misfit(report)) is not None:
        cli.usage_error(problem)


def main(argv: list[str]) -> None:
    del argv
    logging.getLogger("caper_jax").setLevel(logging.INFO)
    # orbax and grain log every checkpoint phase at INFO through absl; keep the run's own lines readable.
    logging.getLogger("absl").setLevel(logging.WARNING)
    config = _CONFIG.value
    if (problem := cli.config_load_error(config)) is not None:   # a missing config file: one line, not a traceback
        cli.usage_error(problem)
    if config is None:
        cli.usage_error("--config is required, e.g. --config=configs/prm.py")
    if config.trainer not in TRAINERS:
        cli.usage_error(f"config.trainer={config.trainer!r}; known trainers: {sorted(TRAINERS)}")
    trainer = importlib.import_module(TRAINERS[config.trainer])
    if _COMPILE_FOR.value:
        compile_for_slice(trainer, config, _COMPILE_FOR.value)
        return
    # Before anything touches a JAX backend (validate counts devices): a multi-process run must
    # join jax.distributed first, or every process sees only its own devices.
    multihost.initialize()
    try:
        settings = trainer.validate(config)
        if _DRY_RUN.value:
            # Deferred like the trainer modules (imported above): a flag error answers before flax and orbax load.
            from caper_jax.loop import check_dry_run

            check_dry_run(settings)
    except (ValueError, KeyError) as e:
        cli.usage_error(f"invalid config: {e}")
    if _DRY_RUN.value:
        trainer.dry_run(settings)
        return
    if not _WORKDIR.value:
        cli.usage_error("--workdir is required (checkpoints, metrics and exports go there)")
    problem = workdir_problem(_WORKDIR.value)
    if problem:
        cli.usage_error(problem)
    try:
        trainer.run(settings, _WORKDIR.value)
    # Bad inputs found when the run opens them: data.dir not a usable layout or a malformed split file,
    # a run to start from (or resume) that is missing, damaged or of another model. Their messages say
    # what to do; a traceback adds nothing. Exit status 2, as for a bad command line and as the other
    # commands give a bad input; 1 is a run that failed in itself (non-finite losses).
    except (WorldError, DataError, CheckpointError) as e:
        cli.usage_error(str(e))
    except NonFiniteLossError as e:
        sys.exit(f"error: {e}")
    except Preempted as e:
        print(f"preempted: {e}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except KeyboardInterrupt:
        print(f"interrupted: training stopped; the newest whole checkpoint in {_WORKDIR.value}/checkpoints is "
              "kept, and the same command resumes from it", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
