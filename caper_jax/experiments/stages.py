"""A pipeline as a list of named stages, run in order, each skipped once its output exists.

    Stage(name, output, function)     # output.exists() once function ran to its end; None: runs every time
    run_stages(stages, clock)         # what rerunning an interrupted command resumes from
    with_report(work, clock, ...)     # an experiment's stages, then its report with the seconds per stage
    run_experiment(stages_of, ...)    # the whole experiment in a workdir: its report's results

A stage's output is the last thing it writes (a trainer's or evaluator's ``results.json``, see
``completion``), so an interrupted stage runs again and a finished one never does; the trainers
resume from their own checkpoints inside a stage. Wall seconds per stage accumulate across resumed
runs in ``stage_seconds.json``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import jax

from caper_jax.parallel import multihost


class Output(Protocol):
    """What marks a stage done: a ``pathlib.Path``, or anything else that says whether it exists."""

    def exists(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str                      # its row in stage_seconds.json (the GRPO runs share one)
    output: Output | None          # exists once ``function`` ran to its end; None: cheap, runs every time
    function: Callable[[], Any]

    def done(self) -> bool:
        return self.output is not None and self.output.exists()


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """Done when any of ``outputs`` exists: e.g. a stage's own marker, or the output of the one stage
    that reads it (once that has finished, the input is no longer needed)."""
    outputs: tuple[Output, ...]

    def exists(self) -> bool:
        return any(output.exists() for output in self.outputs)


def completion(run_dir: pathlib.Path) -> pathlib.Path:
    """The output that marks a trainer's or evaluator's run complete: its results.json, the last
    thing each writes (after checkpoints and exports; ``caper_jax.loop``, ``caper_jax.prm.trainer``)."""
    return run_dir / "results.json"


class StageClock:
    """Wall seconds per stage, logged as each one ends and accumulated in ``path`` across resumed runs."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:  # a stage that was already done takes no time and is not logged
            multihost.log_main("== stage %s: %.1f s", name, elapsed)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        if multihost.is_main_process():
            self.path.write_text(json.dumps(self.seconds, indent=1) + "\n")


def start_stages(out: pathlib.Path) -> StageClock:
    """The workdir, XLA's persistent compilation cache and the stage clock: the many trainer runs and
    evaluations compile the same programs again and again, and the cache turns every compile after the
    first into a lookup.

    The cache is the one the caller configured (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``), else
    ``<workdir>/jax_cache``. JAX writes the cache's own path into every program's compile options (its
    ``xla_gpu_per_fusion_autotune_cache_dir``), so entries hit only in the folder they were written in:
    a copied cache misses everything; several workdirs share compiles through one configured cache."""
    out.mkdir(parents=True, exist_ok=True)
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return StageClock(out / "stage_seconds.json")


def stage_names(stages: Sequence[Stage]) -> tuple[str, ...]:
    """The distinct stage names in running order (the report's wall-time table)."""
    return tuple(dict.fromkeys(stage.name for stage in stages))


def run_stages(stages: Sequence[Stage], clock: StageClock) -> dict[str, Any]:
    """Runs, in order, every stage whose output does not exist yet, each timed under its name (a done
    stage adds ~0 s). Returns what the stages that ran returned, by name (the last of a shared name)."""
    returned = {}
    for stage in stages:
        with clock(stage.name):
            if not stage.done():
                returned[stage.name] = stage.function()
    return returned


def with_report(work: Sequence[Stage], clock: StageClock, collect: Callable[[], dict],
                write_report: Callable[[dict, tuple[str, ...]], None]) -> list[Stage]:
    """``work`` followed by the ``report`` stage, which runs every time: ``collect()``'s results plus the
    wall seconds per stage so far, written by ``write_report(results, order)`` (``order``: the stage
    names in running order, for the report's wall-time table) and returned."""
    order = (*stage_names(work), "report")

    def write_results() -> dict:
        results = collect()
        results["seconds"] = dict(clock.seconds)
        write_report(results, order)
        return results

    return [*work, Stage("report", None, write_results)]


def run_experiment(stages_of: Callable[[pathlib.Path, StageClock], Sequence[Stage]], workdir: str,
                   summarize: Callable[[dict, pathlib.Path, float], Any]) -> dict:
    """Runs an experiment's stages (``stages_of(out, clock)``, ending in ``with_report``'s report) in
    ``workdir`` and returns the report's results; ``summarize(results, out, wall seconds)`` gives the
    run's closing summary."""
    started = time.perf_counter()
    out = pathlib.Path(workdir)
    clock = start_stages(out)
    results = run_stages(stages_of(out, clock), clock)["report"]
    multihost.log_main("results: %s", out / "results.md")
    summarize(results, out, time.perf_counter() - started)
    return results
