"""The run loop the three trainers share (Clause-PRM, SFT, GRPO): everything around their step.

Learnt from levanter's Trainer with hooks. ``TrainingRun`` holds what every run has: its settings (the
trainer's frozen dataclass, ``caper_jax.settings``), the workdir, the main
process flag, the mesh and sharding rules, the metric writer, the checkpointer with resume (state and
data iterator), the wall-clock start. ``TrainingRun.train`` steps, logs every ``log_every`` steps (means of
the train metrics, learning rate, steps/s and ETA), evaluates every ``eval_every`` steps, stops with
``NonFiniteLossError`` after too many refused updates and checkpoints (always at the last step). A
trainer keeps only what is its own: the model, the step, evaluation and its report.

Also here, once for the three: the dry run of a train step on abstract shapes (``dry_run``), the sharded
train state (``create_state``), the jitted state-donating step cached per process (``jit_state_step``) and
the end of a policy run (``finish_policy_run``, SFT and GRPO).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from caper_jax import checkpoint as ckpt_lib
from caper_jax.models.presets import PRESETS, model_preset
from caper_jax.parallel import dry_run as dry_run_lib
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel import multihost
from caper_jax.parallel import rules as rules_lib
from caper_jax.parallel import target
from caper_jax.sections import TrainerSettings
from caper_jax.settings import as_dict
from caper_jax.utils.errors import NonFiniteLossError, Preempted
from caper_jax.utils.monitoring import MetricWriter, Progress, plot_curves, read_metrics
from caper_jax.utils.optim import TrainState, init_state, learning_rate, make_optimizer

# -- settings


def mesh_and_rules(settings) -> tuple[Any, tuple]:
    """The device mesh of ``settings.mesh_shape`` (over the compile target's devices: ``parallel.target``) and
    the logical-axis rules."""
    return mesh_lib.make_mesh(dict(settings.mesh_shape), devices=target.devices()), settings.sharding_rules


# -- state and jitted steps


def create_state(model: nnx.Module, tx, mesh, rules) -> tuple[Any, TrainState, Any]:
    """(graphdef, sharded TrainState, its shardings) for a built model."""
    graphdef, params = nnx.split(model)
    shardings = rules_lib.logical_to_sharding(jax.eval_shape(lambda p: init_state(p, tx), params), mesh, rules)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda p: init_state(p, tx), out_shardings=shardings)(params)
    return graphdef, state, shardings


_PROGRAMS: dict[tuple, Callable] = {}


def jit_state_step(step: Callable, key: tuple | None, state_sharding=None) -> Callable:
    """``step(state, batch) -> (state, metrics)`` jitted with the state donated (and laid out as
    ``state_sharding``); cached per process under ``key`` plus the shardings, or not cached when
    ``key`` is None (the dry run's abstract state).

    ``key`` must hold everything ``step`` depends on (graphdef, hyperparameters); a resumed or
    repeated run in the same process then reuses the compiled program instead of tracing and
    compiling a fresh ``jax.jit`` of a new partial."""
    def build():
        return jax.jit(step, donate_argnums=0, out_shardings=None if state_sharding is None else (state_sharding, None))
    if key is None:
        return build()
    key = (*key, None if state_sharding is None else tuple(jax.tree.leaves(state_sharding)))
    if key not in _PROGRAMS:
        _PROGRAMS[key] = build()
    return _PROGRAMS[key]


# -- the run


class StopRequest:
    """SIGTERM, a scheduler's preemption notice, as a request to save after the current step and stop.

    One process: a handler notes the signal (Python's default would end the process at once and lose
    the steps since the last save). Several processes (jax.distributed): JAX's preemption service
    owns SIGTERM and names one step at which every host answers True
    (``multihost_utils.reached_preemption_sync_point``; orbax's ``should_save`` saves there too), so
    all hosts save the same step. ``at(step)`` is called once per step on every process."""

    def __enter__(self) -> "StopRequest":
        self.signalled = False
        self._previous = None
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.signalled = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def at(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self.signalled
        from jax.experimental import multihost_utils  # only multi-host runs reach it

        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:   # the preemption service is off (jax_enable_preemption_service=False)
            return False


def train_means(fetched: list[dict]) -> dict[str, float]:
    """``train/<name>``: the mean of each metric over the fetched steps (or updates)."""
    return {f"train/{k}": float(np.mean([m[k] for m in fetched])) for k in fetched[0]}


@dataclasses.dataclass
class TrainingRun:
    """One trainer run in ``workdir``: start with ``TrainingRun.start``, then ``use_mesh``, ``resume``,
    ``train`` and ``finish``."""

    settings: Any                      # the trainer's settings (caper_jax.sections.TrainerSettings)
    workdir: pathlib.Path
    main: bool
    writer: MetricWriter
    started: float
    mesh: Any = None
    rules: tuple = ()
    checkpointer: ckpt_lib.Checkpointer | None = None
    data_iterator: Any = None
    run_record: dict | None = None     # caper_jax.runs.record, saved with every checkpoint

    @classmethod
    def start(cls, settings, workdir: str | pathlib.Path) -> TrainingRun:
        started = time.perf_counter()
        multihost.initialize()
        workdir = pathlib.Path(workdir)
        main = multihost.is_main_process()
        if main:
            workdir.mkdir(parents=True, exist_ok=True)
        return cls(settings, workdir, main, MetricWriter(workdir, enabled=main), started)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def use_mesh(self) -> tuple[Any, tuple]:
        """Makes the run's mesh and rules (after the data: building a world needs no devices)."""
        self.mesh, self.rules = mesh_and_rules(self.settings)
        return self.mesh, self.rules

    def resume(self, state: TrainState, data_iterator, *, run_record: dict) -> TrainState:
        """The newest whole checkpoint's state, the iterator set to its position; else ``state``.
        ``run_record`` (``caper_jax.runs.record``: architecture, tokenizer) is saved with every checkpoint."""
        settings = self.settings
        self.data_iterator = data_iterator
        self.run_record = run_record
        self.checkpointer = ckpt_lib.Checkpointer(self.workdir / "checkpoints", max_to_keep=settings.ckpt_keep,
                                                  save_interval_steps=settings.ckpt_every)
        restored = self.checkpointer.restore_latest(ckpt_lib.abstract_state(state), data_iterator=data_iterator)
        if restored is None:
            return state
        if restored.step > settings.optim.total_steps:   # else the run "finishes" at once, reporting the later step
            raise ckpt_lib.CheckpointError(
                f"{self.workdir / 'checkpoints'} holds step {restored.step}, past optim.total_steps="
                f"{settings.optim.total_steps}: give a new --workdir, or total_steps >= {restored.step} to go on")
        multihost.log_main("resumed from step %d", restored.step)
        self.writer.rewind(restored.step)
        return restored.state

    def train(self, state: TrainState, step_fn: Callable[[TrainState, int], tuple[TrainState, Any]], *,
              log_line: Callable[[dict], str], summarize: Callable[[list, float], dict] | None = None,
              steps_per_s_key: str = "train/steps_per_s", evaluate: Callable[[TrainState], dict] | None = None,
              eval_every: int = 0) -> TrainState:
        """Steps ``state`` from its step to ``optim.total_steps``; returns it once the last save is done.

        ``step_fn(state, step) -> (state, metrics)``. Every ``log_every`` steps (and the last) the metrics
        since the previous log line are fetched and ``summarize(fetched, seconds)`` (default: their
        ``train_means``) becomes the logged row, with the learning rate and steps/s added;
        ``log_line(row)`` follows the progress on the log line. ``evaluate(state)``'s metrics are
        written every ``eval_every`` steps but the last (the trainer's own final evaluation follows).
        """
        settings = self.settings
        if evaluate is not None and eval_every < 1:
            raise ValueError(f"eval_every={eval_every} must be >= 1 when an evaluate hook is given")
        total = settings.optim.total_steps
        progress = Progress(total, int(state.step))
        window, window_start = [], time.perf_counter()
        try:
            with jax.set_mesh(self.mesh), StopRequest() as stop:
                for step in range(int(state.step) + 1, total + 1):
                    state, metrics = step_fn(state, step)
                    window.append(metrics)
                    if step % settings.log_every == 0 or step == total:
                        fetched = jax.device_get(window)
                        seconds, window_start = time.perf_counter() - window_start, time.perf_counter()
                        window = []
                        summary = summarize(fetched, seconds) if summarize else train_means(fetched)
                        # the rate this step's updates applied (optim.learning_rate_per_update)
                        summary["train/lr"] = float(learning_rate(settings.optim)(step - 1))
                        line = progress.update(step)
                        summary[steps_per_s_key] = progress.steps_per_s
                        self.writer.write(step, summary)
                        multihost.log_main("%s%s", line, log_line(summary))
                    self.check_finite(state, step)
                    if evaluate is not None and step % eval_every == 0 and step != total:
                        self.writer.write(step, evaluate(state))
                    stopping = stop.at(step) and step != total
                    self.checkpointer.save(step, state, data_iterator=self.data_iterator, config=as_dict(settings),
                                           run=self.run_record, force=step == total or stopping)
                    if stopping:
                        self.checkpointer.wait()
                        raise Preempted(step, self.workdir / "checkpoints")
                self.checkpointer.wait()
        except KeyboardInterrupt:
            # Ctrl-C: a checkpoint being written is finished first (else orbax's commit threads die with the
            # interpreter, each printing a traceback, and the step is lost); a second Ctrl-C stops at once.
            self.checkpointer.wait()
            raise
        return state

    def check_finite(self, state: TrainState, step: int) -> None:
        """Stops the run once more consecutive updates were refused as non-finite than the config allows."""
        limit = self.settings.optim.max_consecutive_nonfinite
        if int(state.nonfinite) > limit:
            self.checkpointer.close()
            raise NonFiniteLossError(
                f"step {step}: {int(state.nonfinite)} consecutive non-finite losses/gradients (limit "
                f"{limit}); the updates were refused and the last good checkpoint in "
                f"{self.workdir / 'checkpoints'} is intact. Lower optim.lr or check the data.")

    def finish(self, metrics: dict | None, *, curves: list[str], png: str, title: str) -> None:
        """Writes the final evaluation's ``metrics`` (if any) at the last step, closes the writer and the
        checkpointer, and plots ``curves`` from metrics.jsonl (process 0)."""
        if metrics is not None:
            self.writer.write(self.settings.optim.total_steps, metrics)
        self.writer.close()
        self.checkpointer.close()
        if self.main:
            plot_curves(read_metrics(self.workdir / "metrics.jsonl"), curves, self.workdir / png, title=title)


def finish_policy_run(run: TrainingRun, results: dict, rows: list[dict], policy, tokenizer, *, curves: list[str],
                      png: str, title: str) -> None:
    """The end of an SFT or GRPO run: eval metrics, curves, HF export (in ``export_dtype``, ready to serve:
    ``caper_jax.data.serving``), predictions, then results.json.

    results.json comes last: it marks the run done (``caper_jax.experiments.stages.completion``), so a run stopped
    during the export is not taken for a finished one."""
    run.finish({k: v for k, v in results.items() if k.startswith("eval/")} if "eval/n" in results else None,
               curves=curves, png=png, title=title)
    if run.settings.export_hf:
        from caper_jax.models import to_hf  # hf_io (safetensors) loads on first use: models.__getattr__
        from caper_jax.data import serving

        out = to_hf(policy, policy.config, run.workdir / "hf_export", dtype=run.settings.export_dtype)
        if run.main:   # token ids, generation_config.json, the tokenizer with the policy's chat template
            serving.add_serving_files(out, tokenizer, generation=serving.generation_defaults(as_dict(run.settings)))
    if run.main:
        with (run.workdir / "predictions_eval.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        (run.workdir / "results.json").write_text(json.dumps(results, indent=1))


# -- dry run


def check_dry_run(settings) -> None:
    """The dry run's rule on top of the settings' own: it compiles ``model.preset``'s shapes (it reads no HF
    directory), so the preset must be known even when ``model.hf_dir`` is set. An experiment's settings
    (``caper_jax.experiments``) have no model of their own: each stage's is checked."""
    if not isinstance(settings, TrainerSettings):
        for field in dataclasses.fields(settings):   # configs/spider_verifier.py has no grpo stage
            stage = getattr(settings, field.name)
            if isinstance(stage, TrainerSettings):
                check_dry_run(stage)
        return
    if settings.model.preset not in PRESETS:
        raise ValueError(f"model.preset={settings.model.preset!r}: a dry run compiles a preset's shapes; expected "
                         f"one of {PRESETS}")


def dry_run_architecture(settings, **changes):
    """What a dry run compiles: ``model.preset``'s architecture in the settings' dtypes and remat, its
    layer groups scanned as on an accelerator, ``changes`` overriding fields
    (``caper_jax.rl.dry_run`` builds its PRM without remat)."""
    runtime = dict(dtype=settings.model.dtype, param_dtype=settings.model.param_dtype, remat=settings.model.remat,
                   unroll_layers=False)
    return model_preset(settings.model.preset, **{**runtime, **changes})


@dataclasses.dataclass
class AbstractRun:
    """What a dry run compiles against: the mesh, the model's graphdef, the train state as sharded
    ShapeDtypeStructs (no weights), the optimizer, and ``struct(shape, dtype)`` for a batch array."""
    mesh: Any
    rules: tuple
    graphdef: Any
    state: Any
    tx: Any

    def struct(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """An abstract batch array: rows split over the batch axes, the rest replicated."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=multihost.batch_sharding(self.mesh, len(shape), self.rules))

    def optimizer_bytes(self) -> int:
        """Per device: the train state's bytes beyond the params (moments, counters), resident while the
        run's other programs (evaluation, scoring) run."""
        return dry_run_lib.device_bytes(self.state) - dry_run_lib.device_bytes(self.state.params)


def abstract_run(settings, module: type[nnx.Module]) -> AbstractRun:
    """``module(arch, rngs=, mesh=, rules=)`` of ``dry_run_architecture`` with its optimizer state, abstract and
    sharded on the settings' mesh (over the compile target's devices); nothing allocated."""
    mesh, rules = mesh_and_rules(settings)
    arch = dry_run_architecture(settings)
    tx = make_optimizer(settings.optim)
    graphdef, abstract = rules_lib.abstract_train_state(
        lambda: module(arch, rngs=nnx.Rngs(0), mesh=mesh, rules=rules), lambda p: init_state(p, tx), mesh, rules)
    return AbstractRun(mesh, rules, graphdef, abstract, tx)


def dry_run(settings, module: type[nnx.Module], make_step: Callable[[Any, Any], Callable],
            make_batch: Callable[[Callable], dict], description: str, run: AbstractRun | None = None) -> dict:
    """Lowers + compiles a train step on abstract shapes for the current devices; no weights.

    ``module(arch, rngs=, mesh=, rules=)`` is the model of ``dry_run_architecture``; ``make_step(graphdef,
    tx)`` the jitted step; ``make_batch(struct)`` its batch, ``struct(shape, dtype)`` being an abstract
    array with the batch sharding. ``run``: the abstract run to compile against (default: built here).
    """
    run = run or abstract_run(settings, module)
    batch = make_batch(run.struct)
    step = make_step(run.graphdef, run.tx)
    print(description)
    return dry_run_lib.report(step, (run.state, batch), run.mesh, params=run.state.params)
